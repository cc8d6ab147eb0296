"""The C and the Python inventory walkers agree on every tree, and the columnar cleanup plan equals
a straightforward per-file reference planner (the one kvp-admin used before it had to scale)."""

from __future__ import annotations

import gc
import itertools
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

from kvpersist.admin.retention import plan_cleanup
from kvpersist.l2 import inventory
from kvpersist.l2.inventory import CacheFile, Inventory, build_inventory, classify
from kvpersist.l2.layout import KeyFields, format_name, parse_name

NS = ["kvp-" + c * 32 for c in "0123"]
HASH = "ab" * 32


def rows(inv: Inventory) -> list[tuple[str, str, str, int, int, str]]:
    """Every row of an inventory, independent of the walk order."""
    return sorted((f.dir, f.name, f.cls, f.size, round(f.mtime * 1e9), f.model_name)
                  for f in inv.files)


def test_the_c_walker_is_built() -> None:
    # scripts/bootstrap.sh builds it; without it kvp-admin is ~3x slower on a million files.
    assert inventory._walk is not None, "kvpersist.l2._walk is missing: run scripts/bootstrap.sh"


TRICKY_NAMES = [
    f"org--m--{NS[0]}_00000000_0_{HASH}.kvp",  # live
    f"org--m--{NS[0]}_0000000A_F_{HASH.upper()}@salt.kvp",  # upper-case hex, salted: live
    f"org_with_underscores--{NS[1]}_00000001_1f_{HASH}.bin",  # nixl name, "_" in model: live
    "m_00000000_0_.kvp",  # empty hash: live
    f"m_00000000_0_{HASH}@.kvp",  # empty salt
    f"m_00000000_0_{HASH}@a@b.kvp",  # two "@"
    f"m_ 0000001_0_{HASH}.kvp",  # space in the rank (int() would take it)
    f"m_+0000001_0_{HASH}.kvp",  # sign in the rank
    f"m_00000000_0x1_{HASH}.kvp",  # 0x prefix in the group
    f"m_00000000__{HASH}.kvp",  # empty group
    f"m_00000000_0_{HASH}a.kvp",  # odd hash length
    f"m_00000000_0_{HASH[:10]} {HASH[10:]}.kvp",  # space in the hash (bytes.fromhex would take it)
    f"_00000000_0_{HASH}.kvp",  # empty model
    f"m_0000000_0_{HASH}.kvp",  # short rank
    f"m_00000000_0_{HASH}.kvp\n",  # trailing newline
    f"m_00000000_0_{HASH}\n.kvp",
    "m_00000000_0_zz.kvp",
    ".kvp",
    "x.bin",
    f"m_00000000_0_{HASH}.kvp.tmp.1a2b",  # temp leftover
    "weird.tmp.kvp",  # ends in .kvp, does not parse: unparsable, never a temp
    "lmcache-server.log",
    "quotas.json",
    f"ünïcode--{NS[2]}_00000000_0_{HASH}.kvp",
    os.fsdecode(b"bad-utf8-\xff\xfe_00000000_0_" + HASH.encode() + b".kvp"),
    f"m--{NS[0]}_00000001_{'f' * 20}_{HASH}@s.kvp",  # a group id beyond 64 bits: live
    f"m--{NS[0]}_00000000_0_{HASH}@team.tmp.a.kvp",  # ".tmp." in a salt: live (issue 35)
    f"m--{NS[0]}_00000000_0_{HASH}@team.tmp.a.kvp.tmp.0f1e2d3c4b5a",  # its temp: temp
]


@pytest.fixture
def tricky(tmp_path: Path) -> Path:
    root = tmp_path / "cache"
    for sub in ("", "ab/cd", "quarantine", "quarantine/deeper", "nested/quarantine"):
        d = root / sub
        d.mkdir(parents=True, exist_ok=True)
        for i, name in enumerate(TRICKY_NAMES):
            (d / name).write_bytes(b"x" * i)
            os.utime(d / name, ns=(0, 1_700_000_000_123_456_789 + i))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / TRICKY_NAMES[0]).write_bytes(b"secret")
    (root / "link-to-dir").symlink_to(outside)
    (root / "ab" / f"org--m--{NS[3]}_00000000_0_{HASH}.kvp").symlink_to(outside / TRICKY_NAMES[0])
    (root / "dangling.kvp").symlink_to(tmp_path / "nowhere")
    os.mkfifo(root / "fifo.kvp")
    return root


