#!/usr/bin/env bash
# axolotl 0.19.0's real trainer with hf-lisa's plugin, on CPU, with a tiny local llama (issue 35, item 2;
# docs/integrations.md, "axolotl"): `axolotl train config.yml` with plugins: [hf_lisa.integrations.axolotl.LisaPlugin],
# full fine-tuning, γ = 1 of 4 blocks, K = 2, 6 steps, a checkpoint every K steps; then the checks of
# tests/compat/axolotl_real_run.py (only the sampled blocks + E+H+norm change per interval, the optimizer state is
# E+H+norm+γL, axolotl's LISACallback does not run, the saved model loads). Exits non-zero on a failed check.
#
#   tests/compat/axolotl_real_run.sh [WORKDIR]          (make test-axolotl)
#
# The virtualenv .venv-compat/axolotl-real is built when missing: the CPU torch first, then axolotl with torch pinned
# in the same command (an unpinned torch pulls a multi-GB CUDA build), then hf-lisa --no-deps, editable. pip's cache is
# reused. AXOLOTL_REAL_REBUILD=1 rebuilds it.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
VENV=${AXOLOTL_REAL_VENV:-$ROOT/.venv-compat/axolotl-real}
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
AXOLOTL_VERSION=${AXOLOTL_VERSION:-0.19.0}
WORK=${1:-$(mktemp -d "${TMPDIR:-/tmp}/axolotl-real.XXXXXX")}
now() { date +%s; }

if [ "${AXOLOTL_REAL_REBUILD:-0}" = 1 ] || [ ! -f "$VENV/.built" ]; then
  t0=$(now)
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  "$VENV/bin/python" -m pip install --quiet "torch==$TORCH_VERSION"
  "$VENV/bin/python" -m pip install --quiet "torch==$TORCH_VERSION" "axolotl==$AXOLOTL_VERSION"
  "$VENV/bin/python" -m pip install --quiet --no-deps -e "$ROOT"
  touch "$VENV/.built"
  echo "built $VENV in $(( $(now) - t0 )) s"
fi
"$VENV/bin/python" -m pip freeze --exclude-editable 2>/dev/null \
  | grep -iE '^(torch|axolotl|transformers|peft|trl|accelerate|datasets)==' | tr '\n' ' '; echo

"$VENV/bin/python" "$ROOT/tests/compat/axolotl_real_run.py" setup "$WORK"
t0=$(now)
# axolotl train execs `accelerate launch -m axolotl.cli.train` by name (axolotl/cli/utils/train.py:179-190), so the
# virtualenv's bin goes first on PATH; no telemetry (no network here)
(cd "$WORK" && PATH="$VENV/bin:$PATH" AXOLOTL_DO_NOT_TRACK=1 DO_NOT_TRACK=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} \
  "$VENV/bin/axolotl" train config.yml) > "$WORK/train.log" 2>&1 || {
  tail -40 "$WORK/train.log"; echo "axolotl train failed (log: $WORK/train.log)"; exit 1; }
echo "axolotl train: $(( $(now) - t0 )) s (log: $WORK/train.log)"
"$VENV/bin/python" "$ROOT/tests/compat/axolotl_real_run.py" check "$WORK"
