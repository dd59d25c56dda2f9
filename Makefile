# Two commands do everything on a fresh machine:
#   make run    install hyperfed and its core dependencies into .venv, run the default experiment
#   make test   install every extra too, run the test suite (what CI runs)
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
# The CPU build of torch that lies on this kind of machine; an unpinned torch would pull a
# multi-GB CUDA build. Skipped when the environment already has a torch >= 2.4.
TORCH  ?= torch==2.13.0

.PHONY: install run test lint docs bench data clean

install: $(VENV)/.installed

# what `hyperfed run` needs: torch and the core dependencies (no Flower, Ray, datasets, pyarrow,
# Optuna or Opacus; a command that needs one of those says which extra to install)
$(VENV)/.core-installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e .
	touch $@

# every extra the test suite, the linters and the other commands use
$(VENV)/.installed: $(VENV)/.core-installed
	$(BIN)/pip install -q -e ".[dev,flower,simulation,flwr-datasets,privacy,tune]"
	touch $@

run: $(VENV)/.core-installed
	$(BIN)/hyperfed run

test: install
	$(BIN)/python -m pytest -q -n 2  # one worker per core of the CI machine (tests use 1 torch thread; -n 3 measured slower)

lint: install
	$(BIN)/ruff check hyperfed tests benchmarks
	$(BIN)/ruff format --check hyperfed tests benchmarks
	$(BIN)/mypy hyperfed

# the documentation site (docs/*.md + API reference from docstrings) in site/; --strict:
# a broken link or docstring reference fails the build (CI runs it). Then no rST role
# (:class:`X` ...) or literal-block marker (text::) may be left as text in the built pages
# (docs/_ext/rst_roles.py turns them into links and Markdown).
# NO_MKDOCS_2_WARNING: no end-of-life banner from mkdocs-material on every build.
docs: $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict
	@if grep -rlE ':(class|meth|func|mod|data|attr|exc|obj):(<code>|`)|::</p>' site --include='*.html'; then \
	  echo "raw rST roles or '::' left in the pages above (docs/_ext/rst_roles.py handles" \
	    ":class: :meth: :func: :mod: :data: :attr:)"; \
	  exit 1; fi

# only the docs extra's packages (mkdocs, material, mkdocstrings: a ~170 MB venv), not hyperfed and its
# torch: mkdocstrings reads the sources statically (griffe), nothing is imported. Into the venv
# `make install` made when there is one, a new one otherwise.
$(VENV)/.docs-installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import re; t = open('pyproject.toml').read(); \
	  block = re.search(r'^docs = \[(.*?)^\]', t, re.M | re.S).group(1); \
	  print(*re.findall(r'\"([^\"]+)\"', block), sep='\n')" > $(VENV)/docs-requirements.txt
	$(BIN)/pip install -q -r $(VENV)/docs-requirements.txt
	touch $@

bench: install
	$(BIN)/hyperfed bench

# Fashion-MNIST from Debian (root + apt); the tests that need it are skipped without it.
data:
	@test -d /usr/share/datasets/fashion-mnist || (apt-get update -q && apt-get install -y -q dataset-fashion-mnist)

clean:
	rm -rf $(VENV) runs report site .pytest_cache .mypy_cache .ruff_cache
