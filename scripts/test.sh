#!/usr/bin/env bash
# The whole test suite: lint, types, then pytest in two passes: every test that can share the
# machine on two workers (pytest-xdist; a file runs whole on one worker, tests/conftest.py),
# then the tests marked `serial` (they drop the page cache, pin CPUs or bound a latency) one at
# a time with the machine to themselves.
# Extra arguments go to both pytest passes (e.g. `-k identity`).  `--quick` (first argument) is
# the edit-test loop's tier: lint, types, unit and integration tests, no vLLM and no GlusterFS.
#   KVP_TEST_WORKERS   workers of the first pass (default 2; 0 runs it in this process)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
quick=0
if [[ "${1:-}" == "--quick" ]]; then quick=1; shift; fi
bash scripts/bootstrap.sh
if (( ! quick )); then
  bash scripts/install-glusterfs.sh  # the shared-tree tests; they skip, saying why, without it
fi
py="$here/.venv/bin/python"
echo "== ruff"; "$py" -m ruff check implementation tests benchmarks
echo "== mypy"; "$py" -m mypy
workers="${KVP_TEST_WORKERS:-2}"
parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
if [[ "$workers" == 0 ]]; then parallel=(-p no:xdist); fi
scope=(tests)
select=""
if (( quick )); then scope=(tests --ignore=tests/shared); select="not e2e and "; fi
# --durations: the slowest tests show in every run (the budget is in docs/testing.md)
rc=0
run_pass() {  # a pass's failure fails the run; "no test selected" (5, e.g. -k) does not
  local s=0
  "$py" -m pytest "$@" || s=$?
  if (( s != 0 && s != 5 )); then rc=$s; fi
}
shm_snapshot="$(mktemp)" mount_snapshot="$(mktemp)"
"$py" -m kvpersist.testing.shm_leftovers snapshot "$shm_snapshot"
"$py" -m kvpersist.testing.mount_leftovers snapshot "$mount_snapshot"
echo "== pytest (shared machine: $workers workers)"
run_pass "${scope[@]}" -m "${select}not serial" "${parallel[@]}" --durations=15 "$@"
echo "== pytest (serial: the machine to each test alone)"
run_pass "${scope[@]}" -m "${select}serial" -p no:xdist --durations=10 "$@"
echo "== shared memory left behind"
"$py" -m kvpersist.testing.shm_leftovers check "$shm_snapshot" || rc=1
echo "== mounts and loop devices left behind"
"$py" -m kvpersist.testing.mount_leftovers check "$mount_snapshot" || rc=1
rm -f "$shm_snapshot" "$mount_snapshot"
exit "$rc"
