# `make run` and `make test` each work alone on a fresh machine: they create .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint format bench validate clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/ckplan estimate llama3-8b

test: $(STAMP)
	$(BIN)/pytest

lint: $(STAMP)
	$(BIN)/ruff check ckplan tests benchmarks validation
	$(BIN)/ruff format --check ckplan tests benchmarks validation

format: $(STAMP)
	$(BIN)/ruff format ckplan tests benchmarks validation
	$(BIN)/ruff check --fix ckplan tests benchmarks validation

# The accounting against PyTorch autograd (docs/validation.md); torch is an optional extra.
TORCH_STAMP := $(VENV)/.torch
$(TORCH_STAMP): $(STAMP)
	$(BIN)/pip install --quiet 'torch==2.13.0'
	touch $(TORCH_STAMP)

validate: $(TORCH_STAMP)
	$(BIN)/python validation/torch_saved_bytes.py --compare
	$(BIN)/python validation/torch_backward_peak.py --compare --output
	$(BIN)/pytest tests/test_torch_validation.py tests/test_export_torch.py

bench: $(STAMP)
	$(BIN)/python benchmarks/bench.py

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache .hypothesis
