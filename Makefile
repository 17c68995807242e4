# cfp: `make test` sets everything up on a machine with only Python 3 and pip, then runs the
# serial tests and the MPI tests at 1, 2, 3 and 4 ranks.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
RANKS ?= 1 2 3 4
TEST_TIMEOUT ?= 60
JOB_TIMEOUT ?= 600
PYTEST_ARGS ?=
# The launcher of the tests and the demo (default: the mpiexec of mpi4py's MPI, the mpich
# wheel's when the machine has no MPI), e.g. MPIEXEC=srun MPIEXEC_FLAGS="--mpi=pmix" on a
# cluster; tests/launcher.py adds what that MPI needs for these runs (root, oversubscription).
MPIEXEC ?=
MPIEXEC_FLAGS ?=
LAUNCH := MPIEXEC="$(MPIEXEC)" MPIEXEC_FLAGS="$(MPIEXEC_FLAGS)"

.PHONY: test test-scale demo install oracle bench pictures test-system-mpi test-cluster clean mutation mutation-repoint

install: $(VENV)/.installed

# The mpich wheel from PyPI supplies MPI (library and mpiexec) when the machine has none (no
# mpiexec on the PATH and no MPIEXEC given); otherwise mpi4py loads the machine's MPI.
$(VENV)/.installed: setup.py setup.cfg
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if [ -z "$(MPIEXEC)" ] && ! command -v mpiexec >/dev/null 2>&1; then $(PY) -m pip install -q mpich; fi
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -c "from mpi4py import MPI; print('MPI:', MPI.Get_library_version().splitlines()[0])"
	touch $@

test: install
	$(LAUNCH) $(PY) tests/run_suite.py --ranks $(RANKS) --timeout $(TEST_TIMEOUT) --job-timeout $(JOB_TIMEOUT) $(PYTEST_ARGS)

# The distributed equality tests at the rank counts of larger CI runs (not part of `make test`):
# oversubscribed (one BLAS thread a rank), the grids each count brings (three split axes, uneven
# blocks, ranks holding empty blocks), against the serial float64 results as at 1-4 ranks.
SCALE_RANKS ?= 6 8 12 16
SCALE_TESTS := tests/test_algorithms.py tests/test_algorithm_options.py tests/test_algorithm_extension.py \
	tests/test_spatial.py tests/test_plans.py tests/test_checkpoint_safety.py tests/test_train.py tests/test_nn.py \
	tests/test_tensor.py tests/test_comm.py tests/test_volumes.py tests/test_grid.py
test-scale: install
	$(LAUNCH) $(PY) tests/run_suite.py --no-serial --ranks $(SCALE_RANKS) --timeout 300 --job-timeout 3600 \
	  $(SCALE_TESTS) $(PYTEST_ARGS)

# The small ResNet on scikit-learn's digits, on 4 ranks as a 2 x 2 sample x channel grid.
DEMO_ARGS ?= --model resnet --width 1 --grid sample=2,channel=2 --algorithm y --epochs 10 \
	--batch-size 64 --lr 0.1 --optimizer sgd --dtype float32 --seed 0 --log demo-run.json
demo: install
	@$(LAUNCH) $(PY) tests/launcher.py -n 4 scripts/train.py $(DEMO_ARGS)

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
	$(PY) scripts/plan.py --model resnet --width 8 --batch 64 --ranks 4 --out .pictures-plan.json >/dev/null
	$(PY) scripts/explain.py --model resnet --width 8 --batch 64 --plan .pictures-plan.json \
	  --plot docs/pictures/explain-plan.png >/dev/null
	rm -f .pictures-plan.json

# cfp on the machine's own MPI (not part of CI): Debian's Open MPI (installed with apt when no
# mpicc is found and this runs as root), mpi4py built from source by its mpicc in
# $(SYSTEM_VENV), the MPI tests at 2 and 4 ranks and the demo; prints its row of docs/training.md's table of verified MPIs.
SYSTEM_VENV ?= .venv-system-mpi
SYSTEM_RANKS ?= 2 4
# The MPI tests across 2 emulated nodes (network namespaces joined through a bridge by links of
# CLUSTER_RATE, scripts/cluster.py), at 2 ranks (2 x 1) and 4 (2 x 2), then a training run that
# checkpoints on 2 x 2 and resumes on 2 x 1: as root (skipped, saying why, otherwise); not part
# of `make test` (about 3 minutes at 1gbit). Everything it makes is removed, also on failure.
CLUSTER_RATE ?= 1gbit
test-cluster: install
	$(PY) scripts/cluster.py test --rate $(CLUSTER_RATE) $(if $(PYTEST_ARGS),-- $(PYTEST_ARGS))

test-system-mpi:
	@if ! command -v mpicc >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q openmpi-bin libopenmpi-dev; \
	  else echo "test-system-mpi: no mpicc: install an MPI first (apt install openmpi-bin libopenmpi-dev)"; exit 2; fi; fi
	test -x $(SYSTEM_VENV)/bin/python || $(PYTHON) -m venv $(SYSTEM_VENV)
	$(SYSTEM_VENV)/bin/python -m pip install -q --upgrade pip
	$(SYSTEM_VENV)/bin/python -m pip install -q --no-binary mpi4py --no-cache-dir --force-reinstall mpi4py
	$(SYSTEM_VENV)/bin/python -m pip install -q -e '.[test]'
	MPIEXEC=$$(dirname $$(command -v mpicc))/mpiexec $(SYSTEM_VENV)/bin/python tests/run_suite.py --no-serial \
	  --ranks $(SYSTEM_RANKS) --timeout $(TEST_TIMEOUT) --job-timeout $(JOB_TIMEOUT) $(PYTEST_ARGS)
	MPIEXEC=$$(dirname $$(command -v mpicc))/mpiexec $(SYSTEM_VENV)/bin/python tests/launcher.py -n 4 \
	  scripts/train.py $(subst demo-run.json,.system-mpi-demo.json,$(DEMO_ARGS)) --no-progress
	MPIEXEC=$$(dirname $$(command -v mpicc))/mpiexec $(SYSTEM_VENV)/bin/python tests/launcher.py \
	  --verified-row .system-mpi-demo.json "$(SYSTEM_RANKS)"

clean:
	rm -rf $(VENV) $(SYSTEM_VENV) .test-logs *.egg-info

# Mutation testing, not part of `make test`: cosmic-ray over the modules where a wrong number is
# silent, each group of tests/mutation/cosmic-ray.toml in its own copy of the checkout (the tree
# is never mutated in place); the report lists every surviving mutant. A fixed-hash sample keeps
# a run under an hour on 2 cores; MUTATION_ARGS="--sample 1" runs every mutant.
MUTATION_ARGS ?= --sample 0.1 --jobs 2
mutation: install
	$(PY) -m pip install -q 'cosmic-ray>=8.3'
	$(PY) tests/mutation/run.py $(MUTATION_ARGS)

# After an edit above a listed equivalent mutant: point tests/mutation/equivalent.txt at its
# lines again, by their text at REPOINT_REV (default HEAD: run it before committing the edit).
REPOINT_REV ?= HEAD
mutation-repoint: install
	$(PY) tests/mutation/run.py --repoint $(REPOINT_REV)
