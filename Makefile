# Every target sets itself up: a fresh machine needs only `make demo` or `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
#: the test accuracy `make demo` must reach (README); its run reaches about 0.98
DEMO_MIN_ACCURACY := 0.93
#: the least drop of the held-out fables' loss `make lm` must see (README); its run sees 0.54
LM_MIN_LOSS_DROP := 0.3

JS_STAMP := js/node_modules/.installed
BENCH_JS_STAMP := benchmarks/js/node_modules/.installed

.PHONY: install test demo lm web web-lm docs lint bench bench-check conformance cuda-check clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[torch,dev]"
	@# system tools for `graphforge diff`: Graphviz's dot (page layout) and Chromium (the headless
	@# browser test); installed only when missing, and only where apt-get exists and we are root
	@missing=""; \
	command -v dot >/dev/null 2>&1 || missing="$$missing graphviz"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	command -v node >/dev/null 2>&1 || missing="$$missing nodejs npm"; \
	if [ -n "$$missing" ]; then \
		if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
			echo "installing system packages:$$missing"; \
			(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing) \
				|| echo "warning: apt-get could not install$$missing"; \
		else \
			echo "note: not installing$$missing (needs apt-get and root): diff pages use a pure-Python layout, the browser tests skip"; \
		fi; \
	fi
	touch $(STAMP)

# The JavaScript runtime's packages (js/package-lock.json). onnxruntime-node's own install step
# fetches CUDA libraries from outside the npm registry; its CPU build is in the package itself.
$(JS_STAMP): js/package-lock.json $(STAMP)
	cd js && ONNXRUNTIME_NODE_INSTALL=skip npm ci --no-audit --no-fund --loglevel=error
	touch $(JS_STAMP)

# TensorFlow.js, the peer of the on-device benchmark (benchmarks/js/package-lock.json)
$(BENCH_JS_STAMP): benchmarks/js/package-lock.json $(JS_STAMP)
	cd benchmarks/js && npm ci --no-audit --no-fund --loglevel=error
	touch $(BENCH_JS_STAMP)

install: $(STAMP) $(JS_STAMP) $(BENCH_JS_STAMP)

# Two test processes on a 2-core machine (at most 4: each distributed test starts several
# processes of its own); a module's tests stay in one process, so its fixtures are made once,
# taken in collection order (tests/conftest.py puts the longest modules first; xdist's own
# reorder, by test count, put the few-test distributed modules last, to run alone at the end).
# Bytecode is cached: the tests start a few hundred Python processes (CLI, torchrun ranks).
# The 25 longest tests are listed at the end, for the next trim of the suite.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; echo $$n)

test: $(STAMP) $(JS_STAMP) $(BENCH_JS_STAMP)
	cd js && npm run --silent typecheck
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder --durations=25 -m "not bench"
	$(BIN)/graphforge golden check golden_models
	$(MAKE) --no-print-directory docs

# Train a 64-64-10 MLP on the shipped 8×8 digits (examples/digits/train.toml), export the
# inference model, and score it on the test split with a plain onnxruntime session.
demo: $(STAMP)
	rm -rf out/digits
	mkdir -p out/digits
	$(BIN)/graphforge train examples/digits/train.toml --out out/digits
	$(BIN)/graphforge export out/digits/program.onnx --checkpoint out/digits -o out/digits/model.onnx
	$(BIN)/python examples/digits/evaluate.py out/digits/model.onnx --min-accuracy $(DEMO_MIN_ACCURACY)

# A language model end to end (examples/lm/): pretrain a small Llama-style model on the standard
# library's docstrings, fine-tune it with LoRA on the shipped fables, print the held-out fables'
# loss and samples before and after; writes out/lm/ (tokenizer.json, base/ and tuned/model.onnx).
lm: $(STAMP)
	rm -rf out/lm
	$(BIN)/python -m examples.lm.run --out out/lm --min-loss-drop $(LM_MIN_LOSS_DROP)

# The page that trains the digits in a browser (examples/web/): writes out/web/ (the artifacts and
# the data), then serves the repository on http://127.0.0.1:8000/examples/web/ until Ctrl-C.
web: $(STAMP) $(JS_STAMP)
	$(BIN)/python examples/web/serve.py

# The page that fine-tunes make lm's small language model in a browser (examples/web-lm/): writes
# out/web-lm/ (the LoRA artifacts, the generation model, the tokenizer), then serves the
# repository on http://127.0.0.1:8000/examples/web-lm/ until Ctrl-C. Where out/lm/ is not there
# yet, make lm makes it first (about 4 minutes).
LM_BASE := out/lm/base/model.onnx
$(LM_BASE): | $(STAMP)
	$(MAKE) --no-print-directory lm

web-lm: $(STAMP) $(JS_STAMP) $(LM_BASE)
	$(BIN)/python examples/web-lm/serve.py

# The documentation site (mkdocs.yml, docs/; the API pages from the docstrings) into site/:
# --strict fails on a broken link, anchor or API reference, and on a page left out of the nav.
# `.venv/bin/mkdocs serve` serves it on http://127.0.0.1:8000 while the pages change.
# (NO_MKDOCS_2_WARNING: Material's notice of its end of life, May 2027, printed on every build)
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

lint: $(STAMP)
	$(BIN)/ruff check graphforge passes tests golden_models benchmarks examples docs/package_dir.py
	$(BIN)/ruff format --check graphforge passes tests golden_models benchmarks examples docs/package_dir.py

# The benchmarks' own end-to-end tests (tests/benchmarks/test_benchmarks_smoke.py, marked bench):
# every side of each benchmark starts, trains alike on a tiny model and reports; make test leaves
# them out, make bench runs them first
bench-check: $(STAMP) $(JS_STAMP) $(BENCH_JS_STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m bench tests/benchmarks

bench: bench-check
	$(BIN)/python benchmarks/run.py

# The GPU check (benchmarks/cuda_check.py): on a lent GPU machine, with .gpu/ made beforehand
# (`.venv/bin/python benchmarks/cuda_check.py --prepare`), it sets up onnxruntime-gpu, runs the
# CUDA tests and the CUDA benchmark, and writes report.md/.json into OUT. It needs no .venv:
# the machine's python3 (with torch) runs it. Without a GPU it says so and exits 0.
OUT ?= out/cuda-check
ROWS ?=
cuda-check:
	$(PYTHON) benchmarks/cuda_check.py --out "$(OUT)" $(if $(ROWS),--rows "$(ROWS)")

# Every case of onnx's backend node tests through autodiff against central differences in
# float64 (make test checks the same); records docs/ops-conformance.json and docs/ops.md.
conformance: $(STAMP)
	$(BIN)/python tests/passes/autodiff/conformance.py

clean:
	rm -rf $(VENV) out site build dist *.egg-info .pytest_cache js/node_modules benchmarks/js/node_modules
