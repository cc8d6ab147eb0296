#!/usr/bin/env bash
# The main job: the CPU demo of the whole stack (see README). Arguments go to `python -m kvpersist.demo`
# (e.g. --cache-root DIR to keep the L2 files; --help for all).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$here/scripts/bootstrap.sh"
cd "$here"  # the demo keeps its model and logs in ./.kvp-demo
exec "$here/.venv/bin/python" -m kvpersist.demo "$@"
