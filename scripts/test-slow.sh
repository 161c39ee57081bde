#!/usr/bin/env bash
# The slow test layer. Without extra pytest arguments it runs in two lanes at once: the tests marked
# `clock_bound` (their length is set by certificate lifetimes and refresh intervals, not by the work
# they do: mostly waiting) beside the rest. The clock-bound lane starts once the main lane has built
# its prerequisites (tests/conftest.py signals it), so that a cold build of Go programs or images does
# not starve tests that keep time; its output follows the main lane's. With extra arguments (`-k ...`,
# a path) it is one pytest run. Either way it fails when a run fails or collects nothing (exit 5).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
pytest=(.venv/bin/pytest --durations=20)

check() { # rc what
  if [ "$1" -eq 5 ]; then echo "test-slow: pytest collected no tests ($2): failing" >&2; fi
  return "$1"
}

if [ "$#" -gt 0 ]; then
  echo "task: [test-slow] ${pytest[*]} -m slow $*" >&2
  "${pytest[@]}" -m slow "$@"
  check $? "-m slow $*"
  exit
fi

scratch=$(mktemp -d --tmpdir test-slow.XXXXXX)
trap 'rm -rf "$scratch"' EXIT
# Job control while the lane starts: a background job of a script ignores SIGINT otherwise, and
# Ctrl-C (forwarded by the trap below) would leave it running.
set -m
(
  while [ ! -e "$scratch/prepared" ] && [ ! -e "$scratch/main-done" ]; do sleep 0.5; done
  [ -e "$scratch/prepared" ] || exit 99
  # The cache plugin off: the two runs would write .pytest_cache at once.
  exec "${pytest[@]}" -p no:cacheprovider -m "slow and clock_bound"
) >"$scratch/clock-bound.log" 2>&1 &
clock_bound=$!
set +m
trap 'kill -INT "$clock_bound" 2>/dev/null' INT TERM

echo "task: [test-slow] ${pytest[*]} -m 'slow and not clock_bound', and beside it -m 'slow and clock_bound'" >&2
CLUSTER_PROXY_TESTS_PREPARED="$scratch/prepared" "${pytest[@]}" -m "slow and not clock_bound"
check $? "slow and not clock_bound"
main_rc=$?
touch "$scratch/main-done"
wait "$clock_bound"
clock_bound_rc=$?
echo "=== test-slow: the clock-bound lane (-m 'slow and clock_bound'), run beside the above ===" >&2
cat "$scratch/clock-bound.log"
if [ "$clock_bound_rc" -eq 99 ]; then
  echo "test-slow: the clock-bound lane did not run: the main lane ended before it had built its prerequisites" >&2
fi
check "$clock_bound_rc" "slow and clock_bound"
clock_bound_rc=$?
[ "$main_rc" -eq 0 ] && [ "$clock_bound_rc" -eq 0 ]
