# Two commands: `make run` (demo batch end to end) and `make test` (the whole suite).
# Both create what they need: two virtualenvs (Airflow and vLLM must not share one),
# the system packages the tests use, and the generated local model.

SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
IVENV := .venv-inference
WORK := .work
MODEL := $(WORK)/models/tiny-llama
EVAL_MODEL := $(WORK)/models/eval-llama
PROMETHEUS := $(WORK)/prometheus/usr/bin/prometheus
PIP_FLAGS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
# Never let a test or a benchmark write caches into $HOME.
export VLLM_CACHE_ROOT := $(CURDIR)/$(WORK)/cache
export HF_HOME := $(CURDIR)/$(WORK)/cache/hf
export HF_HUB_OFFLINE := 1
export VLLM_NO_USAGE_STATS := 1

.PHONY: setup run test test-orchestrator test-inference images lint system-packages bench clean

setup: $(VENV)/.installed $(IVENV)/.installed system-packages $(MODEL)/config.json $(EVAL_MODEL)/train_key.txt

$(VENV)/.installed: requirements.txt requirements-dev.txt pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q $(PIP_FLAGS) -r requirements-dev.txt
	$(VENV)/bin/pip install -q --no-deps -e .
	touch $@

$(IVENV)/.installed: inference_images/vllm/requirements-cpu.txt requirements-inference-dev.txt pyproject.toml
	test -x $(IVENV)/bin/python || $(PYTHON) -m venv $(IVENV)
	$(IVENV)/bin/pip install -q --upgrade pip
	$(IVENV)/bin/pip install -q $(PIP_FLAGS) -r requirements-inference-dev.txt
	# CUDA builds that pip pulls in beside the CPU torch; they fail to import and break transformers.
	$(IVENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton || true
	$(IVENV)/bin/pip install -q --no-deps -e .
	touch $@

# redis-server: the kvcache L2 tier's tests start their own instance on 127.0.0.1.
# podman, runc, debootstrap: `make images` builds the shipped images and tests/images runs them.
system-packages:
	@command -v podman >/dev/null && command -v runc >/dev/null && command -v debootstrap >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq podman runc debootstrap >/dev/null; \
	  else echo "podman is missing: sudo apt-get install podman runc debootstrap" >&2; exit 1; fi; }
	@command -v redis-server >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq redis-server >/dev/null; \
	  else echo "redis-server is missing: sudo apt-get install redis-server" >&2; exit 1; fi; }
	@# fuse3 (fusermount3, libfuse3): the kvcache shared-tier test mounts a file system whose reads hang
	@command -v fusermount3 >/dev/null && ldconfig -p | grep -q libfuse3 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq fuse3 >/dev/null; \
	  else echo "fuse3 is missing: sudo apt-get install fuse3" >&2; exit 1; fi; }
	@# chromium: the eval report's browser test renders it headless; chromium-driver: Selenium
	@# drives it through the Airflow UI's trigger form
	@command -v chromedriver >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null; \
	  else echo "chromium-driver is missing: sudo apt-get install chromium chromium-driver" >&2; exit 1; fi; }
	@# prometheus, promtool, pushgateway for the metrics tests: the binaries only, unpacked under .work
	@test -x $(PROMETHEUS)-pushgateway || { mkdir -p $(WORK)/prometheus && cd $(WORK)/prometheus && \
	  { apt-get download prometheus prometheus-pushgateway >/dev/null 2>&1 || \
	    { apt-get update -qq && apt-get download prometheus prometheus-pushgateway; }; } && \
	  for deb in prometheus*.deb; do dpkg-deb -x $$deb .; done && rm -f prometheus*.deb; }

$(MODEL)/config.json: inference_images/vllm/make_model.py | $(IVENV)/.installed
	$(IVENV)/bin/python inference_images/vllm/make_model.py $(MODEL) --preset tiny

# The small model the eval suites score (trained on CPU, cached by a hash of script + config).
$(EVAL_MODEL)/train_key.txt: inference_images/vllm/train_eval_model.py plugins/aibrix_operators/evaluation/tasks.py | $(IVENV)/.installed
	$(IVENV)/bin/python inference_images/vllm/train_eval_model.py $(EVAL_MODEL)
	touch $@

run: setup
	$(VENV)/bin/python scripts/run_example.py

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

# The four images from this repository's Dockerfiles, on stand-in bases (no registry here), with
# podman's layer cache: an unchanged rebuild takes seconds. inference_images/README.md.
images: system-packages
	$(PYTHON) inference_images/build.py

# The environments and the images are independent (pip and model training beside podman builds
# that mostly wait on the network): built side by side, then the suites, one after the other.
test:
	$(MAKE) -j2 setup images
	$(MAKE) lint test-orchestrator test-inference

# Airflow, the driver, S3 and the end-to-end DAG runs. Temporary files stay under /tmp: vLLM puts
# its IPC sockets in TMPDIR, which some tests point at tmp_path, and a deep --basetemp (a clone in
# a long path) overflows the 107-byte socket path limit. Don't run two suites at once: pytest
# prunes all but the newest 3 of /tmp/pytest-of-$USER, including a running suite's fixtures.
test-orchestrator: setup
	$(VENV)/bin/python -m pytest -q --timeout=900 --durations=25 tests --ignore=tests/kvcache

# The KV-cache connector inside real vLLM CPU servers.
test-inference: setup
	$(IVENV)/bin/python -m pytest -q --timeout=900 --durations=10 tests/kvcache

clean:
	rm -rf $(WORK)/outputs $(WORK)/airflow $(WORK)/logs $(WORK)/tmp
