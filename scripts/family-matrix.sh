#!/usr/bin/env bash
# The architecture matrix: every model family of kvpersist.demo.tiny_families (tiny random-weight
# checkpoints built here, no downloads) through `kvp-admin identity write-pins`, `kvp-server`
# and `kvp-vllm`: a ~1,000-token chat stored, both processes restarted, the chat again. A family
# passes when it is cached with every full chunk from L2 and an answer bit-identical to its cold
# one, or refused by the gate with the reason docs/models.md states. CI runs a fixed core
# (tests/e2e/test_family_matrix_e2e.py); this runs them all (about 2 minutes a family on 2 cores)
# and records the run in benchmarks/results/family-matrix.json with its date.
#   bash scripts/family-matrix.sh [FAMILY ...]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
bash scripts/bootstrap.sh
export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 VLLM_NO_USAGE_STATS=1
work="$(mktemp -d "${TMPDIR:-/tmp}/kvp-family-matrix.XXXXXX")"
trap 'rm -rf "$work"' EXIT
"$here/.venv/bin/python" -m kvpersist.testing.family_matrix "$work" "$@" \
  --json "$here/benchmarks/results/family-matrix.json"
