#!/usr/bin/env bash
# Launch vLLM's OpenAI server with the kvpersist KV connector: a thin wrapper of the `kvp-vllm`
# command for recipes.  The production recipe stays as it is: pass its vLLM arguments unchanged.
#
#   scripts/run-vllm-with-persist.sh MODEL [vLLM args...]
#
# Environment (`kvp-vllm --help` lists all):
#   KV_PERSIST=1          (default) add the kvpersist --kv-transfer-config; KV_PERSIST=0 runs the
#                         recipe untouched
#   KVP_IDENTITY_PINS     configs/<model>/identity.env (required with KV_PERSIST=1)
#   KVP_CACHE_ROOT, KVP_RUNTIME_DIR   where the LMCache server's sockets are (KVP_ACCESS=tcp:
#                         KVP_BIND_HOST, KVP_ZMQ_PORT); see configs/generic/lmcache-server.env
#   KVP_PYTHON            the Python with vLLM, LMCache and kvpersist (default: the repo's .venv)
#   KVP_VLLM_EXEC         optional command prefix, e.g. "docker exec mimo-pro-tp4-kvp" (unset: local)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${KVP_PYTHON:-$here/.venv/bin/python}"
[[ -x "$py" ]] || py="$(command -v python3)"
export KVP_PYTHON="$py"
exec "$py" -m kvpersist.serving.launcher.kvp_vllm "$@"
