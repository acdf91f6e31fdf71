#!/usr/bin/env bash
# The whole suite (`make test`), in two stages that keep a 2-core machine busy:
#   1. the xla tests (XLA compiles on about one core) beside the unit tests and the slow tests
#      that train in pytest's own process (in_process), which fill the time the xla tests take;
#   2. the end-to-end tests, alone: their supervisors and workers want the whole machine.
# Arguments go to every pytest run (-x, -k EXPR, --durations=N, test paths); -m is this script's
# own. Exit 0 only if every stage passes.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
# OpenMP's idle threads sleep instead of spinning: with two processes training on two cores, the
# spinning made each one's steps 8x slower (tests/conftest.py's python_env sets it for children).
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}

ran() {  # a stage's status, with pytest's 5 (nothing collected: a -k that matched none here) as a pass
    [ "$1" -eq 5 ] && echo 0 || echo "$1"
}

xla_log=$(mktemp)
trap 'rm -f "$xla_log"; [ -n "${xla_pid:-}" ] && kill "$xla_pid" 2>/dev/null' EXIT
"$python" -m pytest -m "xla" "$@" >"$xla_log" 2>&1 &
xla_pid=$!
"$python" -m pytest -m "not xla and (not slow or in_process)" "$@"
unit=$(ran $?)
wait "$xla_pid"
xla=$(ran $?)
xla_pid=  # reaped: its number may be another process's by the time the trap runs
echo; echo "=== the xla tests, run beside the unit tests ==="
cat "$xla_log"
echo; echo "=== the end-to-end tests ==="
"$python" -m pytest -m "slow and not xla and not in_process" "$@"
slow=$(ran $?)
echo "stages: unit $unit, xla $xla, end-to-end $slow"
[ "$unit" -eq 0 ] && [ "$xla" -eq 0 ] && [ "$slow" -eq 0 ]