def test_walkers_agree_on_a_tricky_tree(tricky: Path) -> None:
    c = build_inventory(tricky, walker="c")
    py = build_inventory(tricky, walker="python")
    assert (c.walker, py.walker) == ("c", "python")
    assert rows(c) == rows(py)
    assert c.errors == py.errors == []
    assert c.by_class() == py.by_class()
    assert {k: (v.files, v.bytes, v.last_access, v.model_ids) for k, v in c.namespaces().items()} \
        == {k: (v.files, v.bytes, v.last_access, v.model_ids) for k, v in py.namespaces().items()}


def test_tricky_names_are_classified_as_the_format_says(tricky: Path) -> None:
    inv = build_inventory(tricky)
    top = {f.name: f for f in inv.files if f.dir == str(tricky)}
    live = {n for n, f in top.items() if f.cls == "live"}
    assert live == {TRICKY_NAMES[i] for i in (0, 1, 2, 3, 23, 24, 25, 26)}
    for name in live - {TRICKY_NAMES[2]}:  # every live .kvp name parses to a key
        assert format_name(parse_name(name)).lower() == name.lower()
    assert top[TRICKY_NAMES[2]].model_name == f"org_with_underscores/{NS[1]}"
    assert top[TRICKY_NAMES[0]].namespace == NS[0]
    assert {n for n, f in top.items() if f.cls == "temp"} == {TRICKY_NAMES[19], TRICKY_NAMES[27]}
    assert top["weird.tmp.kvp"].cls == "unparsable"
    assert {n for n, f in top.items() if f.cls == "foreign"} == {
        "lmcache-server.log", "quotas.json", "dangling.kvp", "fifo.kvp", "link-to-dir",
        TRICKY_NAMES[14]}
    assert top["dangling.kvp"].size == 0 and top["fifo.kvp"].size == 0
    for name in TRICKY_NAMES[4:19]:
        assert top[name].cls in ("unparsable", "temp", "foreign"), name
        assert top[name].cls == classify(name, False)[0]
    # Only the top-level quarantine/ is quarantine; a nested one is an ordinary directory.
    q = [f for f in inv.files if f.cls == "quarantine"]
    assert len(q) == 2 * len(TRICKY_NAMES)
    assert {f.dir for f in q} == {str(tricky / "quarantine"), str(tricky / "quarantine/deeper")}
    nested = {f.name: f.cls for f in inv.files if f.dir == str(tricky / "nested/quarantine")}
    assert nested[TRICKY_NAMES[0]] == "live"
    # Nothing behind a symlink is listed; the symlinks themselves are foreign.
    assert not any("outside" in f.dir or f.dir.endswith("link-to-dir") for f in inv.files)
    assert top["link-to-dir"].cls == "foreign"
    ab = {f.name: f for f in inv.files if f.dir == str(tricky / "ab")}
    assert ab[f"org--m--{NS[3]}_00000000_0_{HASH}.kvp"].cls == "foreign"
    assert NS[3] not in inv.namespaces()


_WALK_BOTH = """
import json, sys
from kvpersist.l2.inventory import build_inventory
out = {}
for walker in ("c", "python"):
    inv = build_inventory(sys.argv[1], walker=walker)
    out[walker] = {"errors": inv.errors, "rows": sorted([f.dir, f.name, f.cls] for f in inv.files)}
print(json.dumps(out))
"""


