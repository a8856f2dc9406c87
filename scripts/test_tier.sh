#!/usr/bin/env bash
# The test tiers, in two passes: every test not marked `serial` on pytest-xdist workers (one torch
# thread each), then the `serial` tests alone on the machine. Then the slowest tests of both passes
# and the tier's wall time.
#   bash scripts/test_tier.sh fast [pytest args]   make test: all but the `slow` tests (<= 10 min on 2 cores)
#   bash scripts/test_tier.sh all  [pytest args]   make test-all, CI: everything (GPU tests skip without a card)
# Extra arguments go to both passes, e.g. a file: `bash scripts/test_tier.sh fast tests/test_engine.py`.
# TEST_WORKERS sets the workers (default 2, the cores of the reference machine; 0 runs in-process).
set -uo pipefail
cd "$(dirname "$0")/.."
tier=${1:?usage: test_tier.sh fast|all [pytest args]}
shift
PY=${PYTHON:-.venv/bin/python}
case "$tier" in
  fast) keep="not slow and " ;;
  all) keep="" ;;
  *) echo "test_tier.sh: unknown tier '$tier' (fast or all)" >&2; exit 2 ;;
esac
workers=${TEST_WORKERS:-2}
# the passes' JUnit XML stays in .test-tier/ (git-ignored) for a look at every test's time
out=.test-tier
rm -rf "$out" && mkdir -p "$out"
# Compiled graphs are cached across runs (inductor's cache in /tmp); a warm cache makes a compiling
# test several CPU seconds cheaper than on CI's fresh machine, so the tier guard would pass here what
# fails there. Each tier run starts from an empty cache of its own, as CI does; set
# TORCHINDUCTOR_CACHE_DIR to keep one between runs.
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$PWD/$out/inductor-cache}"
start=$(date +%s)

# pytest exits 5 when a pass selects no test (a file without serial tests): not a failure.
run_pass() {
  "$PY" -m pytest -q -p no:cacheprovider --tier-guard "$@"
  rc=$?
  [ "$rc" -eq 5 ] && rc=0
  return "$rc"
}
parallel=()
[ "$workers" != "0" ] && parallel=(-n "$workers" --dist loadgroup)
run_pass "${parallel[@]}" -m "${keep}not serial" --junitxml="$out/parallel.xml" "$@"
rc1=$?
# Without arguments the serial pass collects only the files that mark tests `serial` (collecting the
# whole suite again costs ~40 s on 2 cores); with arguments, what they name.
serial=("$@")
if [ "$#" -eq 0 ]; then
  mapfile -t serial < <(grep -rl --include='test_*.py' 'mark\.serial' tests | sort)
fi
rc2=0
if [ "${#serial[@]}" -gt 0 ]; then
  run_pass -m "${keep}serial" --junitxml="$out/serial.xml" "${serial[@]}"
  rc2=$?
fi
"$PY" scripts/test_report.py --tier "$tier" --seconds $(( $(date +%s) - start )) \
  --json "$out/durations.json" "$out"/*.xml
[ "$rc1" -eq 0 ] && [ "$rc2" -eq 0 ]
