#!/usr/bin/env bash
# cfp on a GPU machine, in one prepared run (docs/testing.md, "On device arrays"):
#
#     bash scripts/gpu_check.sh [OUTDIR]        # from the repository's root; default OUTDIR gpu-check
#
# 1. the device tests (tests/test_device.py) on the real GPU, serially and at 1, 2 and 4 ranks
#    (the ranks share the one GPU; messages staged unless MPI is CUDA-aware);
# 2. 20 float64 training steps on 2 ranks (channel=2, algorithm w) on the GPU against the same
#    run on the CPU: the losses must agree to 1e-9;
# 3. bench_kernels.py --device gpu: cfp's kernels on CuPy against PyTorch's (cuDNN);
# 4. 20 training steps timed on the GPU and on the CPU (the wide CNN of width 32 on 32x32 images,
#    float32, 2 ranks on channel=2).
# Each part's output goes to OUTDIR; the script goes on after a failing part and exits non-zero
# if any failed. Python packages the machine lacks (pytest-mpi, an MPI for mpi4py) can come as
# wheels in .whl/ (installed into /tmp/site, nothing fetched). PYTHON picks the interpreter
# (default python3), MPIEXEC the launcher (default: the one on the PATH, else the mpich wheel's).
set -u
OUTDIR=${1:-gpu-check}
mkdir -p "$OUTDIR"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
MPIEXEC=${MPIEXEC:-$(command -v mpiexec || echo /tmp/site/bin/mpiexec)}
export MPIEXEC
failed=0
part() {  # part NAME COMMAND...: run it, its output to OUTDIR/NAME.log, and say how it ended
    local name=$1; shift
    local start=$SECONDS
    "$@" >"$OUTDIR/$name.log" 2>&1
    local rc=$?
    echo "$name: exit status $rc in $((SECONDS - start)) s (log $OUTDIR/$name.log)"
    [ $rc -eq 0 ] || failed=1
    tail -n 25 "$OUTDIR/$name.log"
}

{ nvidia-smi -L; "$PY" -c "import cupy, numpy, mpi4py; from mpi4py import MPI
print('cupy', cupy.__version__, 'GPUs', cupy.cuda.runtime.getDeviceCount(), '| numpy', numpy.__version__,
      '| mpi4py', mpi4py.__version__, '|', MPI.Get_library_version().splitlines()[0])
from cfp import backend; print('MPI and CUDA buffers:', backend.mpi_cuda_support())"; } 2>&1 | tee "$OUTDIR/machine.txt"

part device-tests "$PY" tests/run_suite.py --ranks 1 2 4 --timeout 600 --job-timeout 1200 tests/test_device.py

train() {  # train DEVICE EXTRA...: 2 ranks of scripts/train.py
    "$MPIEXEC" -n 2 "$PY" -m mpi4py scripts/train.py --device "$@" --no-progress
}
part train-cpu train cpu --grid channel=2 --algorithm w --dtype float64 --epochs 1 --max-steps 20 --log "$OUTDIR/train-cpu.json"
part train-gpu train gpu --grid channel=2 --algorithm w --dtype float64 --epochs 1 --max-steps 20 --log "$OUTDIR/train-gpu.json"
part train-compare "$PY" - "$OUTDIR/train-cpu.json" "$OUTDIR/train-gpu.json" <<'EOF'
import json, sys
cpu, gpu = ([s["loss"] for s in json.load(open(path))["steps"]] for path in sys.argv[1:3])
worst = max(abs(a - b) / max(abs(a), 1e-30) for a, b in zip(cpu, gpu))
print(f"{len(cpu)} steps; largest relative difference of the losses, GPU against CPU: {worst:.3g}")
sys.exit(0 if len(cpu) == len(gpu) == 20 and worst < 1e-9 else 1)
EOF

part bench-kernels "$PY" scripts/bench_kernels.py --device gpu --repeats 10 --json "$OUTDIR/bench-kernels-gpu.json"
for device in cpu gpu; do
    part "step-$device" train "$device" --model wide --width 32 --upsample 4 --grid channel=2 --algorithm y --dtype float32 \
        --batch-size 64 --epochs 1 --max-steps 20
done
exit $failed
