"""kvp-admin report / cleanup / quota / verify / metrics / preflight on generated trees,
bad inputs included.  (The integration test with a live server is in tests/integration.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvpersist.admin.cleanup import safe_to_delete
from kvpersist.admin.cli import main
from kvpersist.admin.preflight import filesystem_check, fs_type
from kvpersist.demo.stack import free_port
from kvpersist.l2.format import HEADER_SIZE
from kvpersist.l2.inventory import CacheFile
from kvpersist.l2.layout import KeyFields
from kvpersist.l2.store import KvFileStore

NS = ["kvp-" + c * 32 for c in "abc"]
PAYLOAD = 4096


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    store = KvFileStore(cache, 10**9)
    store.open(background_scan=False)
    for n, ns in enumerate(NS):
        for i in range(n + 1):  # NS[0]: 1 file, NS[1]: 2, NS[2]: 3
            key = KeyFields(f"org/m{n}/{ns}", 0x01000100, 0, bytes([n, i]) * 16)
            store.put(key, bytes([i]) * PAYLOAD)
            os.utime(store.path_for(key), (1000 * (n + 1) + i, 1000 * (n + 1) + i))
    store.close()
    old_tmp = cache / "org--x--y_01000100_0_ab.kvp.tmp.0001"
    old_tmp.write_bytes(b"t" * 10)
    os.utime(old_tmp, (10, 10))
    (cache / "org--x--y_01000100_0_cd.kvp.tmp.0002").write_bytes(b"t" * 10)  # being written
    (cache / "quarantine" / "bad.kvp.payload-checksum.1").write_bytes(b"q" * 20)
    (cache / "notes.kvp").write_text("not a cache name")
    (cache / "lmcache-server.log").write_text("log")
    outside = tmp_path / "precious.kvp"
    outside.write_bytes(b"keep me")
    (cache / "org--z--kvp-dddddddddddddddddddddddddddddddd_01000100_0_ee.kvp").symlink_to(outside)
    monkeypatch.setenv("KVP_CACHE_ROOT", str(cache))
    monkeypatch.setenv("KVP_HTTP_PORT", "9")  # nothing answers: the server is "down"
    monkeypatch.setenv("KVP_CACHE_BUDGET_GB", "1")
    monkeypatch.setenv("KVP_L1_SIZE_GB", "1")  # the default 64 GB is more than a test host has
    return cache


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


FILE = HEADER_SIZE + PAYLOAD


def test_report_matches_disk(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "report", "--json", "--active", NS[2])
    data = json.loads(out)
    assert code == 0
    rows = {r["namespace"]: r for r in data["namespaces"]}
    assert {ns: rows[ns]["files"] for ns in NS} == {NS[0]: 1, NS[1]: 2, NS[2]: 3}
    assert rows[NS[2]]["bytes"] == 3 * FILE and rows[NS[2]]["state"] == "active"
    assert rows[NS[0]]["state"] == "stale" and rows[NS[0]]["model_ids"] == ["org/m0"]
    assert data["classes"]["temp"] == {"files": 2, "bytes": 20}
    assert data["classes"]["quarantine"] == {"files": 1, "bytes": 20}
    assert data["classes"]["unparsable"]["files"] == 1
    assert data["cache_bytes"] == 6 * FILE + 40
    code, out, _ = run(capsys, "report")
    assert code == 0 and NS[1] in out and "stale" in out


def test_cleanup_dry_run_changes_nothing(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = sorted(p.name for p in root.rglob("*"))
    code, out, _ = run(capsys, "cleanup", "--active", NS[2])
    assert code == 0 and "dry run" in out
    code, explicit, _ = run(capsys, "cleanup", "--dry-run", "--active", NS[2])
    assert code == 0 and explicit == out
    assert sorted(p.name for p in root.rglob("*")) == before
    code, _, err = run(capsys, "cleanup", "--dry-run", "--apply", "--active", NS[2])
    assert code == 2 and "not allowed with" in err  # argparse's usage error, as an exit code
    assert sorted(p.name for p in root.rglob("*")) == before


def test_cleanup_apply_needs_to_know_active(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "cleanup", "--apply")
    assert code == 1 and "--active" in err


def test_cleanup_apply(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "cleanup", "--apply", "--active", NS[2], "--json")
    data = json.loads(out)
    assert code == 0
    assert data["by_class"]["temp"]["files"] == 1 and data["skipped_young_temp"] == 1
    assert data["by_class"]["inactive"]["files"] == 3
    remaining = {p.name for p in root.iterdir()}
    assert len([n for n in remaining if n.startswith(f"org--m2--{NS[2]}")]) == 3  # active kept
    assert not [n for n in remaining if NS[0] in n or NS[1] in n]
    assert "org--x--y_01000100_0_cd.kvp.tmp.0002" in remaining  # young temp kept
    assert {"notes.kvp", "lmcache-server.log"} <= remaining  # unparsable and foreign kept
    assert (tmp_path / "precious.kvp").read_bytes() == b"keep me"  # symlink target untouched
    assert not list((root / "quarantine").iterdir())


def test_cleanup_to_target_takes_lru_tail(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target_gb = (2 * FILE) / 1024**3
    code, out, _ = run(capsys, "cleanup", "--apply", "--active", NS[2], "--target-gb",
                       f"{target_gb:.12f}", "--json")
    data = json.loads(out)
    assert code == 0 and data["end_bytes"] <= 2 * FILE
    assert data["by_class"]["lru-active"]["files"] >= 1
    left = sorted(root.glob(f"org--m2--{NS[2]}*.kvp"), key=lambda p: p.stat().st_mtime)
    assert left and left[-1].stat().st_mtime == 3002  # the most recently used survives


def test_safe_to_delete_refuses_escapes(root: Path, tmp_path: Path) -> None:
    escape = CacheFile.at(root / ".." / "precious.kvp", "live", 7, 0.0)
    assert safe_to_delete(root, escape) == "outside the cache root"
    link = next(p for p in root.iterdir() if p.is_symlink())
    assert safe_to_delete(root, CacheFile.at(link, "live", 7, 0.0)) is not None
    # A directory on the way that is a symlink: out of the root, or back into it.
    real = next(p for p in root.glob("*.kvp") if not p.is_symlink())
    (root / "alias").symlink_to(root)
    (root / "away").symlink_to(tmp_path)
    (tmp_path / real.name).write_bytes(b"x")
    cache: dict[str, str | None] = {}
    for _ in range(2):  # the second round answers from the per-directory cache
        assert safe_to_delete(root, CacheFile.at(root / "alias" / real.name, "live", 7, 0.0),
                              cache) == "reached through a symlink"
        assert safe_to_delete(root, CacheFile.at(root / "away" / real.name, "live", 7, 0.0),
                              cache) == "outside the cache root"
        assert safe_to_delete(root, CacheFile.at(real, "live", 7, 0.0), cache) is None
    assert len(cache) == 3


def test_quota_commands(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, _ = run(capsys, "quota", "set", NS[2], f"{FILE / 1024**3:.12f}")
    assert code == 0
    code, out, _ = run(capsys, "quota", "check", "--json")
    assert code == 3 and NS[2] in json.loads(out)["over"]
    code, out, _ = run(capsys, "quota", "show")
    assert code == 0 and NS[2] in out
    code, out, _ = run(capsys, "quota", "show", "--json")
    assert code == 0 and json.loads(out)["quotas_gib"] == {NS[2]: pytest.approx(FILE / 1024**3)}
    code, _, err = run(capsys, "quota", "set", "kvp-nothex", "1")
    assert code == 1 and "is not a namespace" in err
    code, _, err = run(capsys, "quota", "set", NS[0], "-1")
    assert code == 1 and "non-negative" in err


def test_malformed_quotas_file_is_refused_and_kept(root: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    bad = root / "quotas.json"
    bad.write_text('{"quotas": {"kvp-abc": 1}, "extra": 2}')
    for argv in (("report",), ("metrics",), ("cleanup",), ("quota", "show")):
        code, _, err = run(capsys, *argv)
        assert code == 1 and "unknown key" in err, argv
    assert bad.read_text() == '{"quotas": {"kvp-abc": 1}, "extra": 2}'
    bad.unlink()
    code, _, err = run(capsys, "report", "--active", "kvp-nothex")
    assert code == 1 and "kvp-admin report: --active" in err and "not a namespace" in err


def test_verify_and_quarantine(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "verify", "--json")
    assert code == 0 and json.loads(out)["checked"] == 6
    victim = sorted(root.glob(f"*{NS[1]}*.kvp"))[0]
    raw = bytearray(victim.read_bytes())
    raw[-1] ^= 1
    victim.write_bytes(bytes(raw))
    code, out, _ = run(capsys, "verify", "--json")
    data = json.loads(out)
    assert code == 3 and data["failures"] == [{"path": str(victim), "reason": "payload-checksum"}]
    from kvpersist.l2.lock import take_root_lock

    held = take_root_lock(root)  # a live server holds the root: nothing moves behind its index
    try:
        code, out, err = run(capsys, "verify", "--quarantine")
    finally:
        os.close(held)
    assert code == 1 and "stop it to quarantine from here" in err and victim.exists()
    code, out, _ = run(capsys, "verify", "--quarantine", "--max-mb-per-s", "100")
    assert code == 0 and "1 quarantined" in out and not victim.exists()


def test_a_file_gone_before_its_scrub_is_counted_vanished_not_failed(root: Path) -> None:
    """A live server evicts or cleans up files while a scrub runs (CI's traffic run once saw 2
    "failures" that way): a file listed and then gone is counted ``vanished``; a damaged file
    among them still fails."""
    from kvpersist.admin.verify import verify_files
    from kvpersist.l2.inventory import build_inventory

    listed = [f for f in build_inventory(root).files if f.cls == "live"]
    assert len(listed) == 6
    gone, damaged = (Path(f.dir) / f.name for f in listed[:2])
    gone.unlink()  # evicted after the listing
    raw = bytearray(damaged.read_bytes())
    raw[-1] ^= 1
    damaged.write_bytes(bytes(raw))
    result = verify_files(root, listed, quarantine=False)
    assert (result.checked, result.vanished) == (5, 1)
    assert result.failures == [(str(damaged), "payload-checksum")]


def test_metrics(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "metrics", "--active", NS[2])
    assert code == 0
    assert f'kvpersist_namespace_bytes{{namespace="{NS[2]}",model_id="org/m2",state="active"}} ' \
           f"{3 * FILE}" in out
    assert "kvpersist_quarantine_files 1" in out and "# TYPE kvpersist_budget_share gauge" in out
    prom = tmp_path / "kvp.prom"
    assert run(capsys, "metrics", "--textfile", str(prom))[0] == 0
    assert "kvpersist_cache_bytes" in prom.read_text()


def test_missing_root(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVP_CACHE_ROOT", str(tmp_path / "nope"))
    for argv in (("report",), ("cleanup",), ("verify",)):
        code, _, err = run(capsys, *argv)
        assert code == 1 and "does not exist" in err


def test_preflight(root: Path, capsys: pytest.CaptureFixture[str],
                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVP_HTTP_PORT", str(free_port()))
    monkeypatch.setenv("KVP_ZMQ_PORT", str(free_port()))
    code, out, _ = run(capsys, "preflight", "--test", "--pins", "configs/tiny-llama/identity.env",
                       "--json")
    data = json.loads(out)
    assert code == 0, data
    assert {c["name"] for c in data["checks"]} >= {
        "device ceiling", "free space", "persist_enabled", "telemetry", "identity pins",
        "filesystem"}
    monkeypatch.setenv("KVP_CACHE_BUDGET_GB", "1000000000")
    code, out, _ = run(capsys, "preflight", "--test")
    assert code == 1 and "exceeds what the device" in out and "Lower KVP_CACHE_BUDGET_GB" in out


def test_an_l1_larger_than_available_memory_is_refused_by_preflight_and_start(
        root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpersist.config.server import load_settings
    from kvpersist.serving.server.host_memory import mem_available_bytes
    from kvpersist.serving.server.lifecycle import ServerError, start_server

    available = mem_available_bytes()
    assert available is not None and available > 0
    monkeypatch.setenv("KVP_L1_SIZE_GB", str(2 * available // 2**30 + 1))
    code, out, _ = run(capsys, "preflight", "--test", "--json")
    found = {c["name"]: c for c in json.loads(out)["checks"]}
    assert code == 1 and found["L1 memory"]["level"] == "error"
    assert "MemAvailable" in found["L1 memory"]["message"]
    (root / "lmcache-server.log").chmod(0o600)
    with pytest.raises(ServerError, match="Lower KVP_L1_SIZE_GB"):
        start_server(load_settings())
    monkeypatch.setenv("KVP_L1_SIZE_GB", "0.5")
    _, out, _ = run(capsys, "preflight", "--test", "--json")
    assert {c["name"]: c for c in json.loads(out)["checks"]}["L1 memory"]["level"] == "ok"


def test_preflight_reports_the_access_mode(root: Path, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    def checks() -> dict[str, dict[str, str]]:
        _, out, _ = run(capsys, "preflight", "--test", "--json")
        return {c["name"]: c for c in json.loads(out)["checks"]}

    found = checks()
    assert found["access"]["level"] == "ok" and "unix sockets" in found["access"]["message"]
    assert found["runtime dir"]["level"] == "ok"
    monkeypatch.setenv("KVP_ACCESS", "tcp")
    monkeypatch.setenv("KVP_ZMQ_PORT", str(free_port()))
    found = checks()
    assert found["access"]["level"] == "warn"
    assert "without access control" in found["access"]["message"]
    assert "port KVP_ZMQ_PORT" in found and "runtime dir" not in found
    monkeypatch.delenv("KVP_ACCESS")
    root.chmod(0o755)
    found = checks()
    assert found["cache root"]["level"] == "error" and "chmod 0700" in found["cache root"]["message"]


def test_filesystem_detection(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text(
        "/dev/vda / ext4 rw 0 0\n"
        "srv:/export /mnt/nfs nfs4 rw 0 0\n"
        "10.0.0.1/default /mnt/weka wekafs rw 0 0\n"
        "tmpfs /mnt/weka/tmp tmpfs rw 0 0\n")
    assert fs_type(Path("/mnt/nfs/cache"), str(mounts)) == ("nfs4", "/mnt/nfs")
    assert fs_type(Path("/mnt/weka/cache"), str(mounts)) == ("wekafs", "/mnt/weka")
    assert fs_type(Path("/mnt/weka/tmp/x"), str(mounts)) == ("tmpfs", "/mnt/weka/tmp")
    assert fs_type(Path("/srv"), str(mounts)) == ("ext4", "/")
    nfs = filesystem_check(Path("/mnt/nfs/cache"), production=True, mounts=str(mounts))
    assert nfs.level == "warn" and "KVP_NODE_ID" in nfs.message and "acregmax=60s" in nfs.message
    weka = filesystem_check(Path("/mnt/weka/cache"), production=True, mounts=str(mounts))
    assert "GDS" in weka.message and "--gpu-memory-utilization" in weka.message
    tmp = filesystem_check(Path("/mnt/weka/tmp/x"), production=True, mounts=str(mounts))
    assert tmp.level == "warn"
    assert filesystem_check(Path("/mnt/weka/tmp/x"), production=False, mounts=str(mounts)).level == "ok"


SHARED_MOUNTS = (
    "/dev/vda / ext4 rw 0 0\n"
    "127.0.0.2:/kv /mnt/gl fuse.glusterfs rw,relatime,user_id=0,allow_other 0 0\n"
    "srv:/export /mnt/nfs nfs4 rw,vers=4.2,acregmin=3,acregmax=60,lookupcache=all 0 0\n"
    "srv:/export /mnt/nfs-noac nfs4 rw,noac 0 0\n"
    "10.0.0.1@tcp:/fs /mnt/lustre lustre rw,flock 0 0\n"
    "10.0.0.1@tcp:/fs /mnt/lustre-local lustre rw,localflock 0 0\n"
    "10.0.0.1/default /mnt/weka wekafs rw 0 0\n"
    "10.0.0.1:6789:/ /mnt/ceph ceph rw,name=admin 0 0\n"
    "gpfs0 /gpfs/fs0 gpfs rw 0 0\n")


@pytest.mark.parametrize(("where", "level", "words"), [
    ("/mnt/gl/tree", "warn", "attribute-timeout=1"),  # glusterfs defaults: 1 s late
    ("/mnt/nfs/tree", "warn", "acregmax=60s"),
    ("/mnt/nfs-noac/tree", "ok", "no attribute caching"),
    ("/mnt/lustre/tree", "ok", "flock enabled"),
    ("/mnt/lustre-local/tree", "error", "remount with -o flock"),
    ("/mnt/weka/tree", "warn", "GDS profile"),
    ("/mnt/ceph/tree", "ok", "capabilities"),
    ("/gpfs/fs0/tree", "ok", "token locks"),
])
def test_preflight_knows_shared_file_systems(tmp_path: Path, where: str, level: str,
                                             words: str) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text(SHARED_MOUNTS)
    check = filesystem_check(Path(where), production=True, mounts=str(mounts), shared=True,
                             proc=tmp_path / "no-proc")
    assert (check.level, words in check.message) == (level, True), check.message
    assert "shared by nodes" in check.message
    alone = filesystem_check(Path(where), production=True, mounts=str(mounts), shared=False,
                             proc=tmp_path / "no-proc")
    assert alone.level in ("warn", "error") and "KVP_NODE_ID" in alone.message


def test_preflight_reads_the_glusterfs_clients_timeouts(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text(SHARED_MOUNTS)
    client = tmp_path / "proc" / "4242"
    client.mkdir(parents=True)
    (client / "cmdline").write_bytes(b"\0".join([
        b"/usr/sbin/glusterfs", b"--attribute-timeout=0", b"--entry-timeout=0",
        b"--negative-timeout=0", b"--volfile-server=127.0.0.2", b"--volfile-id=/kv",
        b"/mnt/gl"]) + b"\0")
    check = filesystem_check(Path("/mnt/gl/tree"), production=True, mounts=str(mounts),
                             shared=True, proc=tmp_path / "proc")
    assert check.level == "ok" and "seen at once" in check.message


def test_verify_check_is_the_store_oracle(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``verify --check`` reports what a crash left (temp files) without removing anything, and
    finds nothing on a clean root."""
    before = sorted(p.name for p in root.rglob("*"))
    code, out, _ = run(capsys, "verify", "--check", "--json")
    problems = json.loads(out)["problems"]
    assert code == 3
    assert sorted(problems) == sorted(f"temp file left: {p}" for p in root.glob("*.tmp.*"))
    assert len(problems) == 2
    assert sorted(p.name for p in root.rglob("*")) == before  # nothing was removed
    for leftover in root.glob("*.tmp.*"):
        leftover.unlink()
    code, out, _ = run(capsys, "verify", "--check")
    assert code == 0 and "checked 6 files" in out and "consistent" in out
    store = KvFileStore(root, 10**9)
    store.open(background_scan=False)  # a server holds the root: --check refuses
    try:
        code, _, err = run(capsys, "verify", "--check")
        assert code == 1 and "one writer per root" in err
    finally:
        store.close()


