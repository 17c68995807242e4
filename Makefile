# cfp: `make test` sets everything up on a machine with only Python 3 and pip, then runs the
# serial tests and the MPI tests at 1, 2, 3 and 4 ranks.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
RANKS ?= 1 2 3 4
TEST_TIMEOUT ?= 60
JOB_TIMEOUT ?= 600
PYTEST_ARGS ?=

.PHONY: test demo install oracle bench pictures clean

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

# The pictures of docs/tutorial.md, drawn by scripts/explain.py --plot (committed in docs/pictures).
PICTURE_GRIDS := sample=1,channel=4 sample=2,channel=2
pictures: install
	for grid in $(PICTURE_GRIDS); do for alg in sample x y w; do \
	  pf=$$(test $$alg = w && test $$grid = sample=1,channel=4 && echo "--filter-groups 2"); \
	  $(PY) scripts/explain.py --grid $$grid --algorithm $$alg $$pf \
	    --plot docs/pictures/explain-$$alg-$$(echo $$grid | tr -d = | tr , -).png >/dev/null || exit 1; \
	done; done
	$(PY) scripts/explain.py --grid sample=2,height=2 --algorithm sample \
	  --plot docs/pictures/explain-sample-sample2-height2.png >/dev/null
	$(PY) scripts/plan.py --model resnet --width 4 --batch 16 --ranks 4 --out .pictures-plan.json >/dev/null
	$(PY) scripts/explain.py --model resnet --width 4 --batch 16 --plan .pictures-plan.json \
	  --plot docs/pictures/explain-plan.png >/dev/null
	rm -f .pictures-plan.json

clean:
	rm -rf $(VENV) .test-logs *.egg-info
