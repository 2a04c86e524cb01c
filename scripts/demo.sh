#!/usr/bin/env bash
# The main job on the embedded default model, offline: inspect it, capture real EAGLE
# verification passes (one sequence and two at a time), replay them under expert budgets (open
# and closed loop, and budgets shared by a batch), measure speedup vs batch size, write the HTML
# report, and print the command that opens the dashboard. Rerunning reuses what is already
# there. Per-stage times are printed at the end.
#
#   scripts/demo.sh            # every page of the dashboard gets data
#   scripts/demo.sh --quick    # the same stages on fewer prompts, tokens and budgets
#   THREADS=1 TRACES=/tmp/t MODEL=tiny-qwen3-moe scripts/demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
QUICK=0
case "${1:-}" in
  --quick) QUICK=1 ;;
  "") ;;
  *) echo "demo.sh: unknown option ${1}; use --quick or nothing" >&2; exit 2 ;;
esac
scripts/setup.sh  # the project only: no test extras (Ray, selenium)
export HF_HUB_OFFLINE=1
MODEL=${MODEL:-tiny-olmoe}
TRACES=${TRACES:-traces}
THREADS=${THREADS:-2}
bin=.venv/bin
if [ "$QUICK" = 1 ]; then
  EVAL=2; CAL=4; TOKENS=24; BUDGETS=8,16,32; RANKINGS="router oracle coact"; CLOSED=16,32
  SUFFIX=-quick
else
  EVAL=4; CAL=8; TOKENS=48; BUDGETS=sweep; RANKINGS="static router oracle sqmass coact-diag coact"
  CLOSED=sweep; SUFFIX=
fi
timings=$(mktemp)
trap 'rm -f "$timings"' EXIT
stage() {  # stage NAME COMMAND...: run it, remember its wall time
  local name=$1 t0 t1
  shift
  t0=$(date +%s%N)
  "$@"
  t1=$(date +%s%N)
  printf '%-34s %8.1f s\n' "$name" "$(( (t1 - t0) / 1000000 ))e-3" >> "$timings"
}
stage "inspect-model" $bin/inspect-model --model "$MODEL"
stage "capture (evaluation)" $bin/capture --model "$MODEL" --bench mbpp --limit "$EVAL" \
  --max-new-tokens "$TOKENS" --out "$TRACES" --run "demo-eval$SUFFIX" --threads "$THREADS"
stage "capture (calibration)" $bin/capture --model "$MODEL" --bench mbpp --offset 200 \
  --limit "$CAL" --max-new-tokens "$TOKENS" --out "$TRACES" --run "demo-cal$SUFFIX" \
  --role calibration --threads "$THREADS"
stage "capture (batch of 2)" $bin/capture --model "$MODEL" --bench mbpp --offset 20 \
  --limit "$EVAL" --max-new-tokens "$TOKENS" --batch-size 2 --out "$TRACES" \
  --run "demo-b2$SUFFIX" --threads "$THREADS"
# shellcheck disable=SC2086
stage "replay (open loop)" $bin/replay --traces "$TRACES" --model "$MODEL" \
  --run "demo-eval$SUFFIX" --calibration "demo-cal$SUFFIX" --ranking $RANKINGS --coverage both \
  --budget "$BUDGETS" --threads "$THREADS"
stage "replay (closed loop)" $bin/replay --traces "$TRACES" --model "$MODEL" \
  --run "demo-eval$SUFFIX" --mode closed --ranking router --coverage substitution \
  --budget "$CLOSED" --threads "$THREADS"
stage "replay (budgets over batches of 2)" $bin/replay --traces "$TRACES" --model "$MODEL" \
  --run "demo-b2$SUFFIX" --calibration "demo-cal$SUFFIX" --ranking router coact oracle \
  --budget 16,32 --batch-size 2 --threads "$THREADS"
stage "profile-batch (b = 1, 2)" $bin/profile-batch --model "$MODEL" --bench mbpp --offset 40 \
  --limit 2 --max-new-tokens "$TOKENS" --batch-sizes 1,2 --budget 16 --out "$TRACES" \
  --threads "$THREADS"
stage "report" $bin/report --traces "$TRACES" --out reports --threads "$THREADS"
echo
echo "per stage (wall time):"
cat "$timings"
echo
echo "open the dashboard with:  $bin/workbench-app --traces $TRACES"
