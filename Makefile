# Two commands matter: `make test` and `make serve`. Both build .venv on first use.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test serve lint bench clean-venv lock prometheus-tools mutation

$(BIN)/python:
	$(PY) -m venv $(VENV) || python3 -m venv $(VENV)

# Installs exactly what the tests passed on: requirements.lock pins every dependency with
# hashes, except torch. torch comes first, pinned, without dependencies (its own come
# hash-checked from the lock): an unpinned torch drags in a multi-GB CUDA build, and the
# CPU wheel this installs is not the file PyPI serves, so its hash cannot be in the lock.
# The project goes in last, editable, built by the locked setuptools, with --no-index: if
# pyproject.toml asks for something the lock lacks, that step fails instead of quietly
# fetching an unpinned version (fix: `make lock`).
TORCH := torch==2.13.0
LOCK := requirements.lock
$(STAMP): pyproject.toml $(LOCK) | $(BIN)/python
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --no-deps $(TORCH)
	$(BIN)/pip install -q --no-deps --require-hashes -r $(LOCK)
	$(BIN)/pip install -q --no-index --no-build-isolation -e '.[server,dev]' || \
	  { echo "$(LOCK) lacks what pyproject.toml needs: run 'make lock'"; exit 1; }
	$(BIN)/pip check
	touch $(STAMP)

# Regenerates requirements.lock from pyproject.toml (the extras the Makefile installs) with
# pip-compile, pinned in its own venv so the lock does not depend on what .venv holds.
# Existing pins are kept unless pyproject.toml needs otherwise; `make lock UPGRADE=1` moves
# everything to the newest allowed versions.
LOCK_VENV := $(VENV)/.lock-tools
lock:
	test -x $(LOCK_VENV)/bin/pip-compile || { $(PY) -m venv $(LOCK_VENV) && \
	  $(LOCK_VENV)/bin/pip install -q pip==26.3 pip-tools==7.6.2; }
	printf '$(TORCH)\nsetuptools\n' | $(LOCK_VENV)/bin/pip-compile --quiet --generate-hashes \
	  --extra server --extra dev --strip-extras --unsafe-package torch --no-emit-index-url \
	  --no-emit-find-links --no-emit-trusted-host $(if $(UPGRADE),--upgrade) \
	  --output-file $(LOCK) pyproject.toml -

# The Prometheus tests need Debian's promtool and prometheus; installed here when we can
# (CI runs as root), otherwise those tests skip and say why.
prometheus-tools:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null || \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
	    --no-install-recommends prometheus || echo "could not install prometheus: its tests will skip"; \
	else echo "promtool/prometheus missing (apt-get needs root): the Prometheus tests will skip"; fi

test: $(STAMP) prometheus-tools
	$(BIN)/ruff check .
	$(BIN)/python -m pytest
	$(BIN)/python tests/mutation_check.py

serve: $(STAMP)
	$(BIN)/dualread serve

lint: $(STAMP)
	$(BIN)/ruff check .

# Mutation testing of the modules that decide `defer` and what is reported (configured under
# [tool.mutmut] in pyproject.toml), against the fast tests. Starts fresh so the numbers are
# those of the current tests. `make mutation MODULES="heads.fit heads.defer"` runs only those
# modules' mutants (the split for a short machine); the report prints each mutant of those
# modules not killed, then the kill rate per module and overall (timeouts counted apart, not
# as kills), and fails when a module is under 85% killed or has mutants left unchecked
# (tests/mutation_report.py).
# `make test` runs tests/mutation_check.py, which keeps this target able to run.
MODULES ?=
mutation: $(STAMP)
	rm -rf mutants
	OMP_NUM_THREADS=1 DUALREAD_TEST_THREADS=1 $(BIN)/mutmut run --max-children 2 \
	  $(foreach m,$(MODULES),'$(m).*') > mutation.log 2>&1 || { tail -c 3000 mutation.log; exit 1; }
	@$(BIN)/mutmut results --all true | $(BIN)/python tests/mutation_report.py --modules "$(MODULES)"

bench: $(STAMP)
	$(BIN)/dualread bench

clean-venv:
	rm -rf $(VENV)
