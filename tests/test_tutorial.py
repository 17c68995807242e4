"""docs/tutorial.md and README.md cannot rot: every command in their ```console blocks is run as
a reader would run it (in a scratch folder holding the scripts, so that the files it writes
land there), and what it prints must match the output shown under it.

Matching is doctest's ELLIPSIS: '...' inside a line stands for any text, and a line holding
only '...' for any number of lines (timings, long tables). Trailing spaces do not count.

    python tests/test_tutorial.py --show     # run the tutorial's commands, print what they print
"""
import os
import re
import shlex
import subprocess
import sys

import pytest

from run_suite import ROOT, mpiexec, single_thread_env

TUTORIAL = os.path.join(ROOT, "docs", "tutorial.md")
README = os.path.join(ROOT, "README.md")


def blocks(text):
    """[(line number, [(command, expected output lines)])] of each ```console block: a command
    is a line starting with '$ ' (continued by a trailing backslash), its output the lines up to
    the next command or the end of the block."""
    out, lines, k = [], text.splitlines(), 0
    while k < len(lines):
        if lines[k].strip() != "```console":
            k += 1
            continue
        start, k, commands = k + 1, k + 1, []
        while lines[k].strip() != "```":
            line = lines[k]
            if line.startswith("$ "):
                command = line[2:]
                while command.endswith("\\"):
                    k += 1
                    command = command[:-1] + " " + lines[k].strip()
                commands.append((command, []))
            elif commands:
                commands[-1][1].append(line)
            else:
                raise ValueError(f"docs/tutorial.md line {k + 1}: output before any command in a console block")
            k += 1
        out.append((start, commands))
        k += 1
    return out


def pattern(expected):
    """A regular expression for the expected lines (ELLIPSIS as above)."""
    parts = []
    for line in expected:
        line = line.rstrip()
        if line == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append(".*?".join(re.escape(piece) for piece in line.split("...")) + r"[ \t]*\n")
    return re.compile("".join(parts) + r"\Z")


def run(command, folder, timeout=300):
    """The command as the tutorial writes it, with this Python and launcher, in `folder`."""
    words = shlex.split(command)
    if words[0] == "python":
        words[0] = sys.executable
    elif words[:2] == ["mpiexec", "-n"]:
        words = mpiexec(int(words[2]), *[sys.executable if w == "python" else w for w in words[3:]])
    proc = subprocess.run(words, cwd=folder, env=single_thread_env(MPIEXEC_TIMEOUT=timeout, CFP_FAILURE_WAIT=5),
                          capture_output=True, text=True, timeout=timeout + 30)
    return proc


def scratch(folder):
    """A folder in which the tutorial's relative paths work: scripts/ and an empty docs/pictures."""
    os.symlink(os.path.join(ROOT, "scripts"), os.path.join(folder, "scripts"))
    os.makedirs(os.path.join(folder, "docs", "pictures"))
    return folder


def normalised(stdout):
    return "".join(line.rstrip() + "\n" for line in stdout.splitlines())


@pytest.mark.parametrize("document,least", [(TUTORIAL, 8), (README, 6)], ids=["tutorial", "README"])
def test_commands_print_what_the_document_shows(tmp_path, document, least):
    with open(document) as f:
        found = blocks(f.read())
    name = os.path.relpath(document, ROOT)
    assert sum(len(c) for _, c in found) >= least, f"{name} lost its commands"
    folder = scratch(str(tmp_path))
    for line, commands in found:
        for command, expected in commands:  # in order: later commands read what earlier ones wrote
            proc = run(command, folder)
            assert proc.returncode == 0, f"{name} block at line {line}: `{command}` failed:\n{proc.stderr}"
            got = normalised(proc.stdout)
            assert pattern(expected).match(got), (
                f"{name} block at line {line}: `{command}` printed\n{got}\ninstead of\n"
                + "\n".join(expected))


def test_pictures_exist():
    """Every picture the tutorial shows is committed (make pictures draws them)."""
    with open(TUTORIAL) as f:
        shown = re.findall(r"\]\((pictures/[^)]+\.png)\)", f.read())
    assert len(shown) >= 10
    for path in shown:
        with open(os.path.join(ROOT, "docs", path), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", path


def test_ellipsis_matching():
    assert pattern(["a ... c", "...", "end"]).match("a b c\nx\ny\nend\n")
    assert pattern(["a", "...", "end"]).match("a\nend\n")
    assert not pattern(["a", "b"]).match("a\nc\n")
    assert not pattern(["a"]).match("a\nmore\n")  # the output may not run on unseen


def main():
    import tempfile
    with open(TUTORIAL) as f:
        found = blocks(f.read())
    with tempfile.TemporaryDirectory() as folder:
        scratch(folder)
        for line, commands in found:
            for command, _ in commands:
                proc = run(command, folder)
                print(f"$ {command}   # line {line}, exit {proc.returncode}")
                print(normalised(proc.stdout) + proc.stderr, end="")


if __name__ == "__main__":
    if sys.argv[1:] != ["--show"]:
        sys.exit(__doc__)
    main()
