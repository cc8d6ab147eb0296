#!/usr/bin/env bash
# The whole test suite: lint, types, unit, integration and end-to-end tests with real processes.
# Extra arguments go to pytest (e.g. `-m "not e2e"` for the quick part, `-k identity`).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
bash scripts/bootstrap.sh
bash scripts/install-glusterfs.sh  # the shared-tree tests; they skip, saying why, without it
py="$here/.venv/bin/python"
echo "== ruff"; "$py" -m ruff check implementation tests benchmarks
echo "== mypy"; "$py" -m mypy
# --durations: the slowest tests show in every run (CI must stay under 60 minutes)
echo "== pytest"; exec "$py" -m pytest tests --durations=25 "$@"
