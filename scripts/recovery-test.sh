#!/usr/bin/env bash
# The recovery acceptance test against the running deployment: a thin wrapper of
# `kvp-admin recovery-test` (see its --help). Exit 0 PASS, 1 FAIL, 2 INCONCLUSIVE.
#
#   KVP_IDENTITY_PINS=configs/<model>/identity.env scripts/recovery-test.sh -- MODEL [vLLM args...]
#
# Server settings come from the environment as for kvp-server (KVP_CACHE_ROOT, ...);
# KVP_CACHE_BLOCK_DEVICE names the cache's block device for the disk evidence.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${KVP_PYTHON:-$here/.venv/bin/python}"
[[ -x "$py" ]] || py="$(command -v python3)"
exec "$py" -m kvpersist.admin.cli recovery-test "$@"
