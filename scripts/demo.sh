#!/usr/bin/env bash
# The main job: the CPU demo of the whole stack (see README). Arguments go to `python -m kvpersist.demo`
# (e.g. --cache-root DIR to keep the L2 files; --help for all).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$here/scripts/bootstrap.sh"
export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
exec "$here/.venv/bin/python" -m kvpersist.demo "$@"
