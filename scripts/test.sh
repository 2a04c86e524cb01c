#!/usr/bin/env bash
# Set up (if needed) and run the tests on the embedded tiny models, offline.
#
#   scripts/test.sh            # the whole suite (the README's command; CI's .ci/run adds -q)
#   scripts/test.sh --fast     # every package's unit tests: the suite less its `slow` tests
#                              # (end to end: captures, servers, fresh processes, bench runs)
#   scripts/test.sh --fast tests/test_policy.py -x   # other arguments go to pytest
#   TEST_JOBS=1 scripts/test.sh                      # one process (default: 2 workers)
#
# Two phases: everything but the `ray` tests on TEST_JOBS pytest-xdist workers (whole files
# to a worker, so module fixtures are built once), then the `ray` tests in one process (two
# local Ray clusters on one machine can find each other: `ray.init()` joins the newest). The
# end of each phase lists its slowest tests (pytest's --durations), so a test that grows slow
# is seen where it is added.
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh dev || exit $?
export HF_HUB_OFFLINE=1
fast=0
args=()
for arg in "$@"; do
  if [ "$arg" = --fast ]; then fast=1; else args+=("$arg"); fi
done
jobs=${TEST_JOBS:-2}
parallel=(--durations=25)
[ "$jobs" -gt 1 ] && parallel+=(-n "$jobs" --dist loadfile)
if [ "$fast" = 1 ]; then  # the ray tests are all slow: one phase
  exec .venv/bin/python -m pytest "${parallel[@]}" -m "not slow" ${args[@]+"${args[@]}"}
fi
.venv/bin/python -m pytest "${parallel[@]}" -m "not ray" ${args[@]+"${args[@]}"}
first=$?
.venv/bin/python -m pytest --durations=10 -m ray ${args[@]+"${args[@]}"}
second=$?
[ "$second" = 5 ] && second=0  # (the arguments named no ray test)
[ "$first" != 0 ] && exit "$first"
exit "$second"
