#!/usr/bin/env bash
# Start, stop or inspect the LMCache MP server for KVP_CACHE_ROOT (pid file, health wait, SIGTERM).
#   scripts/kvp-server.sh start|stop|status [--json]
# Settings: configs/generic/lmcache-server.env, overridden by the environment (README "Environment").
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${KVP_PYTHON:-$here/.venv/bin/python}"
export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 HF_HUB_OFFLINE=1
export PYTHONPATH="$here/implementation${PYTHONPATH:+:$PYTHONPATH}"
exec "$py" -m kvpersist.cli server "$@"
