# Two commands: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo demo-local test test-cuda bench bench-tiered bench-incremental bench-cost bench-scale bench-gpu env clean

$(VENV)/.ready: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: an open range would otherwise pull a newer CUDA build.
	$(PY) -m pip install -q $(TORCH_SPEC)
	# the framework extras come after torch; pip must keep the torch build installed above.
	# constraints.txt pins the versions CI tested, so pip resolves at once instead of backtracking.
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,lightning,transformers,torchtitan]'
	$(PY) -c "import sys, torch; want = '$(TORCH_SPEC)'.partition('==')[2]; \
	    sys.exit(f'pip replaced torch {want} by {torch.__version__}: install the extras after torch') \
	    if want and not torch.__version__.startswith(want) else None"
	touch $@

env: $(VENV)/.ready

demo: env
	$(PY) examples/demo.py

# the demo without the remote tier (no embedded S3 server)
demo-local: env
	$(PY) examples/demo.py --remote none

test: env
	$(PY) -m pytest -q

bench: env
	$(PY) bench/bench_core.py

# remote tier: ~1 GB step against plain s3fs on an embedded S3 (a few minutes)
bench-tiered: env
	$(PY) bench/bench_tiered.py --md bench/out/tiered.md

# incremental vs full saves: fine-tuning, embedding (chunk_bytes sweep), dense (a few minutes)
bench-incremental: env
	$(PY) bench/bench_incremental.py --md bench/out/incremental.md

# what a save costs the training loop, per thread, against the floors and DCP (about 7 minutes)
bench-cost: env
	$(PY) bench/bench_cost.py

# 0.5, 2 and 8 GB: save->durable and cold restore against the disk, then 100 saves watched for growth (about 15 minutes)
# on a CUDA machine: the GPU tests (skipped elsewhere) and the GPU loop harness (docs/benchmarks.md, "On a GPU")
test-cuda: env
	$(PY) -m pytest -m cuda tests/test_cuda.py

bench-gpu: env
	$(PY) bench/bench_gpu.py --gb 2 --budget-s 150

bench-scale: env
	$(PY) bench/bench_durable.py
	$(PY) bench/bench_restore.py
	$(PY) bench/bench_growth.py

clean:
	rm -rf $(VENV) demo-run bench/out
