"""tests/mutation/run.py, the runner behind `make mutation` (not part of CI itself): its list of
equivalent mutants parses and points into cfp's sources, and --rerun reads a report's survivors."""
import importlib.util
import os
import re

_SPEC = importlib.util.spec_from_file_location(
    "cfp_mutation_run", os.path.join(os.path.dirname(os.path.abspath(__file__)), "mutation", "run.py"))
run = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(run)


# What each operator listed in equivalent.txt mutates, as the source text at its (line, col)
# starts: an entry whose line has moved since it was written (an edit above it) points at other
# text, and would silently skip whatever mutant now sits there.
_SYMBOLS = {"Sub": "-", "Add": "+", "Mul": "*", "Div": "/", "FloorDiv": "//", "Mod": "%", "Pow": "**",
            "Eq": "==", "NotEq": "!=", "Lt": "<", "LtE": "<=", "Gt": ">", "GtE": ">=",
            "USub": "-", "UAdd": "+"}
_WORDS = {"ReplaceFalseWithTrue": "False", "ReplaceTrueWithFalse": "True",
          "ReplaceAndWithOr": "and", "ReplaceOrWithAnd": "or"}


def _mutated_text_matches(operator, text):
    name = operator.split("/", 1)[1]
    if name == "NumberReplacer":
        return re.match(r"\d|\.\d", text) is not None
    if name in _WORDS:
        return re.match(_WORDS[name] + r"\b", text) is not None
    family, _, pair = name.partition("Operator_")
    replaced = pair.split("_")[0]  # ReplaceBinaryOperator_Sub_Add replaces Sub
    if family in ("ReplaceBinary", "ReplaceComparison", "ReplaceUnary") and replaced in _SYMBOLS:
        symbol = re.match(r"[-+*/%<>=!]+", text)
        return symbol is not None and symbol[0] == _SYMBOLS[replaced]
    raise AssertionError(f"no rule for what {operator} mutates: add it to _SYMBOLS or _WORDS")


def test_every_listed_equivalent_names_a_line_of_a_mutated_module():
    equivalents = run.load_equivalents()
    assert equivalents
    modules = [m for g in run.load_config()["cfp"]["group"] for m in g["modules"]]
    for (module, line, col, operator), reason in equivalents.items():
        assert any(module == m or module.startswith(m.rstrip("/") + "/") for m in modules), module
        with open(os.path.join(run.ROOT, module)) as f:
            source = f.read().splitlines()
        assert 1 <= line <= len(source) and col < len(source[line - 1]), (module, line, col)
        assert operator.startswith("core/") and reason.strip()
        for ref in re.findall(r"\bas (\d+):(\d+)", reason):  # "as L:C": another entry of this module
            assert any(k[:3] == (module, int(ref[0]), int(ref[1])) for k in equivalents), (module, line, col, ref)
        text = source[line - 1][col:]
        assert _mutated_text_matches(operator, text), (f"{module}:{line}:{col} {operator} points at {text!r}: "
                                                       f"the line moved? ({reason})")


def test_rerun_reads_the_survivors_of_a_report(tmp_path):
    report = tmp_path / "report.txt"
    report.write_text("score: 99.0% ...\n\nsurvivors:\n"
                      "  cfp/comm.py:416:13 core/ReplaceAndWithOr  | if p > 1 and checking():\n"
                      "  cfp/nn/conv.py:77:45 core/NumberReplacer  | x_shape = tuple(...) | more\n")
    assert run.load_survivors(str(report)) == {
        ("cfp/comm.py", 13, "core/ReplaceAndWithOr", "if p > 1 and checking():"),
        ("cfp/nn/conv.py", 45, "core/NumberReplacer", "x_shape = tuple(...) | more")}


def test_the_sample_is_a_fixed_fraction_of_the_mutants():
    keys = [f"m{i}" for i in range(4000)]
    chosen = [k for k in keys if run.sampled(k, 0.1, 0)]
    assert 300 < len(chosen) < 500 and chosen == [k for k in keys if run.sampled(k, 0.1, 0)]
    assert chosen != [k for k in keys if run.sampled(k, 0.1, 1)] and all(run.sampled(k, 1.0, 0) for k in keys)


def test_since_reads_the_changed_lines_of_a_diff():
    diff = ("diff --git a/cfp/comm.py b/cfp/comm.py\n--- a/cfp/comm.py\n+++ b/cfp/comm.py\n"
            "@@ -10,2 +10,3 @@ def f():\n-a\n-b\n+a\n+b\n+c\n@@ -40 +41 @@\n-x\n+y\n"
            "@@ -50,2 +51,0 @@\n-gone\n-gone\n"
            "diff --git a/cfp/old.py b/cfp/old.py\n--- a/cfp/old.py\n+++ /dev/null\n@@ -1 +0,0 @@\n-z\n")
    assert run.diff_lines(diff) == {"cfp/comm.py": {10, 11, 12, 41}}


def test_repoint_follows_each_entrys_line_by_its_text():
    """--repoint: an entry whose line moved (a line inserted above) points at it again, an "as
    L:C" reference with it; an unchanged one stays; a line whose text is on several lines
    follows the line diff where it keeps the line among unchanged ones (a statement repeated in
    two functions, both moved); one whose text is gone, or moved and now on two lines the diff
    does not keep it at, is left as it was and named."""
    old = {"m.py": ["a = 1", "b = 2", "c = 3", "d = 4", "x", "d = 4", "y"]}
    new = {"m.py": ["new = 0", "a = 1", "b = 2", "c = 9", "d = 4", "x", "d = 4", "y", "z", "b = 2"]}
    entries = ["# comment", "m.py:2:4 core/NumberReplacer  # b",
               "m.py:1:4 core/NumberReplacer  # as 2:4, a", "m.py:3:4 core/NumberReplacer  # c",
               "m.py:4:4 core/NumberReplacer  # d", "m.py:6:4 core/NumberReplacer  # as 4:4, the second d", ""]
    result, lost = run.repointed(entries, old, new)
    assert result == ["# comment", "m.py:3:4 core/NumberReplacer  # b",
                      "m.py:2:4 core/NumberReplacer  # as 3:4, a", "m.py:3:4 core/NumberReplacer  # c",
                      "m.py:5:4 core/NumberReplacer  # d", "m.py:7:4 core/NumberReplacer  # as 5:4, the second d", ""]
    assert lost == ["m.py:3:4 core/NumberReplacer  # c"]
    moved = {"m.py": ["p", "q = 1", "r"]}
    twice = {"m.py": ["q = 1", "s", "q = 1"]}  # q moved and now on two lines, neither kept by the diff
    assert run.repointed(["m.py:2:4 core/NumberReplacer  # q"], moved, twice)[1] == ["m.py:2:4 core/NumberReplacer  # q"]
