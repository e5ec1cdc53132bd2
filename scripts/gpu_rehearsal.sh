#!/usr/bin/env bash
# CPU rehearsal of the GPU check: scripts/gpu_check.sh with DEVICE=cpu in a virtualenv that mimics
# the GPU machine's image (not part of CI: a tool for the day a GPU comes).
#   1. the kit (`make gpu-kit`: cp312 wheels of what the image lacks, .gpu_kit/)
#   2. .venv-gpu-rehearsal/: Python 3.12 with scripts/gpu/image_requirements.txt (torch 2.11.0,
#      transformers 5.17.0, ... the image's versions), then every distribution that is not on the
#      image's list (scripts/gpu/image_packages.txt) removed, so the kit is what supplies the rest
#   3. gpu_check.sh with that venv's python, DEVICE=cpu: it installs the kit with pip --target as
#      on the GPU machine; tests, 10 training steps under the deepspeed launcher, MFU at a tiny
#      size, the benchmark smokes. Output in runs/gpu_rehearsal/ (summary.txt, gpu_check.log, ...).
#
#   bash scripts/gpu_rehearsal.sh                          (make gpu-rehearsal)
#   GPU_CHECK_STEPS=tests bash scripts/gpu_rehearsal.sh    (make test-rehearsal: the test step only)
# Env: PY312 (a Python 3.12; default pyenv's 3.12.1), RVENV (.venv-gpu-rehearsal), GPU_CHECK_* as in
# gpu_check.sh (GPU_CHECK_BUDGET_S defaults to 1500 here: the CPU is slower than the GPU;
# GPU_CHECK_DRY_RUN=1: neither kit nor venv is built, gpu_check.sh prints its commands).
# The kit is rebuilt when it is missing or older than scripts/gpu/kit.txt or build_kit.py, the venv
# when it is missing or older than scripts/gpu/image_requirements.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
RVENV=${RVENV:-.venv-gpu-rehearsal}
STAMP=$RVENV/.image
KIT_STAMP=.gpu_kit/kit.json

build_kit() {
  if [ ! -f "$KIT_STAMP" ] || [ scripts/gpu/kit.txt -nt "$KIT_STAMP" ] || [ scripts/gpu/build_kit.py -nt "$KIT_STAMP" ]; then
    make gpu-kit
  else
    echo "gpu_rehearsal: the kit in .gpu_kit is up to date with scripts/gpu/kit.txt (rebuild: make gpu-kit)"
  fi
}

build_venv() {
  if [ ! -f "$STAMP" ] || [ scripts/gpu/image_requirements.txt -nt "$STAMP" ]; then
    rm -rf "$RVENV"
    if [ -n "${PY312:-}" ]; then "$PY312" -m venv "$RVENV"; else PYENV_VERSION=3.12.1 python -m venv "$RVENV"; fi
    "$RVENV/bin/python" -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' \
      || { echo "gpu_rehearsal: $RVENV is not Python 3.12 (set PY312)"; exit 2; }
    "$RVENV/bin/python" -m pip install -q --disable-pip-version-check -r scripts/gpu/image_requirements.txt
    # what the image does not have goes (pip pulled some in as dependencies of the ones above)
    extra=$("$RVENV/bin/python" - <<'EOF'
import importlib.metadata as md, re
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
image = {norm(l.strip()) for l in open("scripts/gpu/image_packages.txt") if l.strip() and not l.startswith("#")}
print(" ".join(sorted({norm(d.metadata["Name"]) for d in md.distributions()} - image - {"pip"})))
EOF
)
    if [ -n "$extra" ]; then echo "gpu_rehearsal: not on the GPU image, removed: $extra"; "$RVENV/bin/python" -m pip uninstall -q -y $extra; fi
    "$RVENV/bin/python" -c "import torch, transformers, timm, peft" \
      || { echo "gpu_rehearsal: $RVENV lost a package the GPU image has"; exit 2; }
    touch "$STAMP"
  fi
  versions=$("$RVENV/bin/python" -c 'import sys, torch, transformers; print("python", sys.version.split()[0], "| torch", torch.__version__, "| transformers", transformers.__version__)')
  echo "gpu_rehearsal: $versions"
}

if [ "${GPU_CHECK_DRY_RUN:-0}" = 1 ]; then
  echo "gpu_rehearsal: DRY RUN: the kit (.gpu_kit) and $RVENV are not built"
else
  build_kit
  build_venv
fi
DEVICE=cpu PY=$RVENV/bin/python GPU_CHECK_OUT=${GPU_CHECK_OUT:-runs/gpu_rehearsal} \
  GPU_CHECK_BUDGET_S=${GPU_CHECK_BUDGET_S:-1500} bash scripts/gpu_check.sh
