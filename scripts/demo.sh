#!/usr/bin/env bash
# The main job on the embedded default model, offline: inspect it, capture real EAGLE
# verification passes, replay them under expert budgets, write the HTML report, and print the
# command that opens the dashboard. Rerunning reuses what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh  # the project only: no test extras (Ray, selenium)
export HF_HUB_OFFLINE=1
MODEL=${MODEL:-tiny-olmoe}
TRACES=${TRACES:-traces}
bin=.venv/bin
$bin/inspect-model --model "$MODEL"
$bin/capture --model "$MODEL" --bench mbpp --limit 4 --max-new-tokens 48 --out "$TRACES" --run demo-eval
$bin/capture --model "$MODEL" --bench mbpp --offset 200 --limit 8 --max-new-tokens 48 --out "$TRACES" --run demo-cal --role calibration
$bin/replay --traces "$TRACES" --model "$MODEL" --run demo-eval --calibration demo-cal \
  --ranking static router oracle sqmass coact-diag coact --coverage both --budget sweep
$bin/replay --traces "$TRACES" --model "$MODEL" --run demo-eval --mode closed --ranking router \
  --coverage substitution --budget sweep
$bin/report --traces "$TRACES" --out reports
echo
echo "open the dashboard with:  $bin/workbench-app --traces $TRACES"
