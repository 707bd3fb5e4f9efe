# One virtualenv, pinned by constraints.txt (torch 2.13.0 is the CPU build; see README).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Debian's chromium: the status page's test drives it
# (tests/integration/user_facing/test_status_page.py).
CHROMIUM ?= /usr/bin/chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup packages browser bubblewrap tcmalloc demo test lint typecheck bench flower-env clean

setup: $(STAMP)

# uv installs (pinned in constraints.txt, itself installed by pip into the virtualenv): pip took
# a minute of a clean run here, 36 s of it fetching the index pages and wheels of ~90 packages
# one after another; uv fetches them side by side and installs in 8 s. uv reads none of pip's
# configuration, so it is given the folders of wheels pip is pointed to (a machine that keeps
# torch's CPU build on disk: PIP_FIND_LINKS, pip's find-links). Nothing is compiled then: most of
# the virtualenv's 16,000 modules are never imported (torch's compiler, its tests), and each
# module is compiled when a process first imports it, its bytecode written then for every process
# after (WRITE_BYTECODE: where PYTHONDONTWRITEBYTECODE is set, as on CI machines and in the image,
# every coordinator, worker and daemon would compile the ~1,500 modules it imports again, ~6 s
# of CPU each).
FIND_LINKS := $(sort $(PIP_FIND_LINKS) $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
INSTALL := $(BIN)/uv pip install --quiet --python $(BIN)/python -c constraints.txt \
	$(addprefix --find-links ,$(FIND_LINKS))
WRITE_BYTECODE := env -u PYTHONDONTWRITEBYTECODE

# The virtualenv, with uv in it (put there by pip).
$(BIN)/uv:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c constraints.txt uv

$(STAMP): pyproject.toml constraints.txt | $(BIN)/uv
	$(INSTALL) -e '.[dev]'
	touch $(STAMP)

# Debian's packages the tests use, each with the check that finds it installed:
# chromium (about a minute: ~115 MB of packages): the status page's test drives it
#   (tests/integration/user_facing/test_status_page.py);
# bubblewrap: workers sandbox job code with it (worker/confinement/sandbox.py;
#   tests/integration/security/test_sandbox.py);
# tcmalloc: workers' filter daemons allocate with it (worker/daemon/allocator.py;
#   tests/integration/resources/test_daemon_malloc.py).
HAS_chromium := test -x $(CHROMIUM)
HAS_bubblewrap := command -v bwrap >/dev/null
HAS_libtcmalloc-minimal4 := /sbin/ldconfig -p | grep -q libtcmalloc_minimal.so.4
PACKAGES := chromium bubblewrap libtcmalloc-minimal4

# Installs those of PACKAGES that are missing, in one apt-get run (none: does nothing).
packages:
	@missing=""; \
	$(foreach p,$(PACKAGES),$(HAS_$(p)) || missing="$$missing $(p)";) \
	test -z "$$missing" || { \
		$(SUDO) apt-get update -q && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive \
			apt-get install -y -q --no-install-recommends $$missing; }

# One of them alone.
browser:
	@$(MAKE) --no-print-directory packages PACKAGES=chromium
bubblewrap:
	@$(MAKE) --no-print-directory packages PACKAGES=bubblewrap
tcmalloc:
	@$(MAKE) --no-print-directory packages PACKAGES=libtcmalloc-minimal4

# The demo needs the package and its own dependencies only, not the dev extras (pytest, mypy,
# ruff, hypothesis, opacus, tensorboard): make setup adds those to the same virtualenv.
DEMO_STAMP := $(VENV)/.installed-demo

# The demo's workers sandbox job code with bubblewrap: installed here where apt-get can, else
# the demo says its workers run job code as your user (somatize/cli/cluster.py).
demo: $(DEMO_STAMP)
	@command -v bwrap >/dev/null || $(MAKE) --no-print-directory bubblewrap \
		|| echo "bubblewrap could not be installed: the demo runs job code unsandboxed"
	$(WRITE_BYTECODE) $(BIN)/somatize demo

$(DEMO_STAMP): pyproject.toml constraints.txt | $(BIN)/uv
	$(INSTALL) -e .
	touch $(DEMO_STAMP)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/mypy

# The virtualenv is installed (and linted) while apt-get installs the Debian packages: a minute
# and more each on a new machine, the one waiting on pip, the other on the network and dpkg.
# Two test processes, each taking whole files (a module's shared cluster stays one): most of a
# test's time is its processes starting and waiting on one another, so two of them fill two cores.
# Each module's bytecode is written by the first process that imports it (WRITE_BYTECODE): every
# coordinator, worker and daemon a test starts after loads it instead of compiling the module
# again. A test process that dies ends the run, failed, rather than being replaced (xdist's
# replacement had left the run waiting forever). The slowest tests are listed at the end;
# PYTEST_ARGS adds to them. The type check runs beside the tests (it takes half a core for half
# a minute, while the tests leave more than that idle) and fails the run after them, its report
# printed then.
TEST_PROCESSES ?= 2
PYTEST_ARGS ?=

test:
	@$(MAKE) --no-print-directory --jobs 2 --output-sync=target lint packages
	@$(BIN)/mypy > $(VENV)/typecheck.log 2>&1 & typing=$$!; \
	$(WRITE_BYTECODE) $(BIN)/pytest -n $(TEST_PROCESSES) --dist loadfile --max-worker-restart 0 --durations=15 \
		$(PYTEST_ARGS); tested=$$?; \
	wait $$typing; typed=$$?; \
	echo "mypy:"; cat $(VENV)/typecheck.log; \
	test $$tested -eq 0 && test $$typed -eq 0

bench: setup
	$(WRITE_BYTECODE) $(BIN)/python -m benchmarks

# Flower's own virtualenv (flwr[simulation], Ray) for the Flower row of benchmarks.federated;
# never the project's: Ray moves its pins. FLOWER_VENV=PATH to put it elsewhere.
FLOWER_VENV ?= .flower-venv

flower-env:
	PYTHON=$(PYTHON) benchmarks/federated/flower_env.sh $(FLOWER_VENV)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
