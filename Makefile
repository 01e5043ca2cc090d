# Set-up and entry points. `make demo` and `make test` are the two commands in the README.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed

.PHONY: demo test check test-load lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch is pinned: 2.13.0 is the CPU wheel on these machines; an unpinned torch pulls a CUDA build.
	$(PY) -m pip install -q --disable-pip-version-check "torch==2.13.0"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m resilient_slurm.examples.demo

test: $(STAMP)
	$(PY) -m ruff check resilient_slurm tests bench
	$(PY) -m mypy resilient_slurm
	# A real Slurm (slurmctld + two slurmd + munge on loopback) for the end-to-end tests; needs root.
	bash tests/slurm/install.sh || echo "make test: Slurm unavailable here; its end-to-end tests will be skipped (CI requires them)"
	# Two workers (pytest-xdist): the Slurm tests one after another on one of them, everything else shared
	# out (tests/xdist_groups.py, docs/testing.md).
	$(PY) -m pytest -q -rs --durations=30 -n 2 --dist loadgroup tests

# The fast tier, for every edit: lint, types and the tests that start no process of their own (no ranks,
# launcher, interpreter, Slurm or server process), in a few minutes. RSLURMTEST_CHECK=1 makes a process
# start in such a test fail, saying to mark it `proc` (tests/check_tier.py). `make test` still runs all.
check: $(STAMP)
	$(PY) -m ruff check resilient_slurm tests bench
	$(PY) -m mypy resilient_slurm
	RSLURMTEST_CHECK=1 $(PY) -m pytest -q -m "not proc and not slow" -p no:cacheprovider tests

# The launcher, attribution, orphan and Slurm tests with a CPU and an I/O hog on every core beside them
# (tests/under_load.py), LOAD_RUNS times in a row, stopping at the first failure: races that only a busy
# node shows. The files run on two workers as in `make test` (the Slurm tests on one, the rest on the other),
# so the hogs share the cores with both. Run it before a change to the launcher lands (docs/testing.md). Not
# part of `make test` or CI: it takes hours.
LOAD_TESTS ?= tests/test_launcher_local.py tests/test_attribution.py tests/test_launcher_orphans.py tests/test_launcher_slurm.py
LOAD_RUNS  ?= 3
test-load: $(STAMP)
	bash tests/slurm/install.sh
	RSLURMTEST_REQUIRE_SLURM=1 $(PY) tests/under_load.py --runs $(LOAD_RUNS) -- $(PY) -m pytest -q -rs -x -n 2 --dist loadgroup --durations=20 -p no:cacheprovider $(LOAD_TESTS)

bench: $(STAMP)
	$(PY) bench/bench_checkpoint.py

clean:
	rm -rf $(VENV) build *.egg-info
