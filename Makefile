# Two entry points for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
EDGEQ := $(VENV)/bin/edgeq
DEMO := runs/demo
STAMP := $(VENV)/.installed
# The suite runs in TEST_WORKERS processes (pytest-xdist), each test file in one of them.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

.PHONY: demo test test-all check bench install clean pretrained

$(STAMP): setup.py pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[train,dev,deploy,report]"
	touch $(STAMP)

install: $(STAMP)

# The main job on built-in data: FP32 + QAT on digits, int8-only TFLite, eval vs FP32 (1 pp budget),
# latency, and the HTML report of it all.
demo: $(STAMP)
	$(EDGEQ) train digits-cnn --data digits --out $(DEMO)
	$(EDGEQ) convert $(DEMO)/qat.h5 --int8-only --out $(DEMO)/digits_int8.tflite
	$(EDGEQ) eval $(DEMO)/digits_int8.tflite --reference $(DEMO)/fp32.keras --data digits --max-drop 1.0 --json $(DEMO)/eval.json
	$(EDGEQ) profile $(DEMO)/digits_int8.tflite --runs 50 --json $(DEMO)/profile.json
	$(EDGEQ) report $(DEMO) --out $(DEMO)/report.html

# deploy/test-env.sh: a real sshd, qemu-user and the emulated Raspberry Pi 4 for tests/fleet.
test: $(STAMP)
	bash deploy/test-env.sh
	$(PYTEST)

# Everything, the slow tests (bigger models) included.
test-all: $(STAMP)
	bash deploy/test-env.sh
	EDGEQ_SLOW=1 $(PYTEST)

check: $(STAMP)
	$(VENV)/bin/ruff check edgeq tests tools
	$(VENV)/bin/ruff format --check edgeq tests tools

bench: $(STAMP)
	$(PY) tools/bench.py

# Pretrained float .tflite models that wheels ship (tools/bench_pretrained.py): the mediapipe
# 0.10.14 and basic-pitch 0.4.0 wheels, downloaded once and read as zips, never installed.
pretrained: $(STAMP)
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: "mediapipe==0.10.14" -d .cache/pretrained
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: "basic-pitch==0.4.0" -d .cache/pretrained

clean:
	rm -rf $(VENV) runs build *.egg-info
