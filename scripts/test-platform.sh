#!/usr/bin/env bash
# The platform layer: pytest -m platform, the tests on real Kubernetes nodes with real OCM and the
# addon installed as a user does it (tests/real_platform). Needs root, Go and the project's images:
# on first use it builds the nodes' programs into the tool cache (~12 min on 2 cores), and under
# CI=true the images when missing; a missing prerequisite skips on a laptop, fails under CI=true.
# `./scripts/task test` runs it after the slow layer has ended (both its lanes), never beside it: three
# real nodes take both cores for minutes and would starve the clock-bound tests. Without extra
# pytest arguments it runs tests/real_platform; with them (`-k ...`, a path) only what they say.
# It fails when the run fails or collects nothing (exit 5).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# The cache plugin off: another worktree's or lane's run may write .pytest_cache at the same time.
pytest=(.venv/bin/pytest --durations=20 -p no:cacheprovider -m platform)
[ "$#" -gt 0 ] || set -- tests/real_platform

echo "task: [test-platform] ${pytest[*]} $*" >&2
started=$SECONDS
"${pytest[@]}" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then echo "test-platform: pytest collected no tests (-m platform $*): failing" >&2; fi
echo "test-platform: the platform layer took $((SECONDS - started)) s (exit $rc)" >&2
exit "$rc"
