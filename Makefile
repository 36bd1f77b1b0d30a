# The two commands of the README: `make run` and `make test`. Both install into .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

.PHONY: install run test
install: $(VENV)/.installed

# The main job: the control plane on the embedded default (nine fake engines), port 8000.
run: install
	$(VENV)/bin/evinfra serve --config etc/cluster.toml

# pytest's "no tests collected" exit code (5) is a failure, as every other non-zero code.
test: install
	$(PY) -m pytest -q
