#!/usr/bin/env bash
# The whole suite (`make test`) in two lanes that keep a 2-core machine busy:
#   1. the xla tests (XLA compiles on about one core) in their own environment (XLA_PYTHON: torch
#      2.9.0 + torch_xla 2.9.0), then half of the end-to-end tests;
#   2. the unit tests and the slow tests that train in pytest's own process (in_process), then
#      the other half of the end-to-end tests (tests/conftest.py's LANE_A says which module runs
#      where; their supervisors and workers mostly wait on each other, so two lanes fill the cores).
# Arguments go to every pytest run (-x, -k EXPR, --durations=N, test paths); -m is this script's
# own. Exit 0 only if every stage passes.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
xla_python=${XLA_PYTHON:-.venv-xla/bin/python}
if [ ! -x "$xla_python" ]; then
    echo "run_all.sh: no $xla_python (the xla tests' environment): run 'make test', which makes it" >&2
    exit 2
fi
# OpenMP's idle threads sleep instead of spinning: with two processes training on two cores, the
# spinning made each one's steps 8x slower (tests/conftest.py's python_env sets it for children).
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
# Our own modules' bytecode, written once here rather than compiled again by each of the few
# hundred processes the tests start where PYTHONDONTWRITEBYTECODE is set (the venv's is compiled
# at install).
"$python" -m compileall -q engine tpud tests bench >/dev/null

ran() {  # a stage's status, with pytest's 5 (nothing collected: a -k that matched none here) as a pass
    [ "$1" -eq 5 ] && echo 0 || echo "$1"
}

E2E="slow and not xla and not in_process"
lane_log=$(mktemp)
status_dir=$(mktemp -d)
trap 'rm -rf "$lane_log" "$status_dir"; [ -n "${lane_pid:-}" ] && kill "$lane_pid" 2>/dev/null' EXIT
(
    "$xla_python" -m pytest -m "xla" "$@"
    echo $? >"$status_dir/xla"
    TPUD_TEST_LANE=a "$python" -m pytest -m "$E2E" "$@"
    echo $? >"$status_dir/e2e_a"
) >"$lane_log" 2>&1 &
lane_pid=$!
"$python" -m pytest -m "not xla and (not slow or in_process)" "$@"
unit=$(ran $?)
echo; echo "=== end-to-end tests, lane b (lane a runs beside it) ==="
TPUD_TEST_LANE=b "$python" -m pytest -m "$E2E" "$@"
e2e_b=$(ran $?)
wait "$lane_pid"
lane_pid=  # reaped: its number may be another process's by the time the trap runs
echo; echo "=== the xla tests, then end-to-end lane a, run beside the above ==="
cat "$lane_log"
xla=$(ran "$(cat "$status_dir/xla" 2>/dev/null || echo 1)")
e2e_a=$(ran "$(cat "$status_dir/e2e_a" 2>/dev/null || echo 1)")
echo "stages: unit $unit, xla $xla, end-to-end lane a $e2e_a, lane b $e2e_b"
[ "$unit" -eq 0 ] && [ "$xla" -eq 0 ] && [ "$e2e_a" -eq 0 ] && [ "$e2e_b" -eq 0 ]
