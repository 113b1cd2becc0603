# shardlab: the two commands a new user needs are `make demo` and `make test`.
# Both start with `make setup` (torch + shardlab), which is idempotent: a stamp file tracks
# pyproject.toml. It installs what every documented command needs (extras hf, data, plot: the report's
# matplotlib, view: the trace's offline viewer); the wandb and mlflow trackers are one install line each
# (docs/observability.md, "Trackers"; a run that names one not installed prints it). `make test` then adds
# the test and infra-check tools (extras dev, infra, and the wandb and mlflow trackers, so their read-back tests run).
#
# TORCH_SPEC picks the torch build. The default is the CPU wheel that lies on this
# machine's disk; a GPU user sets e.g. TORCH_SPEC="torch==2.13.0 --index-url <their CUDA index>".

PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
NPROC      ?= 2
PY         := $(VENV)/bin/python
PIP        := $(PY) -m pip install --quiet --disable-pip-version-check
STAMP      := $(VENV)/.shardlab-setup
DEV_STAMP  := $(VENV)/.shardlab-setup-dev

.PHONY: setup setup-dev demo test test-fast lint bench gpu-check gpu-check-system clean help

help:
	@echo "make setup   create $(VENV), install torch ($(TORCH_SPEC)) and shardlab"
	@echo "make demo    train the default GPT on the embedded corpus with $(NPROC) worker processes"
	@echo "make test    ruff, then the whole test suite (what CI runs)"
	@echo "make bench   the engine benchmark (docs/benchmarks.md)"
	@echo "make gpu-check  the GPU validation suite (one NVIDIA GPU; explains itself and exits 0 without)"

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) $(TORCH_SPEC)
	$(PIP) -e ".[hf,data,plot,view]"
	@touch $(STAMP)

setup-dev: $(DEV_STAMP)

$(DEV_STAMP): $(STAMP)
	$(PIP) -e ".[dev,infra,hf,data,plot,view,wandb,mlflow]"
	@touch $(DEV_STAMP)

demo: setup
	$(VENV)/bin/shardlab train configs/gpt-tiny.yaml --nproc $(NPROC)

# Two pytest workers, one test file each at a time (module fixtures stay in one process):
# the multi-process tests spend much of their time starting processes and waiting on each
# other, so two files share the 2 cores well. How long the suite takes: README.md, "Tests".
# Lint first (seconds), with the rules pyproject.toml's [tool.ruff] selects: the code meets them,
# so CI (.ci/run runs `make test`) keeps it so.
# The GPU check (marker gpu) is not part of it: `make gpu-check` runs it, on a GPU machine.
test: lint
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -ra -n 2 --dist loadfile --durations=30 -m "not gpu"

test-fast: lint
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -ra -n 2 --dist loadfile -m "not slow and not gpu"

lint: setup-dev
	$(VENV)/bin/ruff check src tests

bench: setup-dev
	$(VENV)/bin/shardlab bench --strategies ddp,torch-ddp,fsdp,torch-fsdp,zero3 --nproc 2 --repeats 2

# One NVIDIA GPU: every engine on NCCL against single, bf16/fp16, fsdp's overlap, offload, CUDA memory
# against plan, bench with MFU; writes docs/gpu-check/<date>-<gpu>.md (docs/benchmarks.md links it).
# Without CUDA every check is skipped with the reason and the exit status is 0.
gpu-check: setup-dev
	$(PY) -m pytest -q -rs -m gpu -p no:cacheprovider tests/gpu

# The same check where python3 already holds a CUDA build of torch and shardlab's few dependencies but no
# package index is reachable (a leased GPU machine's image): from the source tree, nothing installed.
# SHARDLAB_GPU_CHECK_QUICK=1 fits a 15-minute lease (docs/gpu-check.md).
gpu-check-system:
	PYTHONPATH=$(CURDIR)/src:$(CURDIR) $(PYTHON) -m pytest -q -rs -m gpu -p no:cacheprovider tests/gpu

clean:
	rm -rf $(VENV) runs .pytest_cache
