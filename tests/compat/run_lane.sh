#!/usr/bin/env bash
# One compatibility lane of `make test-compat` (docs/integrations.md, "Version matrix"): a virtualenv of its own under
# .venv-compat/LANE with a pinned stack from the package index, hf-lisa installed into it (--no-deps, editable), then
# the core tests: callbacks in a plain Trainer, the scheduler, resume, the CLI's --method lisa/full on a tiny model,
# and the PEFT tuner where the lane's PEFT is one the tuner supports.
#
#   tests/compat/run_lane.sh LANE [all|build|test]      LANE: axolotl | llamafactory | newest | oldest
#
# all (the default): build the lane when its virtualenv is missing or older than this script or pyproject.toml, then
# test; build: rebuild it; test: test it as it is. The CPU torch is installed first and pinned in every later step (an
# unpinned torch pulls a multi-GB CUDA build); pip's cache is reused. Times go to .venv-compat/LANE/times.txt, the
# installed versions to .venv-compat/LANE/versions.txt.
set -euo pipefail

LANE=${1:?usage: run_lane.sh LANE [all|build|test]}
STEP=${2:-all}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
VENVS=${COMPAT_VENVS:-$ROOT/.venv-compat}
VENV=$VENVS/$LANE
PY=$VENV/bin/python
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

# The stack of each lane. Its peers' pins are copied from their wheels' METADATA (axolotl 0.19.0, llamafactory 0.9.5).
case $LANE in
  # axolotl 0.19.0's own pins (huggingface_hub and tokenizers included)
  axolotl) PINS="transformers==5.16.1 peft==0.20.0 trl==1.9.0 accelerate==1.13.0 datasets==4.8.4
                 huggingface_hub==1.17.0 tokenizers==0.23.1" ;;
  # the newest LLaMA-Factory 0.9.5 allows (transformers<=5.6.0, peft<=0.18.1, trl<=0.24, accelerate<=1.11,
  # datasets<=4.0)
  llamafactory) PINS="transformers==5.6.0 peft==0.18.1 trl==0.24.0 accelerate==1.11.0 datasets==4.0.0" ;;
  # the newest releases on the index
  newest) PINS="transformers==5.25.0 peft==0.21.2 trl==1.16.0 accelerate==1.16.0 datasets==5.2.0" ;;
  # the lower bounds pyproject.toml declares (LisaTrainer calls create_optimizer(model) and _get_grad_norm, new in
  # transformers 5.3; hf-lisa train passes add_column(feature=...), new in datasets 3.1)
  oldest) PINS="transformers==5.3.0 peft==0.18.0 accelerate==1.10.0 datasets==3.1.0 huggingface_hub==1.3.0" ;;
  *) echo "unknown lane '$LANE' (axolotl, llamafactory, newest, oldest)" >&2; exit 2 ;;
esac
# hf-lisa's own light dependencies and the test runner (matplotlib: hf-lisa train draws loss.png)
EXTRA="pytest>=8 pytest-timeout>=2.3 pyyaml>=6.0 jinja2>=3.1 safetensors>=0.4.3 tqdm>=4.66 matplotlib>=3.7"

TIMES=$VENV/times.txt
now() { date +%s; }

build() {
  local t0; t0=$(now)
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  "$PY" -m pip install --quiet --upgrade pip
  "$PY" -m pip install --quiet "torch==$TORCH_VERSION"
  # shellcheck disable=SC2086  # word splitting of the pin lists is intended
  "$PY" -m pip install --quiet "torch==$TORCH_VERSION" $PINS $EXTRA
  "$PY" -m pip install --quiet --no-deps -e "$ROOT"
  "$PY" -m pip freeze --exclude-editable | grep -iE '^(torch|transformers|peft|trl|accelerate|datasets|huggingface.hub|tokenizers|safetensors)==' \
    > "$VENV/versions.txt"
  echo "build $(( $(now) - t0 ))s" >> "$TIMES"
  touch "$VENV/.built"
}

stale() {
  [ ! -e "$VENV/.built" ] || [ "$ROOT/tests/compat/run_lane.sh" -nt "$VENV/.built" ] ||
    [ "$ROOT/pyproject.toml" -nt "$VENV/.built" ]
}

run_tests() {
  local t0 selection rc=0; t0=$(now)
  selection=(
    tests/test_scheduler_full.py tests/test_private_trainer_api.py tests/compat/test_peft_requirement.py
    tests/test_library_face.py tests/test_renamed.py  # LisaTrainingArguments on each lane's TrainingArguments
    "tests/test_train_cli.py::test_every_method_trains_saves_and_reloads[lisa]"
    "tests/test_train_cli.py::test_every_method_trains_saves_and_reloads[full]"
  )
  # the PEFT tuner's tests run where the installed PEFT is one the tuner supports (hf_lisa/tuner/peft_type.py)
  if (cd /tmp && "$PY" -c "from hf_lisa.tuner.peft_type import peft_is_supported as s; raise SystemExit(not s())"); then
    selection+=(tests/test_resume.py tests/test_tuner.py
                "tests/test_train_cli.py::test_every_method_trains_saves_and_reloads[lisa-adapter]")
  else
    selection+=(tests/test_resume.py
                --deselect tests/test_resume.py::test_adapter_resume_mid_importance_window_matches_uninterrupted_run
                --deselect tests/test_scheduler_full.py::test_peft_model_is_refused_with_the_adapter_callback_named)
    echo "lane $LANE: PEFT $("$PY" -c 'import peft; print(peft.__version__)') is older than the tuner needs:" \
         "the tuner's tests and the LISA-adapter tests of the other files are left out"
  fi
  (cd "$ROOT" && OMP_NUM_THREADS=1 "$PY" -m pytest -q -p no:cacheprovider "${selection[@]}") || rc=$?
  echo "test $(( $(now) - t0 ))s rc=$rc" >> "$TIMES"
  return $rc
}

case $STEP in
  build) build ;;
  test) run_tests ;;
  all) if stale; then build; fi; run_tests ;;
  *) echo "unknown step '$STEP' (all, build, test)" >&2; exit 2 ;;
esac