TP0, TP1 = 0x02000200, 0x02010201  # LMCache's kv_rank of TP rank 0 and 1 of 2


def test_report_and_verify_show_files_per_rank_and_a_missing_rank_makes_a_namespace_incomplete(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A TP=2 namespace holds two shards of every chunk.  Rank 1's file of one chunk is gone:
    that chunk can never hit, and the report says so, by rank."""
    cache = tmp_path / "cache"
    store = KvFileStore(cache, 10**9)
    store.open(background_scan=False)
    full, part = "kvp-" + "e" * 32, "kvp-" + "f" * 32
    for ns in (full, part):
        for i in range(3):
            for rank in (TP0, TP1):
                if ns == part and i == 1 and rank == TP1:
                    continue
                store.put(KeyFields(f"org/m/{ns}", rank, 0, bytes([i]) * 32), b"x" * PAYLOAD)
    store.close()
    monkeypatch.setenv("KVP_CACHE_ROOT", str(cache))
    monkeypatch.setenv("KVP_HTTP_PORT", "9")
    code, out, _ = run(capsys, "report", "--json", "--active", full)
    rows = {r["namespace"]: r for r in json.loads(out)["namespaces"]}
    assert code == 0
    assert rows[full]["ranks"] == {"files_per_rank": {"0/2": 3, "1/2": 3}, "chunks": 3,
                                   "incomplete_chunks": 0, "missing_per_rank": {},
                                   "complete": True}
    assert rows[part]["ranks"]["files_per_rank"] == {"0/2": 3, "1/2": 2}
    assert rows[part]["ranks"]["missing_per_rank"] == {"1/2": 1}
    assert rows[part]["ranks"]["complete"] is False
    code, out, err = run(capsys, "report", "--active", full)
    assert code == 0 and "0/2:3 1/2:2 INCOMPLETE" in out
    assert f"namespace {part} is incomplete: 1 of 3 chunks lack a rank's file" in err
    code, out, _ = run(capsys, "verify", "--json")
    assert code == 0
    assert json.loads(out)["per_rank"] == {"0/2": {"checked": 6, "failed": 0},
                                           "1/2": {"checked": 5, "failed": 0}}
    code, out, _ = run(capsys, "verify")
    assert "0/2 6 checked, 0 failed, 1/2 5 checked, 0 failed" in out


def test_report_names_the_lora_adapters_of_each_namespace(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvpersist.identity.adapter_records import record_adapter
    from kvpersist.serving.connector.request_keys import request_salt

    digest = "5" * 64
    store = KvFileStore(root, 10**9)
    store.open(background_scan=False)
    for i, salt in enumerate([request_salt("", digest), request_salt("team", digest),
                              request_salt("", "6" * 64)]):
        store.put(KeyFields(f"org/m0/{NS[0]}", 0x01000100, 0, bytes([9, i]) * 16, salt),
                  b"x" * PAYLOAD)
    store.close()
    record_adapter(root, digest, "support-bot", "/srv/lora/support")
    record_adapter(root, digest, "support-bot-v1", "/srv/lora/support")  # same content
    code, out, _ = run(capsys, "report", "--json")
    rows = {r["namespace"]: r for r in json.loads(out)["namespaces"]}
    assert code == 0
    assert rows[NS[0]]["lora_adapters"] == {
        "5" * 12: {"names": ["support-bot", "support-bot-v1"], "files": 2, "bytes": 2 * FILE},
        "6" * 12: {"names": [], "files": 1, "bytes": FILE}}
    assert rows[NS[1]]["lora_adapters"] == {}
    code, out, _ = run(capsys, "report")
    assert f"LoRA adapter {'5' * 12} (support-bot, support-bot-v1): 2 files" in out
