"""cfp's mutation testing (`make mutation`): cosmic-ray over the modules where a wrong number is silent.

Each group of tests/mutation/cosmic-ray.toml is mutated in its own copy of the checkout (the
tracked and untracked, not ignored files), never in place, so a run cannot leave a mutated file
in the tree or disturb tests running there. For each group: cosmic-ray init; the mutants outside
the operator list, the second of each NumberReplacer pair, those listed in
tests/mutation/equivalent.txt and those the sample leaves out are marked skipped; a baseline run
of the unmutated copy must pass; cosmic-ray exec runs the group's test command once per mutant.
The report counts killed, survived, timed-out and skipped mutants and lists every survivor with
its source line (also in WORKDIR/report.txt).

  python tests/mutation/run.py [--workdir DIR] [--sample F] [--seed S] [--jobs J] [--group NAME]
                               [--rerun REPORT] [--since REV]
  python tests/mutation/run.py --repoint REV

--since REV runs only the mutants on lines changed since git revision REV (mutation-test what a
change touched). --rerun runs only the survivors a previous report lists (after tests were written for them),
matched by module, column, operator and the text of their line (so edits above them do not
lose them); the sample does not apply to them. --repoint REV rewrites equivalent.txt after an
edit: each entry whose line (its text at REV) has moved is pointed at the one line of the
module that now has that text, "as L:C" references with it (`make mutation-repoint`, REV
default HEAD); an entry whose text is gone or repeated is named and left for a person.
"""
import argparse
import concurrent.futures
import difflib
import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time

try:
    import tomllib
except ImportError:  # Python < 3.11
    import toml as tomllib  # cosmic-ray depends on toml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.join(ROOT, "tests", "mutation")
BIN = os.path.dirname(os.path.abspath(sys.executable))


# Why a mutant is not run: outside the operator list, listed equivalent, outside the sample, not a
# survivor of the report being rerun, on a line unchanged since --since.
SKIPPED = ("operator", "equivalent", "sample", "not a survivor", "unchanged")


def load_config():
    path = os.path.join(HERE, "cosmic-ray.toml")
    if tomllib.__name__ == "toml":
        return tomllib.load(path)
    with open(path, "rb") as f:
        return tomllib.load(f)


def load_equivalents():
    """{(module, line, col, operator): reason} from equivalent.txt:
    `module:line:col operator  # reason` (blank lines and lines starting with # are comments)."""
    out = {}
    with open(os.path.join(HERE, "equivalent.txt")) as f:
        for n, raw in enumerate(f, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            m = re.match(r"(\S+):(\d+):(\d+)\s+(\S+)\s+#\s*(.+)$", line)
            if not m:
                raise SystemExit(f"equivalent.txt:{n}: expected 'module:line:col operator  # reason'")
            out[(m[1], int(m[2]), int(m[3]), m[4])] = m[5]
    return out


def load_survivors(path):
    """{(module, col, operator, source line)} of the survivors a report.txt lists: matched by
    the line's text, not its number, so that they are found again after edits above them."""
    out = set()
    with open(path) as f:
        for raw in f:
            m = re.match(r"\s+(\S+):(\d+):(\d+) (\S+)\s+\| (.*)$", raw.rstrip("\n"))
            if m:
                out.add((m[1], int(m[3]), m[4], m[5].strip()))
    return out


def copy_tree(dest):
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                           check=True, capture_output=True).stdout.decode().split("\0")
    for rel in files:
        if not rel or not (rel.startswith(("cfp/", "tests/", "scripts/")) or rel in ("setup.cfg", "setup.py")):
            continue
        src = os.path.join(ROOT, rel)
        if not os.path.isfile(src):
            continue  # deleted in the working tree
        os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
        shutil.copy2(src, os.path.join(dest, rel))


