# make setup: .venv with the CPU build of torch and this project (editable); safe to run again.
# make train: the default recipe (Multi30k de->en): train, evaluate on the test sets, show samples.
# make test:  the import contracts (lint-imports), then the test suite.
# make test-isa: the fast paths' and decoding's tests again under lower instruction sets (AVX2, AVX-512 without
#             VNNI, AVX-512 with BF16 and no AMX), as on other CPUs; ISA_SETTINGS=avx2,... picks some.
# make test-avx2: the whole suite but the isa_free tests under the AVX2 setting (most laptops, AMD Zen 2/3). CI runs make test,
#             make test-avx2, then make test-isa under the other settings.
# make lint:  ruff and the import contracts.
# make bench: speed against peer implementations (installs transformers for the HF baseline).
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin

ISA_SETTINGS ?= avx512_core_bf16,avx512_core,avx2

.PHONY: setup train test test-isa test-avx2 lint bench
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@

train: setup
	$(BIN)/python train.py

# The import contracts first (pyproject.toml, [tool.importlinter]): a broken one fails the suite.
# pytest exits with 5 when it collects no tests; that is not a failure of the suite.
test: setup
	$(BIN)/lint-imports --no-cache --no-logo
	$(BIN)/python -m pytest || [ $$? -eq 5 ]

# The tests marked isa, once per setting of tests/isa_matrix.py; prints each one's time and the kernels that ran.
test-isa: setup
	$(BIN)/python -m tests.isa_matrix settings=$(ISA_SETTINGS)

# The whole suite (not only the isa tests) with ATen, oneDNN, MKL and CTranslate2 kept to AVX2, but the
# tests marked isa_free: they assert only what no instruction-set limit changes.
test-avx2: setup
	$(BIN)/python -m tests.isa_matrix settings=avx2 tests=kernels

# Training throughput against torch.nn.Transformer and HF MarianMT, then decoding with and without the cache.
bench: setup
	$(BIN)/python -m pip install --quiet -e ".[dev,bench]"
	$(BIN)/python benchmarks/benchmark.py rounds=3 output=outputs/benchmark.json
	$(BIN)/python benchmarks/benchmark_decoding.py output=outputs/benchmark_decoding.json

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports --no-cache --no-logo
