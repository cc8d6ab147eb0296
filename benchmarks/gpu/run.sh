#!/usr/bin/env bash
# Time to first token on a GPU host, cold and after restarting vLLM and the cache server, from
# kvpersist's L2 and from nixl_store_dynamic, at 32k and 128k tokens (benchmarks/gpu/
# bench_ttft_gpu.py; its docstring says what is measured). Never part of CI.
#
#   bash benchmarks/gpu/run.sh [bench_ttft_gpu.py arguments]
#
# Python: KVP_GPU_PYTHON if set; else python3 when it already imports vllm and lmcache; else a
# venv (.venv-gpu) with the official CUDA builds installed: `pip install vllm lmcache==0.5.6`,
# from KVP_WHEELS (a folder of wheels, --no-index) on a host without an index. kvpersist itself
# runs from this checkout (PYTHONPATH). The measurement is cut off after KVP_GPU_TIMEOUT_S
# (480 s); results go to benchmarks/results/ttft-gpu.json.
set -euo pipefail
cd "$(dirname "$0")/../.."
export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
export PYTHONPATH="$PWD/implementation${PYTHONPATH:+:$PYTHONPATH}"

py=${KVP_GPU_PYTHON:-}
if [[ -z "$py" ]]; then
  if python3 -c "import vllm, lmcache" 2>/dev/null; then
    py=python3
  else
    venv=${KVP_GPU_VENV:-.venv-gpu}
    [[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
    pip_from=()
    [[ -n "${KVP_WHEELS:-}" ]] && pip_from=(--no-index --find-links "$KVP_WHEELS")
    echo "== installing vllm and lmcache==0.5.6 into $venv"
    "$venv/bin/pip" install -q "${pip_from[@]}" vllm "lmcache==0.5.6" xxhash numpy
    py="$venv/bin/python"
  fi
fi
"$py" -c "import vllm, lmcache, torch; print('vllm', vllm.__version__, 'lmcache',
lmcache.__version__ if hasattr(lmcache, '__version__') else '?', 'cuda', torch.cuda.is_available())"
exec timeout "${KVP_GPU_TIMEOUT_S:-480}" "$py" benchmarks/gpu/bench_ttft_gpu.py "$@"
