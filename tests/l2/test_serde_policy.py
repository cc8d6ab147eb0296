"""Lossless only: a lossy serde is refused before LMCache starts; AES-GCM (lossless) round-trips.

The refusal is shown on both doors: ``kvp-server`` (the resolved adapter config) and the server's
own entry point run by hand with a lossy ``--l2-adapter``.  The AES-GCM run is a real server,
restarted, with the payload on disk checked to be ciphertext and a wrong key giving a miss.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from kvpersist.config.adapters import LOSSLESS_SERDES, l2_adapter_config
from kvpersist.config.server import SettingsError, load_settings
from kvpersist.l2.files import verify_file
from kvpersist.l2.format import HEADER_SIZE, build_header, parse_header, payload_digest
from kvpersist.serving.server.lifecycle import (
    ServerError,
    server_command,
    server_environment,
    start_server,
    stop_server,
)
from kvpersist.testing.helpers import (
    clear_l1,
    l2_files,
    server_env,
    wait_for_l2_files,
    wait_until,
)
from kvpersist.testing.lmcache_bench import BenchDriver

MODEL = "org/serde-test/kvp-" + "e" * 32
LOSSY = [
    {"type": "fp8", "fp8_dtype": "float8_e4m3fn"},
    {"type": "turboquant"},
    {"type": "asym_k16_v8"},
    {"kind": "aesgcm"},  # no type: not known to be lossless
]


@pytest.mark.parametrize("serde", LOSSY, ids=lambda s: str(s.get("type", "untyped")))
def test_lossy_serde_refused_in_the_resolved_config(tmp_path: Path, serde: dict[str, str]) -> None:
    if "type" not in serde:
        with pytest.raises(SettingsError, match='must be a JSON object with a "type"'):
            load_settings(server_env(tmp_path / "c", KVP_L2_SERDE=json.dumps(serde)))
        return
    settings = load_settings(server_env(tmp_path / "c", KVP_L2_SERDE=json.dumps(serde)))
    with pytest.raises(SettingsError, match=f"serde '{serde['type']}' is refused.*Lossless "
                                            "serdes: kvp-aesgcm"):
        l2_adapter_config(settings)
    with pytest.raises(SettingsError):
        start_server(settings)
    assert not settings.pid_file.exists()


def test_bad_serde_setting_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"KVP_L2_SERDE=.* is not JSON"):
        load_settings(server_env(tmp_path, KVP_L2_SERDE="fp8"))


def test_lossless_serde_passes_through_bound_to_the_key(tmp_path: Path) -> None:
    """``aesgcm`` in kvpersist's settings is kvpersist's key-bound AES-GCM, never LMCache's."""
    for given in ("aesgcm", "kvp-aesgcm"):
        serde = {"type": given, "master_key_path": "/k"}
        settings = load_settings(server_env(tmp_path, KVP_L2_SERDE=json.dumps(serde)))
        assert l2_adapter_config(settings)["serde"] == {**serde, "type": "kvp-aesgcm"}
    assert LOSSLESS_SERDES == ("kvp-aesgcm",)


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["fp8", "aesgcm"])  # aesgcm by hand: LMCache's, key unbound
def test_entry_point_refuses_a_lossy_adapter_given_by_hand(tmp_path: Path, kind: str) -> None:
    settings = load_settings(server_env(tmp_path / "cache", KVP_ACCESS="tcp"))
    cmd = server_command(settings)
    adapter = json.loads(cmd[cmd.index("--l2-adapter") + 1])
    adapter["serde"] = {"type": kind}
    cmd[cmd.index("--l2-adapter") + 1] = json.dumps(adapter)
    done = subprocess.run(cmd, env=server_environment(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"serde '{kind}' is refused" in done.stderr
    assert not settings.cache_root.exists() or not list(settings.cache_root.glob("*.kvp"))


def _payloads(root: Path) -> dict[str, bytes]:
    return {name: (root / name).read_bytes()[HEADER_SIZE:] for name in l2_files(root)}


@pytest.mark.integration
def test_aes_gcm_round_trips_across_restart_and_a_wrong_key_is_a_miss(tmp_path: Path) -> None:
    key = tmp_path / "master.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    plain_root, secret_root = tmp_path / "plain", tmp_path / "secret"

    def settings_for(root: Path, key_path: Path | None):  # type: ignore[no-untyped-def]
        extra = {} if key_path is None else {
            "KVP_L2_SERDE": json.dumps({"type": "aesgcm", "master_key_path": str(key_path)})}
        return load_settings(server_env(root, **extra))

    # the same seeded KV, stored once in clear and once encrypted
    payloads = {}
    for root, key_path in ((plain_root, None), (secret_root, key)):
        s = settings_for(root, key_path)
        start_server(s)
        try:
            d = BenchDriver(s.request_url, s.http_url, MODEL)
            assert d.store(0)
            d.close()
            wait_for_l2_files(root, 4)
        finally:
            stop_server(s)
        payloads[root] = _payloads(root)
    assert payloads[plain_root].keys() == payloads[secret_root].keys()
    for name, clear in payloads[plain_root].items():
        secret = payloads[secret_root][name]
        assert len(secret) > len(clear) and clear[:4096] not in secret, name

    # restart with the key: every chunk back, byte-identical
    s = settings_for(secret_root, key)
    start_server(s)
    try:
        d = BenchDriver(s.request_url, s.http_url, MODEL)
        trip = d.lookup_and_retrieve(0, d.checksums(0))
        assert trip.hit_chunks == trip.total_chunks == 4
        assert trip.retrieved_ok and trip.checksums_match
        d.close()
    finally:
        stop_server(s)

    # another key: the files are there, but nothing wrong is ever served
    other = tmp_path / "other.key"
    other.write_bytes(os.urandom(32))
    other.chmod(0o600)
    s = settings_for(secret_root, other)
    start_server(s)
    try:
        clear_l1(s)
        d = BenchDriver(s.request_url, s.http_url, MODEL)
        sums = d.checksums(0)
        trip = d.lookup_and_retrieve(0, sums)
        assert trip.hit_chunks == 0, trip  # a failed decryption is a miss, never a hit
        d.close()
    finally:
        stop_server(s)
    assert _payloads(secret_root) == payloads[secret_root], "the encrypted files were touched"


def _reheadered(src: Path, dst: Path) -> None:
    """Give ``dst`` the payload of ``src`` under ``dst``'s own key, with a valid header and
    checksum: what a tampered disk or a careless peer on a shared tree can write."""
    dst_key = parse_header(dst.read_bytes()[:HEADER_SIZE]).key
    payload = src.read_bytes()[HEADER_SIZE:]
    dst.write_bytes(build_header(dst_key, len(payload), payload_digest(payload)) + payload)


@pytest.mark.integration
def test_a_ciphertext_renamed_to_another_key_is_a_miss_and_quarantined(tmp_path: Path) -> None:
    key = tmp_path / "master.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    root = tmp_path / "secret"
    s = load_settings(server_env(root, KVP_L2_SERDE=json.dumps(
        {"type": "aesgcm", "master_key_path": str(key)})))
    start_server(s)
    try:
        d = BenchDriver(s.request_url, s.http_url, MODEL)
        assert d.store(0)
        d.close()
        files = sorted(wait_for_l2_files(root, 4))
    finally:
        stop_server(s)
    victim, source = root / files[1], root / files[0]
    _reheadered(source, victim)
    assert verify_file(victim)[0] is None  # the file's own checks pass: only the key binding
    start_server(s)
    try:
        d = BenchDriver(s.request_url, s.http_url, MODEL)
        trip = d.lookup_and_retrieve(0, d.checksums(0))
        assert trip.hit_chunks < trip.total_chunks == 4, trip  # a miss from that chunk on
        assert trip.checksums_match  # and what was served is exactly what was stored
        wait_until(lambda: not victim.exists(), timeout=30)
        assert [p.name for p in (root / "quarantine").iterdir()
                if p.name.startswith(victim.name)], "the forged file was not quarantined"
        assert source.exists()
        d.close()
    finally:
        stop_server(s)


@pytest.mark.integration
def test_a_master_key_others_may_read_stops_the_server_naming_it(tmp_path: Path) -> None:
    key = tmp_path / "master.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o644)
    s = load_settings(server_env(tmp_path / "cache", KVP_L2_SERDE=json.dumps(
        {"type": "aesgcm", "master_key_path": str(key)})))
    with pytest.raises(ServerError):
        start_server(s)
    stop_server(s)
    log = s.log_file.read_text(errors="replace")
    assert f"master key {key} has mode 0644" in log and "chmod 600" in log
