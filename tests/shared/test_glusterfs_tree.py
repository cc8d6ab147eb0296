"""Two real LMCache servers with the kvpersist adapter, each on its own FUSE mount of one real
GlusterFS volume, as two nodes would be: restore across nodes, one budget under concurrent
stores, a brick killed and brought back, a node killed with -9, and ``kvp-admin`` from either
node.  Needs GlusterFS (``scripts/install-glusterfs.sh``); skipped with the reason otherwise."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvpersist.atomic import temp_name
from kvpersist.config.server import ServerSettings, load_settings
from kvpersist.l2.format import HEADER_SIZE
from kvpersist.l2.lock import root_lock_holder
from kvpersist.serving.pidfile import check_pid_file
from kvpersist.serving.server.lifecycle import ServerError, start_server, stop_server
from kvpersist.testing import glusterfs
from kvpersist.testing.helpers import (
    adapter_status,
    clear_l1,
    l2_files,
    wait_for_l2_files,
    wait_until,
)
from kvpersist.testing.lmcache_bench import BenchDriver
from kvpersist.testing.processes import kill_server, server_pid

from .conftest import MODEL, Nodes

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(glusterfs.unavailable() is not None,
                                 reason=f"no GlusterFS here: {glusterfs.unavailable()}")]
CHUNK_FILE = HEADER_SIZE + 256 * 1024  # one 256-token chunk of the bench shape
GIB = 1024**3


def store(d: BenchDriver, s: ServerSettings, seq: int) -> list[str]:
    sums = d.checksums(seq)
    before = len(l2_files(s.cache_root))
    assert d.store(seq)
    wait_for_l2_files(s.cache_root, before + len(sums))
    return sums


def timed_restore(d: BenchDriver, seq: int, sums: list[str]) -> tuple[Any, float]:
    began = time.monotonic()
    trip = d.lookup_and_retrieve(seq, sums)
    return trip, time.monotonic() - began


def test_a_conversation_stored_on_node_a_is_restored_on_node_b(nodes: Nodes) -> None:
    start_server(nodes["a"])
    start_server(nodes["b"])
    a = nodes.driver("a")
    sums = store(a, nodes["a"], 1)
    clear_l1(nodes["a"])
    local, local_s = timed_restore(a, 1, sums)
    assert (local.hit_chunks, local.retrieved_ok, local.checksums_match) == (4, True, True)
    a.close()
    b = nodes.driver("b")
    remote, remote_s = timed_restore(b, 1, sums)
    # Every full chunk from L2 through the other mount, byte-identical (checksums of the data).
    assert (remote.hit_chunks, remote.retrieved_ok, remote.checksums_match) == (4, True, True)
    status = adapter_status(nodes["b"])
    assert status["foreign_hits"] == 4 and status["load_hits"] == 4
    assert status["files"] == 0  # B wrote nothing: one copy in the tree
    assert l2_files(nodes["b"].cache_root) == {}
    # The cost of a lookup miss on the shared tree: one stat per other node, counted.
    shared = status["shared_tree"]
    before = shared["fs_ops"]
    miss = b.lookup_and_retrieve(99, b.checksums(99))
    assert miss.hit_chunks == 0
    after = adapter_status(nodes["b"])["shared_tree"]
    misses = after["missed"] - shared["missed"]
    assert misses >= 1 and (after["fs_ops"] - before) <= misses * 1 + 1
    b.close()
    print(f"\nrestore of 4 chunks (1 MiB): local {local_s:.3f}s, other node {remote_s:.3f}s "
          f"({remote_s / local_s:.2f}x); lookup miss: {(after['fs_ops'] - before) / misses:.1f} "
          f"file-system ops per missed key with one other node")


def test_concurrent_stores_of_two_nodes_stay_under_the_trees_budget(
        volume: glusterfs.GlusterVolume, tmp_path: Path) -> None:
    budget = 24 * CHUNK_FILE  # 12 chunks per node's share
    nodes = Nodes(volume, tmp_path, "cap", KVP_CACHE_BUDGET_GB=repr(budget / GIB))
    try:
        start_server(nodes["a"])
        start_server(nodes["b"])
        results: dict[str, list[bool]] = {}

        def fill(name: str, first: int) -> None:
            d = nodes.driver(name)
            results[name] = [d.store(seq) for seq in range(first, first + 8)]  # 32 chunks each
            d.close()

        # samples: taken, taken with a file evicted after the listing, lost to a listing that
        # changed under it
        peak, samples = [0], [0, 0, 0]
        filling = threading.Event()

        def tree_bytes() -> int:
            total, vanished = 0, 0
            for p in (nodes["a"].tree / "nodes").glob("*/*.kvp"):
                try:
                    total += p.stat().st_size
                except FileNotFoundError:  # evicted after the listing
                    vanished = 1
            samples[1] += vanished
            return total

        def sample() -> None:  # the tree's bytes while both nodes store, through mount 0
            # Until the stores have landed, not only while the driver sends them: a store is
            # acknowledged before its file lands, and in a loaded clean-clone run no file had
            # landed by the time both drivers were done (peak 0).  A file evicted between the
            # listing and its stat is left out of that sample, not the sample out of the peak.
            while filling.is_set():
                try:
                    peak[0] = max(peak[0], tree_bytes())
                    samples[0] += 1
                except OSError:  # the directory changed under the FUSE listing
                    samples[2] += 1
                time.sleep(0.05)  # the sampling interval while both nodes fill

        threads = [threading.Thread(target=fill, args=(n, f)) for n, f in (("a", 100),
                                                                            ("b", 200))]
        filling.set()
        sampler = threading.Thread(target=sample)
        sampler.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in threads)

        def on_disk(root: Path) -> int:
            total = 0
            for p in root.glob("*.kvp"):
                with contextlib.suppress(FileNotFoundError):  # evicted after the listing
                    total += p.stat().st_size
            return total

        def measure() -> dict[str, int]:
            return {n: on_disk(nodes[n].cache_root) for n in "ab"}

        # Stores are acknowledged before their files land, and eviction (at 0.9 of a share)
        # runs after them: measure once two readings 2 s apart agree.
        parts, deadline = measure(), time.monotonic() + 60
        while True:
            time.sleep(2.0)  # the stability check's interval (the condition is the loop's)
            again = measure()
            if again == parts or time.monotonic() > deadline:
                break
            parts = again
        filling.clear()
        sampler.join()
        # never over the tree's budget, also mid-fill
        assert 0 < peak[0] <= budget, (peak, budget, "samples taken, with a file evicted, lost:",
                                       samples)
        print(f"\n{samples[0]} samples of the tree, {samples[1]} with a file evicted after "
              f"the listing, {samples[2]} lost; peak {peak[0]} of {budget} bytes")
        assert all(0 < used <= budget // 2 for used in parts.values()), parts
        assert sum(parts.values()) <= budget
        for n in "ab":
            status = adapter_status(nodes[n])
            assert status["used_bytes"] == parts[n]  # each node's count equals its part
        report = kvp_admin(nodes["b"], "tree", "--json")
        assert report["tree_bytes"] == sum(parts.values()) and report["within_budget"]
        assert {x["node_id"]: x["live"] for x in report["nodes"]} == {"a": True, "b": True}
        # The count stays right across restarts of either node (each rescans its own part).
        for n in "ab":
            stop_server(nodes[n])
            start_server(nodes[n])
            wait_until(lambda n=n: adapter_status(nodes[n])["scan_done"])
            status = adapter_status(nodes[n])
            assert (status["used_bytes"], status["files"]) == (
                parts[n], len(list(nodes[n].cache_root.glob("*.kvp"))))
    finally:
        nodes.stop()


def test_a_third_node_beyond_the_shares_is_refused(nodes: Nodes, tmp_path: Path) -> None:
    start_server(nodes["a"])
    start_server(nodes["b"])
    third = load_settings(environ={
        "KVP_CACHE_ROOT": str(nodes["a"].tree), "KVP_NODE_ID": "c", "KVP_SHARED_NODES": "2",
        "KVP_RUNTIME_DIR": str(tmp_path / "run-c"), "KVP_L1_SIZE_GB": "1"})
    with pytest.raises(ServerError, match="KVP_SHARED_NODES=2"):
        start_server(third)
    assert not (nodes["a"].tree / "nodes" / "c").exists()
    # The same node id twice (two servers of one node) is refused by the part's lock.
    twin = load_settings(environ={
        "KVP_CACHE_ROOT": str(nodes["b"].tree), "KVP_NODE_ID": "a", "KVP_SHARED_NODES": "2",
        "KVP_RUNTIME_DIR": str(tmp_path / "run-a2"), "KVP_L1_SIZE_GB": "1"})
    with pytest.raises(ServerError, match="already served by another kvpersist L2 store"):
        start_server(twin)


def test_a_killed_brick_costs_misses_and_its_files_hit_again_when_back(
        volume: glusterfs.GlusterVolume, nodes: Nodes) -> None:
    start_server(nodes["a"])
    start_server(nodes["b"])
    a = nodes.driver("a")
    sums = {seq: store(a, nodes["a"], seq) for seq in (1, 2)}
    a.close()
    volume.kill_brick(volume.bricks[0])
    try:
        b = nodes.driver("b")
        began = time.monotonic()
        trips = {seq: b.lookup_and_retrieve(seq, s) for seq, s in sums.items()}
        elapsed = time.monotonic() - began
        # A request completes, with some chunks on the dead brick missing; never wrong bytes.
        assert all(t.checksums_match and t.retrieved_ok for t in trips.values())
        assert sum(t.hit_chunks for t in trips.values()) < 8
        assert elapsed < 60, elapsed
        stored = b.store(3)  # a store to the degraded volume returns; it does not hang
        b.close()
        print(f"\nbrick down: {sum(t.hit_chunks for t in trips.values())}/8 chunks hit, "
              f"{elapsed:.2f}s for both requests; store during the outage acknowledged={stored}")
    finally:
        volume.restart_bricks()
    deadline = time.monotonic() + 60
    while True:
        b = nodes.driver("b")
        clear_l1(nodes["b"])
        trips = {seq: b.lookup_and_retrieve(seq, s) for seq, s in sums.items()}
        b.close()
        if all(t.hit_chunks == 4 for t in trips.values()) or time.monotonic() > deadline:
            break
        time.sleep(1.0)  # retry interval: the shared-tree negative cache, the brick's reconnect
    assert all((t.hit_chunks, t.checksums_match) == (4, True) for t in trips.values())


def test_a_node_killed_with_9_its_files_still_serve_and_its_leftovers_are_cleaned(
        nodes: Nodes) -> None:
    start_server(nodes["a"])
    start_server(nodes["b"])
    a = nodes.driver("a")
    sums = store(a, nodes["a"], 1)
    a.close()
    record = check_pid_file(nodes["a"].pid_file).record
    assert record is not None and record.node_id == "a"
    leftover = temp_name(next(iter(nodes["a"].cache_root.glob("*.kvp"))))
    leftover.write_bytes(b"x" * 4096)  # what a writer killed mid-store leaves
    os.utime(leftover, (time.time() - 3600, time.time() - 3600))
    assert root_lock_holder(nodes["a"].cache_root) is not None
    assert kill_server(nodes["a"]) == record.pid  # SIGKILL; returns once it has exited
    wait_until(lambda: root_lock_holder(nodes["a"].cache_root) is None, timeout=30,
               interval=0.2, message="the root lock did not die with its server")
    b = nodes.driver("b")
    trip = b.lookup_and_retrieve(1, sums)
    b.close()
    assert (trip.hit_chunks, trip.checksums_match) == (4, True)
    # From node b, a cleanup of a's part (dead, so its lock is free) removes the leftover.
    out = kvp_admin(nodes["a"], "cleanup", "--apply", "--active", MODEL.rsplit("/", 1)[1],
                    "--min-temp-age", "60", "--json")
    assert out["by_class"].get("temp", {}).get("files") == 1, out
    assert not leftover.exists()
    assert len(l2_files(nodes["a"].cache_root, (".kvp",))) == 4  # live files of a are kept


def test_kvp_admin_from_either_node_sees_the_tree_and_refuses_to_clean_a_live_part(
        nodes: Nodes) -> None:
    start_server(nodes["a"])
    start_server(nodes["b"])
    a = nodes.driver("a")
    store(a, nodes["a"], 1)
    a.close()
    from kvpersist.identity.records import RECORDS_DIR
    (nodes["a"].cache_root / RECORDS_DIR).mkdir(exist_ok=True)
    views = [kvp_admin(nodes[n], "tree", "--json") for n in "ab"]
    def without_paths(view: dict[str, Any]) -> list[dict[str, Any]]:
        return [{k: v for k, v in x.items() if k != "root"} for x in view["nodes"]]

    assert without_paths(views[0]) == without_paths(views[1])  # the same tree from a and b
    by_node = {x["node_id"]: x for x in views[0]["nodes"]}
    assert by_node["a"]["files"] == 4 and by_node["a"]["live"]
    assert by_node["a"]["holder"].startswith(f"{server_pid(nodes['a'])}@")
    # Node a's part, from node b's side: a live server b cannot reach holds it: refused.
    env = {"KVP_CACHE_ROOT": str(nodes["b"].tree), "KVP_NODE_ID": "a",
           "KVP_SHARED_NODES": "2", "KVP_RUNTIME_DIR": str(nodes["b"].socket_dir / "elsewhere")}
    proc = run_admin(env, "cleanup", "--apply", "--no-active", "--target-gb", "0")
    assert proc.returncode == 1 and "a live server this node cannot reach" in proc.stderr
    assert len(l2_files(nodes["a"].cache_root, (".kvp",))) == 4
    # The report of a's part works from b (read-only).
    report = json.loads(run_admin(env, "report", "--json").stdout)
    assert sum(r["files"] for r in report["namespaces"]) == 4


def run_admin(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvpersist.admin.cli", *args],
                          env={**os.environ, "KVP_L1_SIZE_GB": "1", **env},
                          capture_output=True, text=True, timeout=120)


def kvp_admin(s: ServerSettings, *args: str) -> Any:
    env = {"KVP_CACHE_ROOT": str(s.tree), "KVP_NODE_ID": str(s.node_id),
           "KVP_SHARED_NODES": str(s.shared_nodes), "KVP_RUNTIME_DIR": str(s.socket_dir),
           "KVP_CACHE_BUDGET_GB": repr(s.budget_gb)}
    proc = run_admin(env, *args)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_preflight_on_the_real_mount_reads_its_client_options(nodes: Nodes) -> None:
    from kvpersist.admin.preflight import filesystem_check

    check = filesystem_check(nodes["a"].tree, production=True, shared=True)
    # The test mounts set every FUSE timeout to 0 (glusterfs.COHERENT_MOUNT_OPTIONS).
    assert check.level == "ok", check.message
    assert "fuse.glusterfs" in check.message and "attribute-timeout=0" in check.message


def test_a_file_torn_or_replaced_through_one_mount_is_never_served_through_the_other(
        nodes: Nodes) -> None:
    """What a writer on node a could leave behind (a torn file, another key's file under this
    key's name) seen from node b's mount: misses, never wrong bytes."""
    start_server(nodes["a"])
    start_server(nodes["b"])
    a = nodes.driver("a")
    sums = store(a, nodes["a"], 1)
    a.close()
    files = sorted(nodes["a"].cache_root.glob("*.kvp"))
    first = files[0].read_bytes()
    with open(files[0], "r+b") as fh:  # torn in place: the header is there, half the payload
        fh.truncate(len(first) // 2)
    b = nodes.driver("b")
    trip = b.lookup_and_retrieve(1, sums)
    assert trip.checksums_match and trip.retrieved_ok, "wrong bytes were served"
    assert adapter_status(nodes["b"])["foreign_failures"] >= 1
    files[0].write_bytes(first)  # repaired in place by its owner
    os.replace(files[2], files[1])  # chunk 2's valid file under chunk 1's name
    clear_l1(nodes["b"])
    time.sleep(2.5)  # on purpose, not a condition: b's negative cache (2 s) for the misses
    trip = b.lookup_and_retrieve(1, sums)
    b.close()
    assert trip.checksums_match and trip.retrieved_ok, "wrong bytes were served"
    assert trip.hit_chunks <= 1  # chunk 0 only: chunk 1 fails its key check, chunk 2 is gone
