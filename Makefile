# `make run` and `make test` each work alone on a fresh machine: they create .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint format bench validate clean fuzz

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/ckplan estimate llama3-8b

test: $(STAMP)
	$(BIN)/pytest

# A seeded fuzzer of hostile CLI invocations (tests/fuzz_cli.py; tests/corpus/README.md); not part
# of `make test`. One case at a time, each with a 10 s and 4 GiB limit; exit 1 when any case is bad.
FUZZ_CASES ?= 2000
FUZZ_SEED ?= 0
fuzz: $(STAMP)
	$(BIN)/python tests/fuzz_cli.py --cases $(FUZZ_CASES) --seed $(FUZZ_SEED)

lint: $(STAMP)
	$(BIN)/ruff check ckplan tests benchmarks validation examples
	$(BIN)/ruff format --check ckplan tests benchmarks validation examples

format: $(STAMP)
	$(BIN)/ruff format ckplan tests benchmarks validation examples
	$(BIN)/ruff check --fix ckplan tests benchmarks validation examples

# The accounting against PyTorch autograd (docs/validation.md) and `ckplan calibrate`; torch is
# an optional extra. `make test` runs its tests where torch is installed and reports them as
# skipped where not; .ci/run installs it first and sets CKPLAN_REQUIRE_TORCH=1.
TORCH_STAMP := $(VENV)/.torch
$(TORCH_STAMP): $(STAMP)
	$(BIN)/pip install --quiet 'torch==2.13.0'
	touch $(TORCH_STAMP)

validate: $(TORCH_STAMP)
	$(BIN)/python validation/torch_saved_bytes.py --compare
	$(BIN)/python validation/torch_backward_peak.py --compare --output
	$(BIN)/python validation/calibrated_profiles.py
	$(BIN)/python validation/calibrated_profiles.py --backward
	$(BIN)/python validation/torch_finetune_saved_bytes.py --compare
	$(BIN)/pytest tests/test_torch_validation.py tests/test_export_torch.py tests/test_finetune_torch.py

# The bench has its own venv: checkpoint-schedules (compared with our Revolve) is no dependency.
BENCH_VENV := .venv-bench
BENCH_STAMP := $(BENCH_VENV)/.installed
$(BENCH_STAMP): pyproject.toml
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install --quiet --upgrade pip
	$(BENCH_VENV)/bin/pip install --quiet -e . 'checkpoint-schedules==1.0.4'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(BENCH_VENV)/bin/python benchmarks/bench.py

clean:
	rm -rf $(VENV) $(BENCH_VENV) build dist *.egg-info .pytest_cache .ruff_cache .hypothesis
