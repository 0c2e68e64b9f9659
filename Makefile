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
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q

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
