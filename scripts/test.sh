#!/usr/bin/env bash
# The whole test suite: lint, types, unit, integration and end-to-end tests with real processes.
# Extra arguments go to pytest (e.g. `-k identity`).  `--quick` (first argument) is the edit-test
# loop's tier: lint, types, unit and integration tests, no vLLM and no GlusterFS (a few minutes).
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
# --durations: the slowest tests show in every run (CI must stay under 60 minutes)
if (( quick )); then
  echo "== pytest (quick: not e2e, no shared tree)"
  exec "$py" -m pytest tests -m "not e2e" --ignore=tests/shared --durations=10 "$@"
fi
echo "== pytest"; exec "$py" -m pytest tests --durations=25 "$@"
