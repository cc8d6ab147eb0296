#!/usr/bin/env bash
# Start, stop or inspect the LMCache MP server for KVP_CACHE_ROOT (pid file, health wait, SIGTERM):
# a thin wrapper of the `kvp-server` command for recipes.
#   scripts/kvp-server.sh start|stop|status [--json]
# Settings: configs/generic/lmcache-server.env, overridden by the environment (docs/configuration.md).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
exec "${KVP_PYTHON:-$here/.venv/bin/python}" -m kvpersist.admin.cli server "$@"
