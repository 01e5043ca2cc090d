# Set-up and entry points. `make demo` and `make test` are the two commands in the README.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed

.PHONY: demo test lint bench clean

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
	$(PY) -m pytest -q -rs tests

bench: $(STAMP)
	$(PY) bench/bench_checkpoint.py

clean:
	rm -rf $(VENV) build *.egg-info
