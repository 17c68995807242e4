# cfp: `make test` sets everything up on a machine with only Python 3 and pip, then runs the
# serial tests and the MPI tests at 1, 2, 3 and 4 ranks.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
RANKS ?= 1 2 3 4
TEST_TIMEOUT ?= 60
JOB_TIMEOUT ?= 600
PYTEST_ARGS ?=

.PHONY: test demo install oracle bench clean

install: $(VENV)/.installed

# The mpich wheel from PyPI supplies MPI (library and mpiexec) when the machine has none.
$(VENV)/.installed: setup.py setup.cfg
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if ! command -v mpiexec >/dev/null 2>&1; then $(PY) -m pip install -q mpich; fi
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -c "from mpi4py import MPI; print('MPI:', MPI.Get_library_version().splitlines()[0])"
	touch $@

test: install
	$(PY) tests/run_suite.py --ranks $(RANKS) --timeout $(TEST_TIMEOUT) --job-timeout $(JOB_TIMEOUT) $(PYTEST_ARGS)

# The small ResNet on scikit-learn's digits, on 4 ranks as a 2 x 2 sample x channel grid.
DEMO_ARGS ?= --model resnet --width 1 --grid sample=2,channel=2 --algorithm y --epochs 10 \
	--batch-size 64 --lr 0.1 --optimizer sgd --dtype float32 --seed 0 --log demo-run.json
demo: install
	@echo "mpiexec -n 4 python -m mpi4py scripts/train.py $(DEMO_ARGS)"
	@$$(test -x $(VENV)/bin/mpiexec && echo $(VENV)/bin/mpiexec || echo mpiexec) -n 4 $(PY) -m mpi4py scripts/train.py $(DEMO_ARGS)

# PyTorch as a test oracle and benchmark baseline (optional; the tests skip without it).
oracle: install
	$(PY) -m pip install -q -e '.[test,oracle]'

bench: install
	$(PY) scripts/bench_kernels.py --threads 1

clean:
	rm -rf $(VENV) .test-logs *.egg-info
