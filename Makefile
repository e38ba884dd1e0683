# pdserve — `make serve` and `make test` do all the set-up on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# CPU machines get the CPU build of torch; a CUDA machine keeps whatever pip resolves.
TORCH_CPU ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: install serve test test-unit soak lint proto gpu-check clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1; then \
	  $(BIN)/python -m pip install -q "$(TORCH_CPU)"; fi
	$(BIN)/python -m pip install -q -e ".[dev,ucx,nixl]"
	touch $(STAMP)

serve: install
	$(BIN)/pdserve up

# PYTHONSAFEPATH (here and in every process the tests start): `-m` would put the checkout first
# on sys.path, and its kernels/ would shadow the `kernels` package transformers >= 5.25 imports.
test: install
	PYTHONSAFEPATH=1 $(BIN)/python -m pytest -q -m "not gpu" --durations=15 $(PYTEST_ARGS)

# The fast loop: unit tests only (about a minute on two cores).
test-unit: install
	PYTHONSAFEPATH=1 $(BIN)/python -m pytest -q -m "not gpu" tests/unit $(PYTEST_ARGS)

# Minutes of hundreds of concurrent streaming clients against the default `pdserve up` (SmolLM2
# on CPU), and a router restarted after a 60 s outage; prints `soak-result {...}` and
# `outage-result {...}` lines. Knobs: PDSERVE_SOAK_SECONDS (180), PDSERVE_SOAK_CLIENTS (256).
soak: install
	PDSERVE_SOAK=1 PYTHONSAFEPATH=1 $(BIN)/python -m pytest -q -s -m slow tests/integration/test_faults_soak.py \
	  $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .

proto: install
	$(BIN)/python -m pdserve.proto.generate

clean:
	rm -rf $(VENV) build dist *.egg-info
