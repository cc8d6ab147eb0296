"""Every name a user or an operator chooses round-trips through the file name (issue 35): model
ids with ``--``, salts with ``.tmp.``, ``/`` or ``%``, long salts and long model names; an
earlier version's ambiguous names are migrated at start, counted, and said so.

Each store test ends on ``KvFileStore.check(deep=True)`` (tests/l2/conftest.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpersist.l2.files import verify_file
from kvpersist.l2.format import HEADER_SIZE
from kvpersist.l2.layout import (
    MAX_NAME_BYTES,
    QUARANTINE_DIR,
    FormatError,
    KeyFields,
    format_name,
    legacy_name,
    model_name_from_safe,
    needs_header,
    parse_name,
)
from kvpersist.l2.store import KvFileStore
from kvpersist.testing.checked_stores import open_checked_store

NS = "kvp-" + "c" * 32
#: Model ids and salts as users choose them; LMCache forbids "@" in both.
MODEL_IDS = st.text(st.characters(blacklist_characters="@\x00", blacklist_categories=("Cs",)),
                    min_size=1, max_size=140)
SALTS = st.text(st.characters(blacklist_characters="@\x00", blacklist_categories=("Cs",)),
                max_size=160)


def key(model_id: str, salt: str = "", i: int = 1) -> KeyFields:
    return KeyFields(f"{model_id}/{NS}", 0x01000100, 0, i.to_bytes(32, "big"), salt)


def payload(i: int, size: int = 4096) -> bytes:
    return bytes((i * 13 + j) % 251 for j in range(size))


ISSUE_35 = [  # the three chats of the issue, and their kin
    key("team--x/chat--v2"),
    key("team--x/chat--v2", "team.tmp.a"),
    key("team--x/chat--v2", "s" * 100),
    key("team--x/chat--v2", "u" * 120),
    key("a-/b"), key("a/-b"), key("a//b"), key("100%/model", "50%"),
    key("org/model", "path/like/salt"), key("org/" + "m" * 180, "t" * 150),
]


@given(MODEL_IDS, SALTS)
@settings(max_examples=300, deadline=None, derandomize=True)
def test_every_chosen_name_round_trips_or_is_spelled_out_by_the_header(model_id: str,
                                                                       salt: str) -> None:
    k = key(model_id, salt)
    name = format_name(k)
    assert len(name.encode("utf-8", "surrogateescape")) <= MAX_NAME_BYTES
    assert "/" not in name and "\x00" not in name and name.endswith(".kvp")
    if needs_header(name):
        with pytest.raises(FormatError, match="hashed-name"):
            parse_name(name)  # too long: hashed, never another key
    else:
        assert parse_name(name) == k
    # the namespace survives even a hashed model part
    model_part = name.split("_")[0] if "_" not in model_id else None
    if model_part is not None:
        assert model_name_from_safe(model_part).endswith("/" + NS)


def test_distinct_keys_never_share_a_file_name() -> None:
    names = {format_name(k): k for k in ISSUE_35}
    assert len(names) == len(ISSUE_35)
    assert format_name(key("a-/b")) != format_name(key("a/-b"))  # "a---b" in earlier versions


@pytest.mark.parametrize("k", ISSUE_35, ids=lambda k: format_name(k)[:40])
@pytest.mark.parametrize("snapshot", [False, True])
def test_each_name_survives_a_restart_with_and_without_a_snapshot(tmp_path: Path, k: KeyFields,
                                                                  snapshot: bool) -> None:
    root = tmp_path / "root"
    store = open_checked_store(root, scan_snapshot=snapshot)
    other = key("org/model", "", 2)
    assert store.put(k, payload(1)) == "stored" and store.put(other, payload(2)) == "stored"
    used = store.used_bytes
    store.close()
    again = open_checked_store(root, scan_snapshot=snapshot)
    assert again.used_bytes == used == 2 * (HEADER_SIZE + 4096)
    buf = bytearray(4096)
    assert again.read_into(k, buf) and bytes(buf) == payload(1)
    assert again.put(k, payload(1)) == "exists"  # counted once
    assert again.delete(k) == HEADER_SIZE + 4096 and not again.path_for(k).exists()
    assert again.read_into(other, buf)  # evicting one never touches another's file
    assert verify_file(again.path_for(other)) == (None, HEADER_SIZE + 4096)


def test_a_hashed_name_verifies_on_its_own(tmp_path: Path) -> None:
    k = key("team--x/chat--v2", "u" * 120)
    store = open_checked_store(tmp_path / "root")
    assert store.put(k, payload(3)) == "stored"
    assert verify_file(store.path_for(k)) == (None, HEADER_SIZE + 4096)  # as kvp-admin verify


def test_a_quarantined_file_of_the_longest_name_fits(tmp_path: Path) -> None:
    k = key("org/" + "m" * 180, "t" * 150)
    store = open_checked_store(tmp_path / "root")
    assert store.put(k, payload(4)) == "stored"
    path = store.path_for(k)
    with open(path, "r+b") as fh:
        fh.seek(HEADER_SIZE + 10)
        fh.write(b"\xff\xfe")
    assert not store.read_into(k, bytearray(4096))
    assert len(os.listdir(store.root / QUARANTINE_DIR)) == 1 and k not in store.index


def recorded(root: Path, model_id: str) -> str:
    """The namespace of a real identity of ``model_id``, recorded under ``root`` as the
    connector records it; its LMCache model name is ``<model_id>/<namespace>``."""
    from kvpersist.identity import CacheIdentity
    from kvpersist.identity.records import write_record

    identity = CacheIdentity.from_mapping({
        "model_id": model_id, "model_revision": "0" * 40, "tokenizer_id": model_id,
        "tokenizer_revision": "0" * 40, "kv_cache_dtype": "bfloat16", "block_size": 16,
        "num_kv_heads": 8, "head_size": 128, "num_layers": 32, "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1, "connector": "LMCacheMPConnector",
        "build": "kvpersist-format=1;lmcache=0.5.6;vllm=0.32.0", "max_model_len": 32768,
        "chat_template_sha256": "a" * 64, "model_dtype": "bfloat16", "quantization": "none",
        "model_config_sha256": "c" * 64, "weights_sha256": "e" * 64})
    root.mkdir(parents=True, exist_ok=True)
    write_record(root, identity)
    return identity.namespace


def test_an_earlier_versions_ambiguous_names_are_migrated_counted_and_read(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "root"
    ns = recorded(root, "team--x/chat--v2")
    # "team--x--chat--v2--<ns>" also reads as model "team/x/chat/v2": the record decides
    indistinct = KeyFields(f"team--x/chat--v2/{ns}", 0x01000100, 0, (4).to_bytes(32, "big"), "")
    ambiguous = [indistinct, key("a-/b", "", 6), key("org/m", "%41", 7), key("org/l", "w" * 110)]
    plain = key("org/model", "user-7", 8)  # an earlier version's unambiguous name: unchanged
    store = open_checked_store(root, scan_snapshot=False)
    for i, k in enumerate([*ambiguous, plain]):
        assert store.put(k, payload(i)) == "stored"
    store.close()
    for k in ambiguous:  # as an earlier version named them
        os.rename(root / format_name(k), root / legacy_name(k))
    assert legacy_name(plain) == format_name(plain)
    again = open_checked_store(root, scan_snapshot=False)
    assert again.status()["migrated_names"] == 4
    assert "4 file(s) of" in caplog.text and "earlier version's ambiguous names" in caplog.text
    for i, k in enumerate([*ambiguous, plain]):
        buf = bytearray(4096)
        assert again.read_into(k, buf) and bytes(buf) == payload(i), k
    assert again.used_bytes == 5 * (HEADER_SIZE + 4096)
    assert not [n for n in os.listdir(root) if n.endswith(".kvp") and n not in
                {format_name(k) for k in [*ambiguous, plain]}]


def test_a_migrated_name_already_stored_again_leaves_the_old_file_in_quarantine(
        tmp_path: Path) -> None:
    root = tmp_path / "root"
    k = KeyFields(f"team--x/chat--v2/{recorded(root, 'team--x/chat--v2')}", 0x01000100, 0,
                  (9).to_bytes(32, "big"), "")
    store = open_checked_store(root, scan_snapshot=False)
    assert store.put(k, payload(9)) == "stored"
    store.close()
    (root / legacy_name(k)).write_bytes((root / format_name(k)).read_bytes())  # both present
    again = open_checked_store(root, scan_snapshot=False)
    assert again.used_bytes == HEADER_SIZE + 4096  # counted once
    assert [n for n in os.listdir(root / QUARANTINE_DIR) if ".superseded." in n]
    assert not (root / legacy_name(k)).exists()


def test_a_reader_scan_leaves_an_earlier_versions_names_alone(tmp_path: Path) -> None:
    root = tmp_path / "root"
    k = key("a-/b", "", 10)
    store = open_checked_store(root, scan_snapshot=False)
    assert store.put(k, payload(10)) == "stored"
    store.close()
    os.rename(root / format_name(k), root / legacy_name(k))
    reader = KvFileStore(root, 10**9, scan_snapshot=False)
    reader.open(background_scan=False, remove_temps=False)  # kvp-admin verify --check
    try:
        assert (root / legacy_name(k)).exists() and k not in reader.index
    finally:
        reader.close()
    again = open_checked_store(root, scan_snapshot=False)  # the owner renames it
    assert k in again.index
