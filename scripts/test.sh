#!/usr/bin/env bash
# Set up (if needed) and run the tests on the embedded tiny models, offline.
#
#   scripts/test.sh            # the whole suite (the README's command; CI's .ci/run adds -q)
#   scripts/test.sh --fast     # every package's unit tests: the suite less its `slow` tests
#                              # (end to end: captures, servers, fresh processes, bench runs)
#   scripts/test.sh --fast tests/test_policy.py -x   # other arguments go to pytest
#   TEST_JOBS=1 scripts/test.sh                      # one process (default: 2 workers)
#
# One run on TEST_JOBS pytest-xdist workers, whole files to a worker (so module fixtures are
# built once). The files holding `ray` tests go to one worker together, one after another (two
# local Ray clusters on one machine can find each other: `ray.init()` joins the newest), beside
# the other worker's files (tests/conftest.py's RAY_FILES). The end lists the slowest tests
# (pytest's --durations), so a test that grows slow is seen where it is added.
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
opts=(--durations=25)
[ "$jobs" -gt 1 ] && opts+=(-n "$jobs" --dist loadfile)
[ "$fast" = 1 ] && opts+=(-m "not slow")  # the ray tests are all slow
exec .venv/bin/python -m pytest "${opts[@]}" ${args[@]+"${args[@]}"}
