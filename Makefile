# Two commands on a fresh machine (Python >= 3.11 with venv):
#   make run    set up, then train FedPAC on the embedded MNIST data (10 simulated clients)
#   make test   set up, then lint (ruff), type-check (mypy) and run the test suite; a test whose
#               prerequisite this machine lacks (Docker, root, Fashion-MNIST) is skipped, and
#               pytest's summary says which and why (make test-fast: the quick tier alone)
# And once, as root on Debian/Ubuntu, for the tests that need more than Python (CI runs it first):
#   make provision   a Docker engine, debootstrap, iproute2, iptables, the compose plugin and the
#                    full Fashion-MNIST
PYTHON ?= python3
VENV ?= .venv
CLIENTS ?= 10
RUN_CONFIG ?=
OUTPUT_DIR ?= $(CURDIR)/outputs
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION := 1
export FLWR_DISABLE_UPDATE_CHECK := 1
export FLWR_TELEMETRY_ENABLED := 0

.PHONY: install provision run test test-fast stop clean

# Every version from the lock file. TORCH_INDEX=https://download.pytorch.org/whl/cpu takes the
# locked torch from PyTorch's CPU builds instead (no CUDA libraries: about 1 GB less than 6).
TORCH_INDEX ?=
LOCKED_TORCH = $(shell sed -n 's/^torch==\([^ ;]*\).*/\1/p' requirements.lock)

$(VENV)/.installed: pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
ifeq ($(TORCH_INDEX),)
	$(VENV)/bin/pip install --quiet -r requirements.lock
	$(VENV)/bin/pip install --quiet --no-deps -e ".[test]"
else
	$(VENV)/bin/pip install --quiet --index-url $(TORCH_INDEX) "torch==$(LOCKED_TORCH)"
	$(VENV)/bin/pip install --quiet -c requirements.lock -e ".[test]"
endif
	touch $@

install: $(VENV)/.installed

run: install
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" deploy/simulate.sh --clients $(CLIENTS) \
		--run-config "output-dir='$(OUTPUT_DIR)' $(RUN_CONFIG)"

provision: install
	deploy/install-docker.sh $(VENV)
	deploy/install-datasets.sh

# The tests that start no process (the quick tier and the slow in-process ones) on every core,
# then those that do (e2e: deployments, Docker, network namespaces) two at a time: they spend most
# of their time waiting (for a heartbeat to lapse, a node to rejoin, Ray to start), and those
# that share a machine-wide resource carry one xdist_group (tests/deployment.py). Both passes run
# even if the first fails. E2E_WORKERS=0 runs the e2e tier in one process.
DURATIONS ?= 12
E2E_WORKERS ?= 2
test: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/python -m pytest -m "not e2e" -n auto --dist worksteal --durations=$(DURATIONS); in_process=$$?; \
	$(VENV)/bin/python -m pytest -m e2e -n $(E2E_WORKERS) --dist loadgroup --durations=$(DURATIONS) && exit $$in_process

# The quick tier: the unit and in-process tests (no process started, no network, Docker or GPU)
# but the slow ones (runs compared with runs), the ones to run while changing code, on every core
# (pytest-xdist). make test runs them too.
test-fast: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest -m "not e2e and not slow" -n auto --dist worksteal --durations=5

stop:  # the local SuperLink that a plain `flwr run .` starts keeps running after the run (make run stops its own)
	-pkill -f "$(CURDIR)/$(VENV)/bin/flower-superlink .*--simulation"

clean: stop
	rm -rf $(VENV) outputs
