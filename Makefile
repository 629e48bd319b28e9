# One command sets up, lints and runs the tests; one sets up and runs the main job on the bundled example.
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0

.PHONY: install test quickstart bench

install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install "torch==$(TORCH_VERSION)"
	$(PYTHON) -m pip install -e ".[dev,kernels]"

test: install
	$(PYTHON) -m ruff check .
	$(PYTHON) -m pytest -q -rfEs tests

quickstart: install
	PYTHON=$(PYTHON) bash examples/quickstart.sh

bench: install
	$(PYTHON) benchmarks/bench_model_vs_hf.py
