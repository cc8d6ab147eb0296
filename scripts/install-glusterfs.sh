#!/usr/bin/env bash
# GlusterFS for the shared-tree tests (tests/shared): installs Debian's glusterfs-server and
# glusterfs-client when they are missing. Starts nothing: each test run starts its own glusterd
# on 127.0.0.2 and tears it down (kvpersist.testing.glusterfs). Never fails the caller: where the
# packages cannot be installed (not root, no apt, no registry), it says why and the shared-tree
# tests skip with that reason.
set -uo pipefail
if command -v glusterd >/dev/null && command -v mount.glusterfs >/dev/null; then
  exit 0
fi
if [[ "$(id -u)" != 0 ]] || ! command -v apt-get >/dev/null; then
  echo "install-glusterfs: not root or no apt-get; the shared-tree tests will skip" >&2
  exit 0
fi
echo "install-glusterfs: installing glusterfs-server glusterfs-client (shared-tree tests)" >&2
log="$(mktemp)"
if ! DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -q --no-install-recommends \
     glusterfs-server glusterfs-client >"$log" 2>&1; then
  DEBIAN_FRONTEND=noninteractive timeout 300 apt-get update -q >>"$log" 2>&1
  DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -q --no-install-recommends \
     glusterfs-server glusterfs-client >>"$log" 2>&1 \
    || { echo "install-glusterfs: apt-get failed; the shared-tree tests will skip:" >&2
         tail -5 "$log" >&2; }
fi
rm -f "$log"
# A package's post-install may have started a glusterd; the tests start their own.
pkill -x glusterd 2>/dev/null || true
exit 0
