# Every target sets itself up: a fresh machine needs only `make demo` or `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_PIPELINE := identity_elimination, fold_constants, cse, dce, topo_sort, loss(kind=cross_entropy, output=logits), autodiff

.PHONY: install test demo lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[torch,dev]"
	@# system tools for `graphforge diff`: Graphviz's dot (page layout) and Chromium (the headless
	@# browser test); installed only when missing, and only where apt-get exists and we are root
	@missing=""; \
	command -v dot >/dev/null 2>&1 || missing="$$missing graphviz"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	if [ -n "$$missing" ]; then \
		if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
			echo "installing system packages:$$missing"; \
			(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing) \
				|| echo "warning: apt-get could not install$$missing"; \
		else \
			echo "note: not installing$$missing (needs apt-get and root): diff pages use a pure-Python layout, the browser test skips"; \
		fi; \
	fi
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q
	$(BIN)/graphforge golden check golden_models

demo: $(STAMP)
	mkdir -p out
	$(BIN)/graphforge compile golden_models/demo_mlp/model.onnx -p "$(DEMO_PIPELINE)" \
		-o out/demo_mlp.compiled.onnx --dump-dir out/demo_dumps --verify-with-ort
	$(BIN)/graphforge inspect out/demo_mlp.compiled.onnx

lint: $(STAMP)
	$(BIN)/ruff check graphforge passes tests golden_models benchmarks
	$(BIN)/ruff format --check graphforge passes tests golden_models benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf $(VENV) out build dist *.egg-info .pytest_cache
