#!/usr/bin/env bash
# Launch vLLM's OpenAI server with the kvpersist KV connector (LMCache MP connector behind the
# identity gate).  The production recipe stays as it is: pass its vLLM arguments unchanged.
#
#   scripts/run-vllm-with-persist.sh MODEL [vLLM args...]
#
# Environment:
#   KV_PERSIST=1          (default) add the kvpersist --kv-transfer-config; KV_PERSIST=0 runs the
#                         recipe untouched, so an existing recipe can wrap its command with this
#                         script and switch persistence on and off with one variable.
#   KVP_IDENTITY_PINS     configs/<model>/identity.env (required with KV_PERSIST=1)
#   KVP_BIND_HOST, KVP_ZMQ_PORT   where the LMCache server listens (configs/generic/lmcache-server.env)
#   KVP_PYTHON            the Python with vLLM, LMCache and kvpersist (default: the repo's .venv)
#   KVP_VLLM_EXEC         optional command prefix, e.g. "docker exec mimo-pro-tp4-kvp" (unset: local)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ $# -lt 1 ]]; then
  sed -n '2,17p' "$0" >&2
  exit 2
fi
model="$1"; shift
py="${KVP_PYTHON:-$here/.venv/bin/python}"
[[ -x "$py" ]] || py="$(command -v python3)"

export VLLM_NO_USAGE_STATS=1 VLLM_DO_NOT_TRACK=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1
export LMCACHE_TRACK_USAGE=false LMCACHE_DISABLE_BANNER=1
export VLLM_HOST_IP="${VLLM_HOST_IP:-127.0.0.1}"

args=("$@")
if [[ "${KV_PERSIST:-1}" == "1" ]]; then
  : "${KVP_IDENTITY_PINS:?set KVP_IDENTITY_PINS to configs/<model>/identity.env (or KV_PERSIST=0)}"
  template=""
  for ((i = 0; i < ${#args[@]}; i++)); do
    case "${args[$i]}" in
      --chat-template) template="${args[$((i + 1))]:-}" ;;
      --chat-template=*) template="${args[$i]#--chat-template=}" ;;
    esac
  done
  ktc_args=(--pins "$KVP_IDENTITY_PINS")
  [[ -n "$template" ]] && ktc_args+=(--chat-template "$template")
  ktc="$(PYTHONPATH="$here/implementation${PYTHONPATH:+:$PYTHONPATH}" "$py" -m kvpersist.vllm_launch "${ktc_args[@]}")"
  args+=(--kv-transfer-config "$ktc")
  echo "kvpersist: KV persistence on (pins $KVP_IDENTITY_PINS)" >&2
else
  echo "kvpersist: KV_PERSIST=0, running the recipe without the KV connector" >&2
fi

export PYTHONPATH="$here/implementation${PYTHONPATH:+:$PYTHONPATH}"
# shellcheck disable=SC2086
exec ${KVP_VLLM_EXEC:-} "$py" -m vllm.entrypoints.openai.api_server --model "$model" "${args[@]}"