def test_keys_of_live_rows(tricky: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The C key parser and the Python one give the keys parse_name gives (.bin names too)."""
    inv = build_inventory(tricky)
    live = inv.of_class(inventory.LIVE)
    assert live.size == 3 * 8  # eight live names in each copy outside quarantine/
    fast = inv.keys(live)
    want = [parse_name(inv.name(int(r))[:-4] + ".kvp") for r in live]
    assert fast == want
    assert any(k.object_group_id == 2**80 - 1 for k in fast) and any(k.cache_salt for k in fast)
    monkeypatch.setattr(inventory, "_walk", None)
    assert inv.keys(live) == want
    assert inv.keys(live[:0]) == []


def test_index_of_live_rows(tricky: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The C index builder and the Python one give {parse_name key: size} in row order; a key
    given twice keeps its last size; ranks shared between keys are equal ints (the C builder
    reuses one object for a run of equal ranks)."""
    inv = build_inventory(tricky)
    live = inv.of_class(inventory.LIVE)
    sizes = inv.size[live]
    want = {parse_name(inv.name(int(r))[:-4] + ".kvp"): int(n) for r, n in zip(live, sizes, strict=True)}
    built = inventory.index_of_columns(inv.names, inv.name_end, inv.model_idx, inv.model_names,
                                       live, sizes, chunk=5)
    assert list(built.items()) == list(want.items())
    if inventory._walk is not None:  # C keys hold only atomic values: never traversed by gc
        assert built and not any(gc.is_tracked(k) for k in built)
        listed = inventory.keys_of_columns(inv.names, inv.name_end, inv.model_idx,
                                           inv.model_names, live)
        assert dict.fromkeys(listed) == dict.fromkeys(want)
        assert not any(gc.is_tracked(k) for k in listed)
    twice = inventory.index_of_columns(inv.names, inv.name_end, inv.model_idx, inv.model_names,
                                       live[[0, 1, 0]], sizes[[0, 1, 2]])
    assert list(twice.values()) == [int(sizes[2]), int(sizes[1])]
    with pytest.raises(ValueError, match="sizes"):
        inventory.index_of_columns(inv.names, inv.name_end, inv.model_idx, inv.model_names,
                                   live, sizes[:1])
    with pytest.raises(ValueError, match="not a live cache file"):
        inventory.index_of_columns(inv.names, inv.name_end, inv.model_idx, inv.model_names,
                                   inv.of_class(inventory.TEMP)[:1], sizes[:1])
    monkeypatch.setattr(inventory, "_walk", None)
    slow = inventory.index_of_columns(inv.names, inv.name_end, inv.model_idx, inv.model_names,
                                      live, sizes)
    assert list(slow.items()) == list(want.items())


def test_walkers_report_the_same_errors() -> None:
    """An unreadable directory is one error line and the walk goes on (root reads everything, so
    under root the walk runs without CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH, through setpriv)."""
    base = Path(tempfile.mkdtemp(prefix="kvp-walk-errors-"))
    try:
        os.chmod(base, 0o755)
        for sub in ("", "ab/cd", "ab/ef"):
            (base / sub).mkdir(parents=True, exist_ok=True)
            os.chmod(base / sub, 0o755)
            (base / sub / TRICKY_NAMES[0]).write_bytes(b"x")
        os.chmod(base / "ab" / "cd", 0)
        drop = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"] \
            if os.geteuid() == 0 else []
        res = subprocess.run([*drop, sys.executable, "-c", _WALK_BOTH, str(base)],
                             capture_output=True, text=True, check=True,
                             env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
        out = json.loads(res.stdout)
        assert out["c"] == out["python"]
        assert out["c"]["errors"] == [f"cannot read directory {base}/ab/cd: Permission denied"]
        assert [r[0] for r in out["c"]["rows"]] == [str(base), f"{base}/ab/ef"]
    finally:
        os.chmod(base / "ab" / "cd", 0o755)
        shutil.rmtree(base)


def test_walker_choice(tricky: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVP_WALKER", "python")
    assert build_inventory(tricky).walker == "python"
    with pytest.raises(inventory.InventoryError, match="unknown walker"):
        build_inventory(tricky, walker="rust")
    monkeypatch.setattr(inventory, "_walk", None)
    monkeypatch.delenv("KVP_WALKER")
    assert build_inventory(tricky).walker == "python"
    with pytest.raises(inventory.InventoryError, match="not built"):
        build_inventory(tricky, walker="c")


def test_thread_counts_and_progress(tmp_path: Path) -> None:
    """Large directories are stat'ed on several threads in batches (also mid-directory); the
    inventory is the same for any thread count and progress comes every 10,000 files."""
    for sub, count in (("", 20_001), ("ab", 40), ("ab/cd", 3_000)):
        (tmp_path / sub).mkdir(exist_ok=True)
        for i in range(count):
            name = format_name(KeyFields(f"o/{NS[i % 3]}", 0, 0, i.to_bytes(4, "big")))
            (tmp_path / sub / (name if i % 7 else f"other-{i}")).write_bytes(b"x" * (i % 5))
    want = rows(build_inventory(tmp_path, walker="python"))
    for threads in (1, 2, 5):
        seen: list[int] = []
        inv = build_inventory(tmp_path, walker="c", threads=threads, progress=seen.append)
        assert rows(inv) == want, threads
        assert seen == [10_000, 20_000]
    seen = []
    build_inventory(tmp_path, walker="python", progress=seen.append)
    assert seen == [10_000, 20_000]


# --------------------------------------------------------------------------- plans


def reference_plan(files: list[CacheFile], *, active: set[str], quotas: Mapping[str, int],
                   target: int | None, only: set[str] | None, include_unparsable: bool,
                   min_temp_age_s: float, now: float) -> list[tuple[str, str]]:
    """The retention ranking written the plain way: one object per file (retention.py's contract)."""
    def oldest_first(fs: Iterable[CacheFile]) -> list[CacheFile]:
        return sorted(fs, key=lambda f: (round(f.mtime * 1e9), f.dir, f.name))

    owned = ("live", "temp", "quarantine") + (("unparsable",) if include_unparsable else ())
    remaining = sum(f.size for f in files if f.cls in owned)
    out: list[tuple[CacheFile, str]] = []

    def take(fs: Iterable[CacheFile], reason: str) -> None:
        nonlocal remaining
        for f in fs:
            if target is not None and remaining <= target:
                return
            out.append((f, reason))
            remaining -= f.size

    if only is None:
        take(oldest_first(f for f in files if f.cls == "temp"
                          and now - round(f.mtime * 1e9) / 1e9 >= min_temp_age_s), "temp")
        take(oldest_first(f for f in files if f.cls == "quarantine"), "quarantine")
        if include_unparsable:
            take(oldest_first(f for f in files if f.cls == "unparsable"), "unparsable")
    by_ns: dict[str, list[CacheFile]] = {}
    for f in files:
        if f.cls == "live" and (only is None or f.namespace in only):
            by_ns.setdefault(f.namespace, []).append(f)
    for ns in sorted((n for n in by_ns if n not in active),
                     key=lambda n: (max(round(f.mtime * 1e9) for f in by_ns[n]), n)):
        take(oldest_first(by_ns[ns]), "inactive")
    chosen_all: set[tuple[str, str]] = set()
    for ns in sorted(n for n in by_ns if n in active and n in quotas):
        excess = sum(f.size for f in by_ns[ns]) - quotas[ns]
        chosen = []
        for f in oldest_first(by_ns[ns]):
            if excess <= 0:
                break
            chosen.append(f)
            excess -= f.size
        chosen_all |= {(f.dir, f.name) for f in chosen}
        take(chosen, "over-quota")
    if target is not None:
        take(oldest_first(f for n in by_ns if n in active for f in by_ns[n]
                          if (f.dir, f.name) not in chosen_all), "lru-active")
    return [(str(f.path), reason) for f, reason in out]


def random_tree(root: Path, seed: int) -> None:
    rnd = random.Random(seed)
    (root / "quarantine").mkdir(parents=True)
    for sub in ("00/01", "00/02", "ff/ee"):
        (root / sub).mkdir(parents=True)
    namespaces = [*NS, "no-namespace"]
    for i in range(rnd.randint(20, 120)):
        ns = rnd.choice(namespaces)
        model = f"org/m{rnd.randint(0, 1)}/{ns}" if ns != "no-namespace" else "org/plain"
        name = format_name(KeyFields(model, rnd.randint(0, 3), 0, i.to_bytes(4, "big")))
        kind = rnd.random()
        if kind < 0.08:
            name += f".tmp.{i:04x}"
        elif kind < 0.12:
            name = f"broken-{i}.kvp"
        elif kind < 0.15:
            name = f"operator-notes-{i}.txt"
        d = rnd.choice(["", "00/01", "00/02", "ff/ee"] + (["quarantine"] if kind > 0.95 else []))
        path = root / d / name
        path.write_bytes(b"\0" * rnd.choice([0, 1, 7, 64, 100, 4096]))
        mtime_ns = rnd.choice([1_000, 2_000, 3_000, 9_999]) * 1_000_000_000 + rnd.choice([0, 0, 1, 5])
        os.utime(path, ns=(mtime_ns, mtime_ns))


@pytest.mark.parametrize("seed", range(12))
def test_plans_equal_the_reference(tmp_path: Path, seed: int) -> None:
    random_tree(tmp_path / "cache", seed)
    inv = build_inventory(tmp_path / "cache")
    assert rows(inv) == rows(build_inventory(tmp_path / "cache", walker="python"))
    files = inv.files
    total = inv.cache_bytes
    rnd = random.Random(seed)
    cases = itertools.product(
        [set(), {NS[0]}, {NS[1], NS[2]}],                      # active
        [{}, {NS[0]: 50, NS[1]: 0, NS[2]: 10**9}],              # quotas
        [None, 0, total // 2, total - 1, total + 10],          # target
        [None, {NS[0], NS[3]}],                                 # only these namespaces
        [False, True],                                          # include unparsable
    )
    for active, quotas, target, only, unparsable in cases:
        now = 9_999 + rnd.choice([0, 200, 400])
        got = plan_cleanup(inv, active=active, quotas=quotas, target_bytes=target,
                           only_namespaces=only, include_unparsable=unparsable,
                           min_temp_age_s=300, now=now)
        want = reference_plan(files, active=active, quotas=quotas, target=target, only=only,
                              include_unparsable=unparsable, min_temp_age_s=300, now=now)
        case = (active, quotas, target, only, unparsable, now)
        assert [(str(i.file.path), i.reason) for i in got.items] == want, case
        assert got.planned_bytes == sum(i.file.size for i in got.items)
        assert sum(n for n, _ in got.bytes_by_reason().values()) == len(got)
        if target is not None and got.notes:
            assert got.end_bytes > target
