# The README's two commands: `make demo` and `make test`. Both set up .venv on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
# Versions tested together (s3fs pins aiobotocore/botocore; moto and boto3 must match them).
CONSTRAINTS := -c constraints.txt

.PHONY: demo test bench soak install install-test install-bench check-java clean

check-java:
	@command -v java >/dev/null 2>&1 || { echo "java not found: Spark needs Java 17 (e.g. apt-get install openjdk-17-jre-headless), then run make again"; exit 1; }

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

$(VENV)/.installed: $(PY) pyproject.toml constraints.txt
	$(PIP) install $(CONSTRAINTS) -e .
	@touch $@

$(VENV)/.installed-test: $(PY) pyproject.toml constraints.txt
	$(PIP) install $(CONSTRAINTS) -e '.[test]'
	@touch $@ $(VENV)/.installed

$(VENV)/.installed-bench: $(PY) pyproject.toml constraints.txt
	$(PIP) install $(CONSTRAINTS) -e '.[test,bench]'
	@touch $@ $(VENV)/.installed $(VENV)/.installed-test

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test
install-bench: $(VENV)/.installed-bench

demo: check-java install
	$(PY) examples/quickstart.py

test: check-java install-test
	$(PY) -m pytest -q tests

# Benchmarks (about 10 minutes on 2 cores at the default 2M rows): writes bench/results.md and results.json.
# Sizes: make bench BENCH_ARGS="--rows 500000 --commits 500 --scale-rows 0"
bench: check-java install-bench
	$(PY) bench/run.py $(BENCH_ARGS)

# The soak test (tests/soak.py): 4 writer processes, a streaming query, compaction, cleaning and
# 2 readers on one table for a fixed time, on local disk, then on a moto S3 server it starts on
# 127.0.0.1. Each run stops by itself and fails on a failed commit, an atomicity violation or a
# final state that differs from the reference. Summaries: $(SOAK_OUT)/local.json and s3.json.
# Shorter: make soak SOAK_ARGS="--seconds 30"
SOAK_ARGS ?= --seconds 120
SOAK_OUT  ?= $(or $(TMPDIR),/tmp)/nbcc-soak
soak: check-java install-test
	$(PY) tests/soak.py --storage local --out $(SOAK_OUT)/local.json $(SOAK_ARGS)
	$(PY) tests/soak.py --storage s3 --out $(SOAK_OUT)/s3.json $(SOAK_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info connector/*.egg-info .pytest_cache
