# phalanx developer commands. `make test` is what CI runs (via .ci/run).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

# torch is big: its wheels are fetched once into a cache and installed from there ever after.
CACHE ?= $(or $(PHALANX_CACHE_DIR),$(or $(XDG_CACHE_HOME),$(HOME)/.cache)/phalanx)
WHEELS := $(CACHE)/wheels
TORCH ?= torch==2.13.0

.PHONY: venv torch binaries first-binaries quickstart-binaries packages images quickstart-images up down fmt lint typecheck unit integration e2e test crd clean

$(BIN)/phalanx: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

venv: $(BIN)/phalanx

torch: venv  ## torch for the worker tests, from the wheel cache (downloaded once)
	@$(BIN)/python -c "import torch, numpy" 2>/dev/null || \
	  $(BIN)/pip install --quiet --no-index --find-links $(WHEELS) $(TORCH) numpy 2>/dev/null || \
	  { mkdir -p $(WHEELS) && $(BIN)/pip download --quiet --dest $(WHEELS) $(TORCH) numpy && \
	    $(BIN)/pip install --quiet --no-index --find-links $(WHEELS) $(TORCH) numpy; }
	@$(BIN)/python -c "import transformers, accelerate, lightning" 2>/dev/null || \
	  $(BIN)/pip install --quiet --find-links $(WHEELS) -e '.[test,frameworks]'

crd: venv  ## regenerate crds/ and docs/api.md from the API models
	$(BIN)/phalanx crd
	$(BIN)/phalanx docs

binaries:  ## every Go program the test tiers need, built from its module (cached by version)
	tests/cluster/build-binaries.sh

# What `make up` runs: the control plane and the real node (kubelet, kube-proxy, CoreDNS); no KWOK,
# helm, gang schedulers, Kueue or promtool (the tests build those).
QUICKSTART_MODULES := kubernetes etcd coredns

quickstart-binaries:  ## only the Go programs `make up` runs
	tests/cluster/build-binaries.sh $(QUICKSTART_MODULES)

# `make test` builds first what most tiers run; the programs only a few test modules need (marked
# late_binaries, which run last) are built beside the first tests, at nice 19, in this order: those
# with the longest tests first (the gang modules' schedulers), then promtool and gitops-checks. The
# late modules run in this order too (tests/conftest.py reads it), each once its first program is built.
FIRST_MODULES := kubernetes etcd kwok coredns helm
LATE_MODULES := scheduler-plugins kueue prometheus gitops-checks
LATE_LOG := $(CACHE)/late-binaries.log

first-binaries:  ## the Go programs every tier but the late_binaries modules needs
	tests/cluster/build-binaries.sh $(FIRST_MODULES)

packages:  ## Debian packages of the real node: containerd, runc, CNI plugins, debootstrap, ...
	tests/cluster/node/install-packages.sh

# after torch: both fill the wheel cache, and torch's wheels must be fetched once
images: venv packages torch  ## pause image, wheel cache; operator and trainer from the Dockerfile (cached by input hash)
	$(BIN)/python -m tests.cluster.node.images
	$(BIN)/python -m tests.cluster.node.dockerfile_images operator trainer

# The Go builds take the CPUs while torch's wheels, the node's packages and the images mostly wait on
# the network: they run side by side.
# The quickstart runs the operator from the venv and torch only inside the trainer image: no torch in
# the venv, no operator image (images.py fetches torch's wheels into the wheel cache itself).
quickstart-images: venv packages  ## pause image and the trainer image, what `make up` runs
	$(BIN)/python -m tests.cluster.node.images
	$(BIN)/python -m tests.cluster.node.dockerfile_images trainer

up:  ## local cluster + operator + the CPU example training (or the cluster in $$KUBECONFIG)
	$(MAKE) --no-print-directory --jobs=3 --output-sync=line quickstart-binaries quickstart-images
	$(BIN)/python -m tests.cluster.quickstart up

down:  ## stop everything `make up` started
	$(BIN)/python -m tests.cluster.quickstart down

fmt: venv  ## format, then fix what ruff can fix by itself
	$(BIN)/ruff format operator tests
	$(BIN)/ruff check --fix operator tests

# lint-imports checks the layer contracts of pyproject.toml against this checkout's operator/.
lint: venv  ## ruff's lint and format check, and the import-linter contracts
	$(BIN)/ruff check operator tests
	$(BIN)/ruff format --check operator tests
	PYTHONPATH=operator $(BIN)/lint-imports

typecheck: torch
	$(BIN)/mypy

unit: torch
	$(BIN)/pytest tests/unit

integration: torch binaries images
	$(BIN)/pytest tests/integration

e2e: torch binaries images
	$(BIN)/pytest tests/e2e

# The Go builds take the CPUs for most of a fresh machine's set-up; the venv, torch (GBs from the
# index), the node's packages and the images wait on the network meanwhile, so they run beside them.
# The late modules' builder runs in a session of its own, so that its go processes stop with it; a
# late_binaries test that comes before its program is built waits for it (build-binaries.sh's lock
# of that module). A new session is a new scheduler autogroup where the kernel has them (Debian's
# does): nice counts only inside one, so the builder sets its whole group's nice to 19 too, or it
# would take half the CPUs from the tests whatever its own nice.
# The tests run in two pytest-xdist workers: the KWOK cluster's modules in one, the real node's in the
# other, then the modules with clusters of their own and the unit modules on whichever is free
# (tests/conftest.py's TierScheduling). TEST_WORKERS=0 runs them in one process, one after another.
TEST_WORKERS ?= 2

test:  ## everything CI runs: unit, integration (control plane + KWOK), e2e (real node)
	$(MAKE) --no-print-directory --jobs=3 --output-sync=target lint typecheck first-binaries images
	@mkdir -p $(CACHE); echo "building $(LATE_MODULES) beside the tests (log: $(LATE_LOG))"; \
	setsid sh -c 'echo 19 > /proc/self/autogroup 2>/dev/null; exec nice -n 19 "$$0" "$$@"' \
	  tests/cluster/build-binaries.sh $(LATE_MODULES) > $(LATE_LOG) 2>&1 & builder=$$!; \
	trap 'kill -- -$$builder 2>/dev/null' EXIT; trap 'kill -- -$$builder 2>/dev/null; exit 130' INT TERM; \
	$(BIN)/pytest -n $(TEST_WORKERS) tests; status=$$?; \
	wait $$builder || { status=1; echo "the late binaries failed to build:"; tail -n 40 $(LATE_LOG); }; \
	grep 'build-binaries: built\|build-binaries: done' $(LATE_LOG) || true; \
	exit $$status

clean:
	rm -rf $(VENV) build dist .mypy_cache .ruff_cache .pytest_cache .hypothesis
