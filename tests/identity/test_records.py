"""Identity records under the cache root, and kvp-admin reading them ("why no hits?" on disk)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvpersist.admin.cli import main
from kvpersist.config.client import ConnectorOptions
from kvpersist.identity import FIELDS, CacheIdentity, IdentityError, load_pins
from kvpersist.identity.records import RECORDS_DIR, list_records, read_record, write_record
from kvpersist.serving.connector.gate import record_identity
from kvpersist.testing.helpers import TINY_PINS, free_port


def identity(**changes: object) -> CacheIdentity:
    fields: dict[str, object] = {**load_pins(TINY_PINS), "build": "kvpersist-format=1;test",
                                 "weights_sha256": "e" * 64}
    fields.update(changes)
    return CacheIdentity.from_mapping(fields)


def test_write_read_and_list(tmp_path: Path) -> None:
    a, b = identity(), identity(max_model_len=1024)
    path = write_record(tmp_path, a)
    assert path == tmp_path / RECORDS_DIR / f"{a.namespace}.json"
    assert read_record(tmp_path, a.namespace) == a
    stamp = path.stat().st_mtime_ns
    os.utime(path, ns=(1, 1))
    write_record(tmp_path, a)  # same content: not rewritten
    assert path.stat().st_mtime_ns == 1 != stamp
    write_record(tmp_path, b)
    (tmp_path / RECORDS_DIR / "notes.txt").write_text("x")
    assert list_records(tmp_path) == {a.namespace: a, b.namespace: b}
    assert not [p for p in (tmp_path / RECORDS_DIR).iterdir() if p.name.startswith(".")]


def test_a_record_that_does_not_hash_to_its_name_is_never_used(tmp_path: Path) -> None:
    a = identity()
    path = write_record(tmp_path, a)
    data = json.loads(path.read_text())
    data["fields"]["block_size"] = 16  # edited by hand, or copied to the wrong name
    path.write_text(json.dumps(data))
    with pytest.raises(IdentityError, match="hash to"):
        read_record(tmp_path, a.namespace)
    assert isinstance(list_records(tmp_path)[a.namespace], str)
    path.write_text("{not json")
    with pytest.raises(IdentityError, match="cannot read"):
        read_record(tmp_path, a.namespace)
    with pytest.raises(IdentityError, match="no identity record"):
        read_record(tmp_path, "kvp-" + "0" * 32)
    with pytest.raises(IdentityError, match="32 hex"):
        read_record(tmp_path, "../../etc/passwd")


def options(root: Path | None) -> ConnectorOptions:
    extra = {} if root is None else {"kvpersist.cache_root": str(root)}
    return ConnectorOptions.from_extra_config(extra, environ={})


def test_the_connector_records_but_never_fails(tmp_path: Path) -> None:
    a = identity()
    assert record_identity(options(tmp_path), a) == tmp_path / RECORDS_DIR / f"{a.namespace}.json"
    assert record_identity(options(None), a) is None  # no root configured
    assert record_identity(options(tmp_path / "missing"), a) is None
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / RECORDS_DIR).write_text("a file where the folder should be")
    reason = record_identity(options(blocked), a)
    assert isinstance(reason, str) and "could not record the identity" in reason


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_kvp_admin_reads_records(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVP_CACHE_ROOT", str(tmp_path))
    monkeypatch.setenv("KVP_HTTP_PORT", str(free_port()))
    old, new = identity(), identity(tensor_parallel_size=2)
    write_record(tmp_path, old)
    code, out, _ = run(capsys, "identity", "show", old.namespace, "--json")
    assert code == 0 and json.loads(out)["fields"] == old.as_dict()
    code, out, _ = run(capsys, "identity", "show", old.namespace)
    assert code == 0 and "tensor_parallel_size" in out and old.namespace in out
    # What is on disk against a configuration: the one field that keeps them apart.
    pins = tmp_path / "new.env"
    pins.write_text("".join(f"{spec.env}={getattr(new, spec.name)}\n" for spec in FIELDS))
    code, out, _ = run(capsys, "identity", "diff", old.namespace, str(pins), "--json")
    assert code == 0
    assert json.loads(out)["differences"] == [{"field": "tensor_parallel_size", "a": 1, "b": "2"}]
    code, _, err = run(capsys, "identity", "show", new.namespace)
    assert code == 1 and "no identity record" in err
    code, _, err = run(capsys, "identity", "diff", new.namespace, str(pins))
    assert code == 1 and "no identity record" in err
    code, _, err = run(capsys, "identity", "server")
    assert code == 3 and "does not answer" in err
