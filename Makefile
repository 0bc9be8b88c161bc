# The README's two commands: `make demo` and `make test`. Both set up .venv on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
# Versions tested together (s3fs pins aiobotocore/botocore; moto and boto3 must match them).
CONSTRAINTS := -c constraints.txt

.PHONY: demo test bench install install-test install-bench check-java clean

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

# Benchmarks (about 10 minutes at the default 2M rows): writes bench/results.md and results.json.
# Sizes: make bench BENCH_ARGS="--rows 500000 --commits 500"
bench: check-java install-bench
	$(PY) bench/run.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info connector/*.egg-info .pytest_cache
