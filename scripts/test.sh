#!/usr/bin/env bash
# Run the test suite in .venv (made by scripts/setup.sh).
#
#   scripts/test.sh            # the default suite (under ~15 minutes on 2 cores), then the slow
#                              # tests if the whole run stays within DTRAIN_TEST_BUDGET_S
#   scripts/test.sh -k resume  # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
BUDGET_S="${DTRAIN_TEST_BUDGET_S:-2700}"   # CI allows 90 minutes; stay well under it
SLOW_ESTIMATE_S=900                        # what the slow tests take on 2 cores, with margin

start=$(date +%s)
.venv/bin/python -m pytest -m "not slow" "$@"
elapsed=$(( $(date +%s) - start ))
if [ $(( elapsed + SLOW_ESTIMATE_S )) -le "$BUDGET_S" ]; then
  echo "test.sh: default suite took ${elapsed}s; running the slow tests"
  rc=0
  .venv/bin/python -m pytest -m slow "$@" || rc=$?
  [ "$rc" = 5 ] && rc=0   # no slow test selected (e.g. with -k) is not a failure
  exit "$rc"
else
  echo "test.sh: default suite took ${elapsed}s; skipping the slow tests to stay within ${BUDGET_S}s"
fi
