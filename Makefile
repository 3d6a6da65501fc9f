# The two commands of README.md: `make demo` (the main job) and `make test` (every check CI runs).
# Each creates .venv on first use, installs torch==2.13.0 only when the venv has no torch (never
# upgrades it), and installs every package editable with its dev extras.

VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
PACKAGES := core comm zero offload pipeline moe tensor_parallel inference profiler compression
STAMP   := $(VENV)/.minispeed-installed
PYPROJECTS := pyproject.toml $(foreach p,$(PACKAGES),packages/$(p)/pyproject.toml) packages/deepspeed_compat/pyproject.toml

.PHONY: demo test lint docs docs-serve bench install-check gpu-check clean

# packages/deepspeed_compat is minispeed under DeepSpeed's name (docs/engine/deepspeed-compat.md),
# for the Trainer and accelerate tests; it never goes where DeepSpeed fixtures are recorded.
$(STAMP): $(PYPROJECTS)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0
	$(PIP) install $(foreach p,$(PACKAGES),-e packages/$(p)[dev]) -e ".[dev]"
	$(PIP) install --no-deps -e packages/deepspeed_compat
	$(PY) -c "import torch; print('minispeed venv ready with torch', torch.__version__)"
	touch $@

demo: $(STAMP)
	$(PY) examples/demo.py

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# The tests of these packages run once, in the stricter place: inside tests/test_install_independent.py,
# each in a fresh venv holding only the package and its declared dependencies (zero with its
# [offload] extra). A test there keeps this list and its own equal.
ISOLATED := core zero[offload] offload

test: $(STAMP) lint
	$(PY) -m pytest packages tests $(foreach p,$(ISOLATED),--ignore=packages/$(firstword $(subst [, ,$(p)))/tests)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

install-check: $(STAMP)
	$(PY) scripts/check_install.py $(ISOLATED)

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site
	@echo "site/ built; 'make docs-serve' serves it on http://127.0.0.1:8000"

docs-serve: $(STAMP)
	$(PY) -m mkdocs serve

bench: $(STAMP)
	for b in benchmarks/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

# The GPU check (docs/benchmarks.md, "GPU check"): every CUDA path on the GPU found, in under 8
# minutes; without a GPU, the same script's dry run on the CPU. It runs with .venv's python when
# that exists, else with python3 as found (a device machine's own, with CUDA torch): it never
# creates the venv nor installs anything. Results under $OUT, else ./gpu-check-out.
GPU_PY := $(if $(wildcard $(PY)),$(PY),python3)

gpu-check:
	$(GPU_PY) scripts/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) site .minispeed gpu-check-out
