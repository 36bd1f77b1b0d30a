# The two commands of the README: `make run` and `make test`. Both install into .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python

# The native core (evinfra/native) is compiled by this install: its sources are prerequisites.
NATIVE_SRC := CMakeLists.txt $(wildcard evinfra/native/src/*)

$(VENV)/.installed: pyproject.toml $(NATIVE_SRC)
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	flock /tmp/evinfra-native-build.lock $(PY) -m pip install -q -e '.[dev,sglang,ray]'
	touch $@

.PHONY: chromium install native nginx run sanitize sglang-env test test-heavy
install: $(VENV)/.installed

# Rebuild only the native core after editing it (incremental; one build at a time).
native: | $(VENV)/.installed
	flock /tmp/evinfra-native-build.lock $(PY) -m pip install -q --no-build-isolation --no-deps -e .

# The native core under AddressSanitizer and UndefinedBehaviorSanitizer: the property machines
# and the unit tests of its parts (scripts/sanitize.sh; several minutes).
sanitize: | $(VENV)/.installed
	PY=$(PY) bash scripts/sanitize.sh

# Real SGLang 0.5.23 for CPU in its own venv, for tests/integration/test_sglang_*.py (idempotent:
# about a second when up to date; 1-2 minutes and 1.9 GB the first time).
SGLANG_VENV ?= .venv-sglang
sglang-env:
	bash scripts/install-sglang-cpu.sh $(SGLANG_VENV)

# The main job: the control plane on the embedded default (nine fake engines), port 8000.
run: install
	$(VENV)/bin/evinfra serve --config etc/cluster.toml

# pytest's "no tests collected" exit code (5) is a failure, as every other non-zero code.
# EVINFRA_SGLANG_REQUIRED: the SGLang integration tests fail, rather than skip, without engines.
# nginx (Debian's, for the partitions' global tier): scripts/install-nginx.sh, idempotent.
nginx:
	bash scripts/install-nginx.sh

# Chromium (Debian's, headless) for the browser tests: scripts/install-chromium.sh, idempotent.
chromium:
	bash scripts/install-chromium.sh

test: install sglang-env nginx chromium
	EVINFRA_SGLANG_REQUIRED=1 EVINFRA_NGINX_REQUIRED=1 EVINFRA_SGLANG_VENV=$(SGLANG_VENV) $(PY) -m pytest -q -m "not heavy"

# The tests marked heavy (minutes of CPU each: tp=2 SGLang engines, an experiment on Ray),
# kept out of CI's time; run them before changing what they cover.
test-heavy: install sglang-env
	EVINFRA_SGLANG_REQUIRED=1 EVINFRA_SGLANG_VENV=$(SGLANG_VENV) $(PY) -m pytest -q -m heavy
