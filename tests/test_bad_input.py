"""The bad-input catalogue: each kind of bad input to the scripts and the Python API, run
under mpiexec as a user would, must end the job with exactly one clear message naming the
problem, a non-zero exit status and within seconds; a race test repeats a quick failure
and requires the message every time (no MPI_Abort may kill rank 0 before it is out)."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from cfp import backend
from launcher import OPEN_MPI, launcher
from run_suite import ROOT, mpiexec, single_thread_env
from test_scripts import run, write_problem

SCRIPTS = os.path.join(ROOT, "scripts")
API_CASE = os.path.join(ROOT, "tests", "harness", "api_case.py")
QUICK = ["--no-progress", "--grid", "channel=2", "--epochs", "1", "--train-samples", "128", "--batch-size", "32"]


def fails_once(nprocs, script, args, message, seconds=30):
    """Run `script args` on `nprocs` ranks; it must fail with one `name: error:` line that
    matches `message`, a non-zero status, within `seconds`."""
    proc, took = run(nprocs, args, timeout=60, script=script)
    name = os.path.basename(script)
    assert proc.returncode != 0, f"{args}: exit status 0\n{proc.stdout}{proc.stderr}"
    assert proc.stderr.count(f"{name}: error:") == 1, f"{args}: not one error line:\n{proc.stderr}"
    assert re.search(message, proc.stderr), f"{args}: {message!r} not in:\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    assert took < seconds, f"{args}: took {took:.1f} s"
    return proc


@pytest.fixture
def files(tmp_path):
    """Paths that cannot be written (as root too), and one that is a directory."""
    plain = tmp_path / "plain-file"
    plain.write_text("not a directory")
    return {"tmp": tmp_path, "under_file": str(plain / "out.json"), "dir": str(tmp_path),
            "plain": str(plain), "proc": "/proc/cfp-cannot-write-here.json",
            "proc_png": "/proc/cfp-cannot-write-here.png", "jpg": str(tmp_path / "curves.jpg")}


TRAIN_CASES = [
    (["--model", "vgg"], "unknown model 'vgg'"),
    (["--optimizer", "rmsprop"], "unknown optimizer 'rmsprop'"),
    (["--dtype", "float16"], "unknown dtype 'float16'"),
    (["--grid", "sample=2", "--batch-size", "1"], "batch size 1 is smaller than the sample axis"),
    (["--grid", "channel=2", "--model", "wide", "--width", "1"], "width=1 gives 1 channels"),
    (["--grid", "sample=3"], "grid sample=3 needs 3 ranks, the communicator has 2"),
    (["--grid", "depth=2"], r"stem.conv: conv2d on a grid splitting depth \(depth=2\): depth splits volumes"),
    (["--grid", "time=2"], "unknown grid axis 'time'"),
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--max-steps", "0"], "--max-steps must be a positive integer, got 0"),
    (["--max-steps", "-3"], "--max-steps must be a positive integer, got -3"),
    (["--train-samples", "-10"], "--train-samples must be a positive integer, got -10"),
    (["--train-samples", "99999"], "--train-samples 99999 is more than the 1437 training samples"),
    (["--epochs", "0"], "epochs must be a positive integer"),
    (["--lr", "nan"], "--lr must be a finite number, got nan"),
    (["--lr", "inf"], "--lr must be a finite number, got inf"),
    (["--lr", "-0.1"], r"--lr must be > 0, got -0.1"),
    (["--weight-decay", "nan"], "--weight-decay must be a finite number"),
    (["--algorithm", "auto", "--memory-limit", "nan"], "--memory-limit must be a finite number, got nan"),
    (["--algorithm", "auto", "--filter-groups", "2"], "--filter-groups applies to --algorithm w only"),
    (["--algorithm", "y", "--profile", "cpu-dev"], "--profile applies to --algorithm auto only"),
    (["--memory-limit", "64"], "--memory-limit applies to --algorithm auto only"),
    (["--depth", "3"], "--depth applies to --model wide only"),
    (["--optimizer", "adam", "--momentum", "0.5"], "--momentum applies to --optimizer sgd only"),
    (["--batch-size", "many"], "argument --batch-size: invalid int value: 'many'"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate \\(see train.py --help\\)"),
    (["--epoch", "3"], r"unrecognized arguments: --epoch 3; did you mean --epochs\? \(see train.py --help\)"),
    (["--checkpoint", "ckpt"], r"unrecognized arguments: --checkpoint ckpt; did you mean --checkpoint-dir\?"),
    (["--epoch", "3", "--bach-size", "4"], r"did you mean --epochs for --epoch\?; did you mean --batch-size for "
                                           r"--bach-size\?"),
    (["--dataset", "imagenet"], "unknown dataset 'imagenet'; expected one of digits, synthetic, npz:PATH, cifar10:DIR"),
    (["--dataset", "npz:/nonexistent/data.npz"], "dataset '/nonexistent/data.npz' does not exist"),
    (["--dataset", "cifar10:/nonexistent"], "CIFAR-10 directory '/nonexistent' does not exist"),
    (["--dataset", "npz:x.npz", "--upsample", "2"], "--upsample applies to --dataset digits and synthetic only"),
    (["--node-axes", "time"], "node axis 'time': expected one of sample, depth, height, width, channel"),
    (["--grid", "channel=2", "--node-axes", "sample"],
     "node axis 'sample': grid channel=2 does not split it \\(it splits channel\\)"),
    (["--grid", "channel=2", "--node-axes", "channel,channel"], "node axes channel,channel: an axis is named twice"),
    (["--plan", "plan.json", "--node-axes", "sample"], "--node-axes and --plan both place the layers' ranks"),
    (["--device", "tpu"], "unknown device 'tpu'; expected one of cpu, gpu"),
    (["--overlap", "sometimes"], "unknown overlap 'sometimes'; expected one of off, grads, all"),
    (["--overlap", "off", "--chunks", "2"], "--overlap off runs every collective blocking"),
    (["--bucket-mb", "-1"], "--bucket-mb must be >= 0"),
    (["--mpi-progress", "thread"], "--mpi-progress thread progresses the collectives started during a step"),
    (["--overlap", "all", "--chunks", "64", "--batch-size", "1"],
     r"--chunks 64 is more than the 1 sample\(s\) a rank of layer \S+ holds .* and the \d+ channel\(s\) or filter"),
    (["--augment", "--eval-only", "--resume", "--checkpoint-dir", "ckpt"],
     "--augment changes the training batches only; with --eval-only, which does not train, it would be ignored"),
]


@pytest.mark.parametrize("args,message", TRAIN_CASES, ids=[" ".join(a) for a, _ in TRAIN_CASES])
def test_train_bad_option(args, message):
    fails_once(2, os.path.join(SCRIPTS, "train.py"), QUICK + args, message)


@pytest.mark.skipif(backend.cupy_available(), reason="CuPy imports here: the device tests run it (tests/test_device.py)")
def test_device_gpu_without_cupy_is_one_line_and_status_2():
    """--device gpu where CuPy does not import: one line naming the missing piece, on every
    run, before any work (status 2, the scripts' status for bad input)."""
    for _ in range(3):
        proc = fails_once(2, os.path.join(SCRIPTS, "train.py"), QUICK + ["--device", "gpu"],
                          r"--device gpu needs CuPy, which does not import here \(install")
        assert proc.returncode == 2, proc.returncode


def test_node_axes_without_a_grid_for_the_planner_is_refused():
    """--node-axes places --grid's ranks; under --algorithm auto without --grid the planner
    places each layer's grid itself, so the option would be ignored."""
    fails_once(2, os.path.join(SCRIPTS, "train.py"), ["--no-progress", "--epochs", "1", "--algorithm", "auto",
                                                      "--node-axes", "sample"],
               "--node-axes places the ranks of --grid; without --grid the planner chooses each layer's grid and "
               "placement")


@pytest.mark.parametrize("option,key,message", [
    ("--log", "dir", "--log '.*' is a directory; expected a file name"),
    ("--log", "under_file", "--log '.*' cannot be made: '.*plain-file' is a file"),
    ("--plot", "proc_png", "--plot '/proc/.*' cannot be written"),
    ("--plot", "jpg", "--plot '.*curves.jpg': the file name's extension chooses the picture's format; expected .png, "
                      ".pdf, .svg, got '.jpg'"),
    ("--checkpoint-dir", "plain", "--checkpoint-dir '.*plain-file' exists and is not a directory"),
    ("--algorithm auto --profile", "dir", "machine profile '.*' is a directory"),
])
def test_train_bad_path_fails_before_the_work(files, option, key, message):
    *before, flag = option.split()
    proc = fails_once(2, os.path.join(SCRIPTS, "train.py"), QUICK + before + [flag, files[key]], message)
    assert "test accuracy" not in proc.stdout  # nothing was trained


def test_a_grid_larger_than_a_one_rank_job_says_how_to_launch():
    """A script started without mpiexec (one rank) on a grid of 4 says how to start 4; on 2
    ranks (mpiexec given, the count wrong) it says only what is wrong."""
    proc = fails_once(1, os.path.join(SCRIPTS, "train.py"), QUICK + ["--grid", "sample=2,channel=2"],
                      r"grid sample=2,channel=2 needs 4 ranks, the communicator has 1; run it on 4 ranks: "
                      r"mpiexec -n 4 python -m mpi4py .*train.py \.\.\.")
    assert proc.stderr.count("mpiexec -n 4") == 1
    proc = fails_once(2, os.path.join(SCRIPTS, "train.py"), QUICK + ["--grid", "sample=2,channel=2"],
                      "grid sample=2,channel=2 needs 4 ranks, the communicator has 2")
    assert "mpiexec -n" not in proc.stderr


def test_help_shows_the_choices_and_defaults():
    out = subprocess.run([sys.executable, os.path.join(SCRIPTS, "train.py"), "--help"], capture_output=True,
                         text=True, timeout=60, env=single_thread_env()).stdout
    for shown in ("--model {resnet,wide,mobile,volume,unet}", "--algorithm {sample,x,y,w,auto}", "--optimizer {sgd,adam,adamw}",
                  "--schedule {cosine,step,constant}", "--dtype {float32,float64}"):
        assert shown in out, (shown, out)
    flat = " ".join(out.split())
    for shown in ("(default: resnet)", "peak learning rate (default: 0.1)", "global mini-batch (default: 64)"):
        assert shown in flat, (shown, out)


def test_train_bad_plan_file(tmp_path):
    """A plan file that is missing, not JSON, not a plan, or that no run of this model on these
    ranks can follow: one line, before any training."""
    train = os.path.join(SCRIPTS, "train.py")
    garbled, wrong_form, too_big = tmp_path / "garbled.json", tmp_path / "form.json", tmp_path / "big.json"
    garbled.write_text("{not json")
    wrong_form.write_text('{"stem.conv": {"grid": "sample=2"}}')
    too_big.write_text('{"layers": {"layer2.conv1": {"grid": "sample=3", "algorithm": "y"}}}')
    typo = tmp_path / "typo.json"
    typo.write_text('{"layers": {"layer2.conv1": {"grid": "sample=1,chanel=2", "algorithm": "y"}}}')
    unplaced = tmp_path / "unplaced.json"
    unplaced.write_text('{"layers": {"layer2.conv1": {"algorithm": "y", "node_axes": "sample"}}}')
    misplaced = tmp_path / "misplaced.json"
    misplaced.write_text('{"layers": {"layer2.conv1": {"grid": "sample=2", "algorithm": "y", "node_axes": "channel"}}}')
    for path, message in ((tmp_path / "missing.json", "plan file '.*missing.json' does not exist; make one with "
                           "scripts/plan.py, e.g. `python scripts/plan.py --model resnet .* --out .*missing.json`"),
                          (typo, "plan file '.*typo.json': plan entry of layer layer2.conv1: unknown grid axis 'chanel'"),
                          (unplaced, "plan entry of layer layer2.conv1: node_axes places the ranks of the "
                                     "entry's grid; give its \"grid\" too"),
                          (misplaced, "plan entry of layer layer2.conv1: node axis 'channel': grid sample=2 does "
                                      "not split it"),
                          (garbled, "plan file '.*garbled.json' is not valid JSON"),
                          (wrong_form, "plan file '.*form.json': expected an object"),
                          (too_big, "plan entry of layer layer2.conv1: grid 'sample=3' needs 3 ranks, this run has 2")):
        proc = fails_once(2, train, QUICK + ["--plan", str(path)], message)
        assert "test accuracy" not in proc.stdout
    fails_once(2, train, QUICK + ["--plan", str(too_big), "--algorithm", "auto"],
               "--plan and --algorithm auto both choose")


def test_train_profile_without_links_is_refused(tmp_path):
    bad = tmp_path / "profile.json"
    bad.write_text('{"format": 2, "name": "half a profile", "ranks_per_node": 2}')
    fails_once(2, os.path.join(SCRIPTS, "train.py"), QUICK + ["--algorithm", "auto", "--profile", str(bad)],
               "is not a valid machine profile: missing or malformed 'links'")


def test_train_that_diverges_stops_with_a_message_and_no_nan_in_the_log(tmp_path):
    log, ckpt = tmp_path / "run.json", tmp_path / "ckpt"
    proc = fails_once(2, os.path.join(SCRIPTS, "train.py"),
                      QUICK + ["--lr", "1e6", "--log", str(log), "--checkpoint-dir", str(ckpt)],
                      r"training diverged at step \d+: .*try a smaller learning rate than --lr 1e\+06", seconds=60)
    assert "RuntimeWarning" not in proc.stderr
    text = log.read_text()
    assert "NaN" not in text and "Infinity" not in text
    record = json.loads(text)
    assert record["summary"] is None and record["diverged"]["step"] >= 1
    assert all(np.isfinite(s["loss"]) for s in record["steps"])
    assert not any(p.name.startswith("step-") for p in ckpt.iterdir()) if ckpt.exists() else True


@pytest.fixture
def problem(tmp_path):
    args, _ = write_problem(tmp_path)
    return args, tmp_path


def _with(args, flag, value):
    changed = list(args)
    changed[changed.index(flag) + 1] = value
    return changed


RUN_CONV = os.path.join(SCRIPTS, "run_conv.py")


def test_run_conv_bad_input(problem, files):
    args, folder = problem
    base = ["--algorithm", "y", "--grid", "channel=2", "--out", str(folder / "r.npz")]
    nan_x = folder / "nan_x.npy"
    x = np.load(_value(args, "--input"))
    x[0, 0, 0, 0] = np.nan
    np.save(nan_x, x)
    int_x = folder / "int_x.npy"
    np.save(int_x, np.zeros(x.shape, dtype=np.int64))
    cases = [
        (_with(args, "--input", str(nan_x)) + base, "input holds 1 NaN or infinite value.*--allow-nonfinite"),
        (_with(args, "--input", str(int_x)) + base, "input has dtype int64; expected float32 or float64"),
        (args + ["--algorithm", "y", "--grid", "channel=2", "--out", files["dir"]], "--out '.*' is a directory"),
        (args + ["--algorithm", "y", "--grid", "channel=2", "--out", files["proc"]], "--out '/proc/.*' cannot be written"),
        (_with(args, "--padding", "9") + ["--algorithm", "y", "--grid", "height=2", "--padding-mode", "reflect",
                                          "--out", str(folder / "r.npz")],
         r"with padding_mode 'reflect' must be smaller than the input"),
        (args + ["--algorithm", "y", "--grid", "channel=2"], "the following arguments are required: --out"),
        (args + ["--algorithm", "x", "--grid", "channel=2", "--filter-groups", "2", "--out", str(folder / "r.npz")],
         "applies to algorithm 'w' only"),
        (_with(args, "--stride", "0") + base, "stride must be a positive integer"),
        (_with(args, "--stride", "2,x") + base, r"argument --stride: '2,x': expected an integer or one per axis, A,B \(A,B,C for a volume\)"),
        (_with(args, "--padding", "full") + base, r"argument --padding: 'full': expected an integer or one per axis, A,B \(A,B,C for a volume\) or 'same' or 'valid'"),
        (_with(args, "--padding", "same") + base + ["--stride", "2"], "padding 'same' is not supported for strided"),
        (args + base + ["--groups", "2"], "groups=2 must divide the input channels C=5"),
        (args + base + ["--padding-mode", "mirror"], "padding_mode 'mirror' is not one of"),
        (args + base + ["--dilation", "9"], r"with dilation \(9, 9\) .* does not fit the padded input"),
    ]
    for case_args, message in cases:
        fails_once(2, RUN_CONV, case_args, message)
    assert not (folder / "r.npz").exists()  # every failure came before the work
    # With the flag the NaN goes through, as asked.
    proc, _ = run(2, _with(args, "--input", str(nan_x)) + base + ["--allow-nonfinite"], script=RUN_CONV)
    assert proc.returncode == 0, proc.stderr
    with np.load(folder / "r.npz", allow_pickle=False) as result:
        assert np.isnan(result["y"]).any()


def _value(args, flag):
    return args[args.index(flag) + 1]


PLAN = os.path.join(SCRIPTS, "plan.py")


@pytest.mark.parametrize("args,message", [
    (["--ranks", "0"], "--ranks must be a positive integer, got 0"),
    (["--ranks", "4", "--memory-limit", "nan"], "--memory-limit must be a finite number, got nan"),
    (["--ranks", "4", "--grid", "height=3"], "grid height=3 has 3 ranks, --ranks says 4"),
    (["--ranks", "4", "--grid", "sample=3"], "grid sample=3 has 3 ranks, --ranks says 4"),
    (["--ranks", "4", "--model", "vgg"], "unknown model 'vgg'"),
    (["--ranks", "4", "--profile", "no-such-machine"], "machine profile 'no-such-machine' does not exist"),
    (["--ranks", "4", "--width", "-2"], "--width must be a positive integer"),
    ([], "the following arguments are required: --ranks"),
])
def test_plan_bad_input(args, message):
    fails_once(2, PLAN, args, message)


def test_plan_profile_that_is_a_directory(files):
    fails_once(2, PLAN, ["--ranks", "2", "--profile", files["dir"]], "is a directory; expected a JSON file")


CALIBRATE = os.path.join(SCRIPTS, "calibrate.py")


def test_calibrate_bad_input(files):
    fails_once(2, CALIBRATE, ["--out", files["dir"], "--quick"], "--out '.*' is a directory")
    fails_once(2, CALIBRATE, ["--out", files["under_file"], "--quick"], "cannot be made")
    fails_once(2, CALIBRATE, ["--out", str(files["tmp"] / "p.json"), "--repeats", "0"],
               "--repeats must be a positive integer, got 0")
    fails_once(2, CALIBRATE, ["--out", str(files["tmp"] / "p.json"), "--threads", "0"],
               "--threads must be a positive integer, got 0")


VALIDATE = os.path.join(SCRIPTS, "validate_model.py")


def test_validate_model_bad_input(files, tmp_path):
    malformed = tmp_path / "malformed.json"
    malformed.write_text('["not", "a", "profile"]')
    garbled = tmp_path / "garbled.json"
    garbled.write_text('{"name": "x", ')
    fails_once(2, VALIDATE, ["--profile", str(malformed)], "is not a valid machine profile")
    fails_once(2, VALIDATE, ["--profile", str(garbled)], "is not valid JSON")
    fails_once(2, VALIDATE, ["--profile", files["dir"]], "is a directory; expected a JSON file")
    fails_once(2, VALIDATE, ["--repeats", "0"], "--repeats must be a positive integer")
    fails_once(2, VALIDATE, ["--memory-fraction", "nan"], "--memory-fraction must be a finite number")
    fails_once(2, VALIDATE, ["--json", files["dir"]], "--json '.*' is a directory")


API_CASES = [
    ("heights_differ", 2, r"conv: x: the ranks' blocks do not form one tensor \(rank 1 holds \(2, 2, 5, 5\)"),
    ("heights_differ", 4, r"the ranks' blocks do not form one tensor"),
    ("dtypes_differ", 2, r"the ranks' blocks do not form one tensor \(their dtypes differ\).*float32.*float64"),
    ("dtypes_differ", 3, r"their dtypes differ"),
    ("samples_differ", 2, r"rank 0 holds \(3, 4, 6, 5\) where a tensor of global shape \(4, 4, 6, 5\)"),
    ("integer_input", 2, "conv: x has dtype int64; expected float32 or float64"),
    ("complex_input", 2, "conv: x has dtype complex128; expected float32 or float64"),
    ("weight_dtype_differs", 2, "weight shard has dtype float32, x has float64"),
    ("spatial_grid", 2, "conv: an input of 1x5 gives 1 output rows, too few for the 2 ranks of the height axis"),
    ("spatial_grid", 4, "the image is too small for the grid; use at most 1 ranks along height"),
    ("backward_first", 2, "backward called before forward"),
    ("wrong_grad_output", 2, r"dy block has shape \(2, 2, 7, 5\).*expected \(2, 2, 6, 5\)"),
    ("integer_kernel_input", 2, "x has dtype int64; expected float32 or float64"),
    ("wrong_block", 2, r"local block has shape \(5, 3\)"),
    ("collective_shapes_differ", 2, r"allgather: the ranks' arrays differ .*rank 0: \(2, 1, 5\) float64; "
                                    r"rank 1: \(2, 1, 6\) float64"),
    ("collective_dtypes_differ", 3, r"allreduce: the ranks' arrays differ .*float32"),
    ("train_zero_steps", 2, "--max-steps must be a positive integer, got 0"),
]


@pytest.mark.parametrize("case,nprocs,message", API_CASES, ids=[f"{c}-{n}" for c, n, _ in API_CASES])
def test_python_api_bad_input(case, nprocs, message):
    fails_once(nprocs, API_CASE, [case], message)


def test_a_status_of_the_scripts_own_comes_through_without_a_message():
    proc, _ = run(2, ["own_status"], timeout=60, script=API_CASE)
    assert proc.returncode == 3, proc.stderr
    assert "Traceback" not in proc.stderr and "error" not in proc.stderr, proc.stderr


RACE_REPEATS = {2: int(os.environ.get("CFP_RACE_REPEATS", "50")), 4: int(os.environ.get("CFP_RACE_REPEATS", "10"))}


@pytest.mark.parametrize("nprocs", [2, 4])
@pytest.mark.timeout(30 + 6 * max(RACE_REPEATS.values()))  # a launch takes 0.5 s (MPICH) to 2 s (Open MPI)
def test_the_message_is_never_lost(nprocs):
    """Every rank raises the same error at once, the race that lost rank 0's message when the
    ranks aborted: it must be there every time."""
    repeats = RACE_REPEATS[nprocs]
    lost = []
    for i in range(repeats):
        proc, _ = run(nprocs, ["--model", "vgg"], timeout=60, script=os.path.join(SCRIPTS, "train.py"))
        if proc.returncode == 0 or proc.stderr.count("train.py: error: unknown model 'vgg'") != 1:
            lost.append((i, proc.returncode, proc.stderr[-300:]))
    assert not lost, f"{len(lost)} of {repeats} runs lost or repeated the message: {lost[:3]}"


IN_FLIGHT_REPEATS = int(os.environ.get("CFP_RACE_REPEATS", "6"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["fails_with_requests_outstanding",
                                  "fails_with_requests_outstanding_under_a_progress_thread"])
def test_a_rank_failing_with_collectives_in_flight_ends_the_job_with_its_message(monkeypatch, case):
    """One rank fails while its iallreduce and iallgather are outstanding and the others wait
    in the next collective: the job ends with that rank's one line every time (its buffers
    stay alive until MPI is done with them, comm._in_flight; an aborting rank gives the
    launcher time to forward its line, cli.ABORT_GRACE: 5 of 100 runs lost it before), also
    while a progress thread tests those collectives on every rank (--mpi-progress thread)."""
    monkeypatch.setenv("CFP_FAILURE_WAIT", "0.2")  # (the runs' environment: each waits 0.2 s, not 10)
    lost = []
    for i in range(IN_FLIGHT_REPEATS):
        proc, took = run(2 + 2 * (i % 2), [case], timeout=60, script=API_CASE)
        if proc.returncode == 0 or proc.stderr.count(f"api_case.py: error: rank {1 + 2 * (i % 2)} fails while its "
                                                     f"collectives are in flight") != 1:
            lost.append((i, proc.returncode, proc.stderr[-300:]))
    assert not lost, f"{len(lost)} of {IN_FLIGHT_REPEATS} runs lost or repeated the message: {lost[:3]}"


def test_ctrl_c_says_one_line_with_the_last_checkpoint_and_exits_130(tmp_path):
    """SIGINT to mpiexec (what Ctrl-C in a terminal sends). MPICH's mpiexec passes it to every
    rank; Open MPI's sends the ranks SIGTERM instead, which training takes alike, and exits
    with a status of its own (non-zero)."""
    directory = tmp_path / "ckpt"
    cmd = mpiexec(2, sys.executable, "-m", "mpi4py", os.path.join(SCRIPTS, "train.py"),
                  "--grid", "channel=2", "--train-samples", "128", "--batch-size", "32", "--epochs", "500",
                  "--no-progress", "--checkpoint-dir", str(directory))
    # Open MPI's grace between its SIGTERM and SIGKILL back at its default (tests/launcher.py
    # sets none): training needs it to say where it stopped
    proc = subprocess.Popen(cmd, env=single_thread_env(MPIEXEC_TIMEOUT=120, OMPI_MCA_odls_base_sigkill_timeout=1), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None and not (directory / "latest.json").exists():
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        out, err = proc.communicate(timeout=30)
        seconds = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if launcher().family == OPEN_MPI:
        assert proc.returncode != 0, (proc.returncode, err)
    else:
        assert proc.returncode == 130, (proc.returncode, err)
    assert err.count("train.py: interrupted") == 1, err
    assert re.search(r"train.py: interrupted: at step \d+; the last checkpoint is .*step-\d+ "
                     r"\(continue with --resume\)", err), err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert seconds < 15, f"took {seconds:.1f} s to stop"