def changed_lines(rev, modules):
    """{module path: set of line numbers} added or changed since git revision `rev`."""
    diff = subprocess.run(["git", "diff", "-U0", rev, "--", *modules], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout
    return diff_lines(diff)


def diff_lines(diff):
    """{path: the new side's line numbers} of each hunk of a `git diff -U0`."""
    out = {}
    path = None
    for line in diff.splitlines():
        if line.startswith("+++ "):
            path = line[6:] if line.startswith("+++ b/") else None
        m = re.match(r"@@ -\S+ \+(\d+)(?:,(\d+))? @@", line)
        if m and path:
            start, count = int(m[1]), int(m[2] or 1)
            out.setdefault(path, set()).update(range(start, start + count))
    return out


@functools.lru_cache(maxsize=None)
def _lines(path):
    with open(path) as f:
        return f.read().splitlines()


def source_line(tree, module, row):
    """Line `row` of `module` in the mutated copy, stripped."""
    lines = _lines(os.path.join(tree, module))
    return lines[row - 1].strip() if 0 < row <= len(lines) else ""


def test_script(group, tree, notorch):
    """The group's test command as a shell script: each stage with -x, stopping at the first failure."""
    py = sys.executable
    mpiexec = os.path.join(BIN, "mpiexec") if os.path.exists(os.path.join(BIN, "mpiexec")) else "mpiexec"
    common = "-q -x -p no:cacheprovider -p no:randomly"
    forms = {
        "serial": f"{py} -m pytest {common}",
        "np1": f"{py} -m mpi4py -m pytest {common} --with-mpi -m mpi",
        "np2": f"{mpiexec} -n 2 {py} -m mpi4py -m pytest {common} --with-mpi -m mpi",
    }
    lines = ["#!/bin/sh", "set -e", f"cd {tree}", "export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1",
             f"export PYTHONPATH={tree}:{notorch}", "export MPIEXEC_TIMEOUT=100"]
    lines += [stage.format(**forms) for stage in group["tests"]]
    path = os.path.join(os.path.dirname(tree), f"{group['name']}.sh")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def sampled(key, fraction, seed):
    if fraction >= 1:
        return True
    h = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2 ** 64 < fraction


def run_group(group, cfg, args, equivalents, log):
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    base = os.path.join(args.workdir, group["name"])
    shutil.rmtree(base, ignore_errors=True)
    tree = os.path.join(base, "tree")
    os.makedirs(tree)
    copy_tree(tree)
    notorch = os.path.join(base, "notorch")  # CI has no PyTorch: its tests skip here too
    os.makedirs(os.path.join(notorch, "torch"))
    with open(os.path.join(notorch, "torch", "__init__.py"), "w") as f:
        f.write("raise ModuleNotFoundError('PyTorch is hidden from cfp mutation runs, as in CI', name='torch')\n")
    script = test_script(group, tree, notorch)
    toml_path = os.path.join(base, "cosmic-ray.toml")
    mods = ", ".join(f'"{m}"' for m in group["modules"])
    with open(toml_path, "w") as f:
        f.write(f"[cosmic-ray]\nmodule-path = [{mods}]\ntimeout = {float(cfg['cosmic-ray']['timeout'])}\n"
                f"excluded-modules = []\ntest-command = \"sh {script}\"\n"
                f"[cosmic-ray.distributor]\nname = \"local\"\n")
    db = os.path.join(base, "session.sqlite")
    cr = os.path.join(BIN, "cosmic-ray")
    subprocess.run([cr, "init", toml_path, db], cwd=tree, check=True)

    keep = re.compile("|".join(f"(?:{p})$" for p in cfg["cfp"]["operators"]))
    first_only = cfg["cfp"].get("number-replacer-first-only", True)
    skipped = dict.fromkeys(SKIPPED, 0)
    with use_db(db, WorkDB.Mode.open) as work_db:
        for item in list(work_db.pending_work_items):
            (mut,) = item.mutations
            row, col = mut.start_pos
            key = (str(mut.module_path), row, col, mut.operator_name)
            why = None
            if not keep.match(mut.operator_name) or (
                    first_only and mut.operator_name == "core/NumberReplacer" and mut.occurrence % 2):
                why = "operator"
            elif key in equivalents:
                why = "equivalent"
            elif args.since is not None and row not in args.changed.get(key[0], ()):
                why = "unchanged"
            elif args.rerun is not None:
                line = source_line(tree, key[0], row)
                why = None if (key[0], col, key[3], line) in args.rerun else "not a survivor"
            elif not sampled(f"{key}:{mut.occurrence}", args.sample, args.seed):
                why = "sample"
            if why:
                skipped[why] += 1
                work_db.set_result(item.job_id, WorkResult(output=f"skipped: {why}",
                                                           worker_outcome=WorkerOutcome.SKIPPED))
        pending = len(list(work_db.pending_work_items))
    log(f"[{group['name']}] {pending} mutants to run ({skipped['operator']} outside the operator list, "
        f"{skipped['equivalent']} equivalent, {skipped['sample'] + skipped['not a survivor']} left out by the "
        f"{'sample' if args.rerun is None else 'rerun'}, {skipped['unchanged']} on unchanged lines)")

    t0 = time.time()
    base_rc = subprocess.run(["sh", script], capture_output=True, text=True)
    if base_rc.returncode != 0:
        log(f"[{group['name']}] the unmutated tests fail")
        raise SystemExit(f"[{group['name']}] the unmutated tests fail:\n{base_rc.stdout[-3000:]}{base_rc.stderr[-2000:]}")
    log(f"[{group['name']}] baseline passes in {time.time() - t0:.1f} s")
    t0 = time.time()
    subprocess.run([cr, "exec", toml_path, db], cwd=tree, check=True)
    elapsed = time.time() - t0
    return collect(group, db, tree, elapsed, skipped)


def report_only(group, args):
    """The counts of a finished (or interrupted) run of GROUP in args.workdir, without running it."""
    db = os.path.join(args.workdir, group["name"], "session.sqlite")
    return collect(group, db, os.path.join(args.workdir, group["name"], "tree"), 0.0,
                   dict.fromkeys(SKIPPED, 0))


def collect(group, db, tree, elapsed, skipped):
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome

    counts = {"killed": 0, "survived": 0, "timeout": 0, "incompetent": 0}
    survivors = []
    sources = {}
    with use_db(db, WorkDB.Mode.open) as work_db:
        for item, result in work_db.completed_work_items:
            if result.worker_outcome == WorkerOutcome.SKIPPED:
                continue
            (mut,) = item.mutations
            if result.test_outcome == TestOutcome.KILLED and (result.output or "").strip() == "timeout":
                counts["timeout"] += 1
            elif result.test_outcome == TestOutcome.SURVIVED:
                counts["survived"] += 1
                path = str(mut.module_path)
                if path not in sources:
                    with open(os.path.join(tree, path)) as f:
                        sources[path] = f.read().splitlines()
                row, col = mut.start_pos
                survivors.append(f"{path}:{row}:{col} {mut.operator_name}  | {sources[path][row - 1].strip()}")
            elif result.test_outcome == TestOutcome.INCOMPETENT:
                counts["incompetent"] += 1
            else:
                counts["killed"] += 1
    return {"name": group["name"], "counts": counts, "skipped": skipped, "elapsed": elapsed,
            "survivors": sorted(survivors, key=lambda s: (s.split(":")[0], int(s.split(":")[1])))}


def repointed(entries, old_lines, new_lines):
    """(equivalent.txt's lines with every moved entry repointed, [entries left alone: their
    line's text is gone, or on several lines and not where the diff keeps it]) from its lines
    `entries` and, per module, `old_lines` (the module's lines at the entries' revision) and
    `new_lines` (now). An entry stays where its line is unchanged, moves to where the line diff
    of the module keeps its line (difflib: a line in a run of at least two unchanged ones, even
    one whose text is on several lines, as a repeated statement in two functions is), else to
    the one line that has its text, and "as L:C" in an entry follows line L of its own module."""
    moved, out, lost = {}, [], []
    kept = {}  # per module: {old line: new line} of the lines the diff leaves unchanged, in runs of 2 or more
    for module in old_lines:
        matcher = difflib.SequenceMatcher(None, old_lines[module], new_lines[module], autojunk=False)
        kept[module] = {a + k + 1: b + k + 1 for a, b, size in matcher.get_matching_blocks() if size >= 2
                        for k in range(size)}
    for raw in entries:
        m = re.match(r"^(\S+?):(\d+):(\d+) (.*)$", raw)
        if not m:
            out.append(raw)
            continue
        module, line, rest = m.group(1), int(m.group(2)), raw[m.end(1) + 1 + len(m.group(2)):]
        old, new = old_lines[module], new_lines[module]
        text = old[line - 1] if line <= len(old) else None
        if line <= len(new) and new[line - 1] == text:
            out.append(raw)
            continue
        hits = [kept[module][line]] if line in kept[module] else [i + 1 for i, t in enumerate(new) if t == text]
        if len(hits) != 1:
            lost.append(raw)
            out.append(raw)
            continue
        moved[(module, line)] = hits[0]
        out.append(f"{module}:{hits[0]}{rest}")
    result = []
    for raw in out:
        m = re.match(r"^(\S+?):\d+:\d+ ", raw)
        if m:
            module = m.group(1)
            raw = re.sub(r"as (\d+):(\d+)", lambda a: f"as {moved.get((module, int(a.group(1))), int(a.group(1)))}:"
                                                      f"{a.group(2)}", raw)
        result.append(raw)
    return result, lost


def repoint(rev):
    """--repoint: equivalent.txt rewritten against the sources at git revision `rev` (repointed)."""
    path = os.path.join(HERE, "equivalent.txt")
    with open(path) as f:
        entries = f.read().split("\n")
    modules = sorted({m.group(1) for m in (re.match(r"^(\S+?):\d+:\d+ ", e) for e in entries) if m})
    old = {m: subprocess.run(["git", "show", f"{rev}:{m}"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split("\n") for m in modules}
    new = {}
    for m in modules:
        with open(os.path.join(ROOT, m)) as f:
            new[m] = f.read().split("\n")
    result, lost = repointed(entries, old, new)
    with open(path, "w") as f:
        f.write("\n".join(result))
    changed = sum(a != b for a, b in zip(entries, result))
    print(f"{changed} entries repointed against {rev}; {len(lost)} whose line is gone or repeated:")
    for e in lost:
        print(f"  {e}")
    return 1 if lost else 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "cfp-mutation"))
    p.add_argument("--sample", type=float, default=1.0, help="fraction of the mutants to run (a fixed hash of each)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=1, help="groups run at once, each in its own copy")
    p.add_argument("--group", action="append", help="run only these groups (default: all)")
    p.add_argument("--report-only", action="store_true", help="report on the sessions already in --workdir")
    p.add_argument("--rerun", metavar="REPORT", help="run only the survivors listed in this report.txt")
    p.add_argument("--since", metavar="REV", help="run only the mutants on lines changed since this git revision")
    p.add_argument("--repoint", metavar="REV", help="point equivalent.txt's entries at their lines' text as of this "
                                                    "git revision, and run nothing")
    args = p.parse_args(argv)
    if args.repoint is not None:
        return repoint(args.repoint)
    if args.rerun is not None:
        args.rerun = load_survivors(args.rerun)
        if not args.rerun:
            raise SystemExit("--rerun: the report lists no survivors")
    args.workdir = os.path.abspath(args.workdir)
    if args.workdir == ROOT or args.workdir.startswith(ROOT + os.sep) and not args.workdir.startswith(
            os.path.join(ROOT, ".mutation")):
        raise SystemExit("--workdir must be outside the checkout (or under .mutation/)")
    cfg = load_config()
    equivalents = load_equivalents()
    groups = [g for g in cfg["cfp"]["group"] if not args.group or g["name"] in args.group]
    if args.since is not None:
        args.changed = changed_lines(args.since, [m for g in groups for m in g["modules"]])
    os.makedirs(args.workdir, exist_ok=True)

    def log(msg):
        print(msg, flush=True)

    t0 = time.time()
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        work = (lambda g: report_only(g, args)) if args.report_only else (
            lambda g: run_group(g, cfg, args, equivalents, log))
        results = list(pool.map(work, groups))
    total = {"killed": 0, "survived": 0, "timeout": 0, "incompetent": 0}
    what = f"sample {args.sample:g}, seed {args.seed}" if args.rerun is None else \
        f"rerun of {len(args.rerun)} survivors"
    if args.since is not None:
        what += f", lines changed since {args.since}"
    lines = [f"cfp mutation testing (cosmic-ray), {what}, "
             f"{len(equivalents)} listed equivalent", ""]
    lines.append(f"{'group':<15}{'run':>6}{'killed':>8}{'survived':>10}{'timeout':>9}{'incompetent':>13}"
                 f"{'equivalent':>12}{'minutes':>9}")
    for r in results:
        c = r["counts"]
        for k in total:
            total[k] += c[k]
        lines.append(f"{r['name']:<15}{sum(c.values()):>6}{c['killed']:>8}{c['survived']:>10}{c['timeout']:>9}"
                     f"{c['incompetent']:>13}{r['skipped']['equivalent']:>12}{r['elapsed'] / 60:>9.1f}")
    ran = sum(total.values())
    detected = total["killed"] + total["timeout"]
    score = 100.0 * detected / max(1, detected + total["survived"])
    lines.append(f"{'all':<15}{ran:>6}{total['killed']:>8}{total['survived']:>10}{total['timeout']:>9}"
                 f"{total['incompetent']:>13}{sum(r['skipped']['equivalent'] for r in results):>12}"
                 f"{(time.time() - t0) / 60:>9.1f}")
    lines += ["", f"score: {score:.1f}% of the non-equivalent mutants killed (timeouts count as killed; "
                  "incompetent mutants, which cannot be run, count neither way)", "", "survivors:"]
    for r in results:
        lines += [f"  {s}" for s in r["survivors"]]
    if not any(r["survivors"] for r in results):
        lines.append("  none")
    report = "\n".join(lines) + "\n"
    with open(os.path.join(args.workdir, "report.txt"), "w") as f:
        f.write(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
