"""kvp-admin compat: the source-only compatibility check agrees with the run-time code on the
installed (tested) vLLM and LMCache, and reports what a changed tree would switch off.

The changed trees are copies of the few files each check needs, edited in tmp_path; nothing
here builds or reads a full wheel (a small one is made from the copied files)."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from kvpersist.admin import compat
from kvpersist.admin.cli import main
from kvpersist.identity.engine_fields import ADDED_AFTER_TESTED
from kvpersist.serving.lmcache_compat import pins

VLLM_SITE = compat.installed_location("vllm")
LMCACHE_SITE = compat.installed_location("lmcache")
KVPERSIST = compat.KVPERSIST_ROOT
BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"


# -- copying the few files a check needs -------------------------------------------------------

def module_files(root: Path, dotted: str) -> list[str]:
    """The files of module ``dotted`` under ``root`` and the ``__init__.py`` of its parents."""
    parts = dotted.split(".")
    out = [f"{'/'.join(parts[:i])}/__init__.py" for i in range(1, len(parts))]
    rel = "/".join(parts)
    if (root / f"{rel}.py").is_file():
        out.append(f"{rel}.py")
    elif (root / rel / "__init__.py").is_file():
        out.append(f"{rel}/__init__.py")
    else:  # a compiled extension: its name is enough
        out.extend(p.relative_to(root).as_posix() for p in (root / rel).parent.glob(
            f"{parts[-1]}.*.so"))
    return [f for f in out if (root / f).is_file()]


def copy_files(src: Path, dst: Path, rels: Iterable[str]) -> Path:
    for rel in set(rels):
        target = dst / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if rel.endswith(".so"):
            target.touch()
        else:
            shutil.copyfile(src / rel, target)
    return dst


def kvpersist_lmcache_modules() -> set[str]:
    """Every lmcache module kvpersist's own code imports (and names that are submodules)."""
    out: set[str] = set()
    for path in KVPERSIST.rglob("*.py"):
        if "testing" in path.relative_to(KVPERSIST).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lmcache"):
                out.add(node.module or "")
                out.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names if a.name.startswith("lmcache"))
    return out


def lmcache_copy(dst: Path) -> Path:
    """The pinned modules, kvpersist's LMCache imports and LMCache's vLLM integration."""
    modules = {m for f in pins.FEATURES.values() for m, _, _ in f.sources}
    modules |= kvpersist_lmcache_modules()
    rels = [f for m in sorted(modules) for f in module_files(LMCACHE_SITE, m)]
    rels += [p.relative_to(LMCACHE_SITE).as_posix() for p in
             (LMCACHE_SITE / "lmcache/integration/vllm").rglob("*.py")]
    return copy_files(LMCACHE_SITE, dst, rels)


#: vLLM modules kvpersist reads the engine's resolution from (the block size vLLM's platform
#: runs, whether a model is MLA), copied with the config package.
RESOLUTION_MODULES = ("vllm.platforms.cpu", "vllm.platforms.interface",
                      "vllm.transformers_utils.model_arch_config_convertor")


def vllm_copy(dst: Path) -> Path:
    """vLLM's config package, its connector base class and :data:`RESOLUTION_MODULES`."""
    rels = [p.relative_to(VLLM_SITE).as_posix() for p in (VLLM_SITE / "vllm/config").glob("*.py")]
    rels += ["vllm/__init__.py", *module_files(VLLM_SITE, BASE.removesuffix(".py").replace(
        "/", "."))]
    for module in RESOLUTION_MODULES:
        rels += module_files(VLLM_SITE, module)
    return copy_files(VLLM_SITE, dst, rels)


def find_def(tree: ast.Module, qualname: str) -> ast.FunctionDef | ast.ClassDef:
    node: Any = tree
    for part in qualname.split("."):
        node = next(n for n in node.body if isinstance(n, ast.FunctionDef | ast.ClassDef)
                    and n.name == part)
    assert isinstance(node, ast.FunctionDef | ast.ClassDef)
    return node


def edit_function(path: Path, qualname: str, statement: str = "pass  # edited") -> None:
    """Append one statement to the body of ``qualname`` in ``path``."""
    text = path.read_text(encoding="utf-8")
    node = find_def(ast.parse(text), qualname)
    lines = text.splitlines(keepends=True)
    indent = " " * node.body[-1].col_offset if isinstance(node, ast.FunctionDef) else ""
    assert node.end_lineno is not None
    lines.insert(node.end_lineno, f"{indent}{statement}\n")
    path.write_text("".join(lines), encoding="utf-8")


def add_to_class(path: Path, cls: str, text: str) -> None:
    source = path.read_text(encoding="utf-8")
    node = find_def(ast.parse(source), cls)
    lines = source.splitlines(keepends=True)
    assert node.end_lineno is not None
    lines.insert(node.end_lineno, text)
    path.write_text("".join(lines), encoding="utf-8")


def remove_field(path: Path, cls: str, name: str) -> None:
    source = path.read_text(encoding="utf-8")
    node = find_def(ast.parse(source), cls)
    stmt = next(s for s in node.body if isinstance(s, ast.AnnAssign)
                and isinstance(s.target, ast.Name) and s.target.id == name)
    lines = source.splitlines(keepends=True)
    assert stmt.end_lineno is not None
    del lines[stmt.lineno - 1: stmt.end_lineno]
    path.write_text("".join(lines), encoding="utf-8")


# -- the installed (tested) versions ---------------------------------------------------------

@pytest.fixture(scope="module")
def installed() -> compat.CompatReport:
    return compat.check()


def test_installed_versions_all_match(installed: compat.CompatReport) -> None:
    assert installed.vllm.version == pins.TESTED_VERSIONS["vllm"]
    assert installed.lmcache.version == pins.TESTED_VERSIONS["lmcache"]
    assert [f.name for f in installed.features if not f.on] == []
    assert installed.engine_fields.unknown == installed.engine_fields.stale == ()
    assert installed.engine_fields.count > 400
    assert [f for f in installed.api if f.severity != "info"] == []
    assert installed.gate_reasons == ()
    assert installed.exit_code == 0


def test_every_pin_digest_from_the_files_is_the_pinned_one() -> None:
    trees = compat.trees_for()
    found = {(m, q): compat.pin_digest(trees, m, q)
             for f in pins.FEATURES.values() for m, q, _ in f.sources}
    assert found == {(m, q): d for f in pins.FEATURES.values() for m, q, d in f.sources}


def test_engine_fields_from_the_files_equal_the_run_time_list() -> None:
    from kvpersist.serving.lmcache_compat.engine_config import engine_field_names

    names, unresolved = compat.engine_field_names_from_source(compat.trees_for())
    assert unresolved == []
    assert names == list(engine_field_names())


def _runtime_surface() -> dict[str, dict[str, tuple[str, bool, tuple[str, ...]]]]:
    from vllm.distributed.kv_transfer.kv_connector.v1 import base

    out: dict[str, dict[str, tuple[str, bool, tuple[str, ...]]]] = {}
    for cls in (base.KVConnectorBase_V1, base.SupportsHMA):
        methods = {}
        for name, member in vars(cls).items():
            if name.startswith("_") and name != "__init__":
                continue
            if isinstance(member, property):
                kind, function = "property", member.fget
            elif isinstance(member, classmethod | staticmethod):
                kind, function = type(member).__name__, member.__func__
            elif inspect.isfunction(member):
                kind, function = "method", member
            else:
                continue
            params: list[str] = []
            starred = False
            for p in inspect.signature(function, follow_wrapped=False).parameters.values():
                if p.kind is p.VAR_POSITIONAL:
                    params.append(f"*{p.name}")
                    starred = True
                elif p.kind is p.VAR_KEYWORD:
                    params.append(f"**{p.name}")
                else:
                    if p.kind is p.KEYWORD_ONLY and not starred:
                        params.append("*")
                        starred = True
                    params.append(p.name)
            methods[name] = (kind, bool(getattr(function, "__isabstractmethod__", False)),
                             tuple(params))
        out[cls.__name__] = dict(sorted(methods.items()))
        assert {n for n, m in methods.items() if m[1]} == set(cls.__abstractmethods__)
    return out


def test_recorded_connector_surface_is_the_installed_one() -> None:
    assert compat.connector_surface(compat.trees_for()) == compat.TESTED_CONNECTOR_SURFACE
    assert _runtime_surface() == compat.TESTED_CONNECTOR_SURFACE


PROBE = '''\
import functools


def deco(f):
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        return f(*args, **kwargs)
    return wrapper


def factory(*_args):
    return deco


def bare(f):
    def inner(*args, **kwargs):
        return f(*args, **kwargs)
    return inner


@deco
def top(x):
    return x  # a trailing comment


@factory(
    1,
    2,
)
def multi(x):
    """Decorated over several lines."""
    return x


class Outer:
    @staticmethod
    @bare
    def helper(a, b):
        return a + b

    @classmethod
    def make(cls):
        return cls()

    def method(self, y):
        if y:
            return 1
        # a comment inside the block
        return 2
    # a comment after the block

    class Inner:
        async def run(self):
            return None


def last(): return 3
'''


def test_function_source_is_what_inspect_gives(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "kvp_compat_probe"
    package.mkdir()
    (package / "__init__.py").write_text(PROBE, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("kvp_compat_probe", package / "__init__.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "kvp_compat_probe", module)
    spec.loader.exec_module(module)
    trees = compat.SourceTrees(compat.SourceTree("kvp_compat_probe", tmp_path))
    for qualname in ("top", "multi", "Outer.helper", "Outer.make", "Outer.method",
                     "Outer.Inner.run", "last", "deco"):
        assert compat.pin_digest(trees, "kvp_compat_probe", qualname) == pins.source_digest(
            "kvp_compat_probe", qualname), qualname
    assert compat.pin_digest(trees, "kvp_compat_probe", "Outer.gone") == "missing"


# -- a changed LMCache ----------------------------------------------------------------------------

def lmcache_with_edit(root: Path, module: str, qualname: str) -> compat.CompatReport:
    lmcache_copy(root)
    edit_function(root / f"{module.replace('.', '/')}.py", qualname)
    return compat.check(lmcache=root)


def test_a_changed_exactness_pin_turns_its_feature_off_and_closes_the_gate(
        tmp_path: Path) -> None:
    report = lmcache_with_edit(tmp_path, "lmcache.integration.vllm.vllm_multi_process_adapter",
                               "LMCacheMPWorkerAdapter.get_finished")
    off = {f.name: f for f in report.features if not f.on}
    # both fences wrap get_finished: the load fence's late writes, the store fence's
    # finished-request rule
    assert list(off) == ["load_fence", "store_fence"]
    for name in off:
        changed = off[name].changed
        assert [c.qualname for c in changed] == ["LMCacheMPWorkerAdapter.get_finished"]
        assert changed[0].found not in ("missing", changed[0].pinned)
    assert report.gate_closes and "load_fence" in report.gate_reasons[0]
    assert any("store_fence" in reason for reason in report.gate_reasons)
    assert report.exit_code == 2
    assert report.breaking == ()  # the copy holds everything kvpersist imports


def test_a_changed_optional_pin_turns_its_feature_off_but_the_gate_stays_open(
        tmp_path: Path) -> None:
    report = lmcache_with_edit(tmp_path, "lmcache.v1.multiprocess.transfer_context.pickle",
                               "EngineDrivenContextPickle.prepare_store")
    assert report.features_off == ("pickle_waits",)
    assert not report.gate_closes
    assert report.exit_code == 1


# -- a changed vLLM -------------------------------------------------------------------------------

def add_parameter(path: Path, qualname: str, text: str) -> None:
    """Add ``text`` (", name: type = default") after the last positional parameter."""
    source = path.read_text(encoding="utf-8")
    node = find_def(ast.parse(source), qualname)
    assert isinstance(node, ast.FunctionDef)
    last = node.args.args[-1]
    assert last.end_lineno is not None and last.end_col_offset is not None
    lines = source.splitlines(keepends=True)
    row = lines[last.end_lineno - 1]
    lines[last.end_lineno - 1] = row[:last.end_col_offset] + text + row[last.end_col_offset:]
    path.write_text("".join(lines), encoding="utf-8")


def remove_def(path: Path, qualname: str) -> None:
    source = path.read_text(encoding="utf-8")
    node = find_def(ast.parse(source), qualname)
    assert node.end_lineno is not None
    lines = source.splitlines(keepends=True)
    del lines[node.lineno - 1: node.end_lineno]
    path.write_text("".join(lines), encoding="utf-8")


@pytest.fixture(scope="module")
def changed_vllm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, compat.CompatReport]:
    """A copy of vLLM's config package and connector base class, changed: a new cache setting,
    a field gone, a parameter added, methods added and removed, a class kvpersist imports
    renamed."""
    root = vllm_copy(tmp_path_factory.mktemp("vllm"))
    add_to_class(root / "vllm/config/cache.py", "CacheConfig",
                 '    kvp_test_knob: int = 0\n    """A new setting."""\n')
    remove_field(root / "vllm/config/kv_events.py", "KVEventsConfig", "topic")
    base = root / BASE
    add_parameter(base, "KVConnectorBase_V1.get_num_new_matched_tokens", ", kvp_extra: int = 0")
    add_to_class(base, "KVConnectorBase_V1",
                 "\n    @abstractmethod\n    def kvp_new_duty(self, request) -> None:\n"
                 "        raise NotImplementedError\n"
                 "\n    def kvp_new_hook(self) -> None:\n        return None\n"
                 "\n    @classmethod\n    def kvp_new_class_hook(cls) -> bool:\n"
                 "        return False\n")
    remove_def(base, "KVConnectorBase_V1.set_xfer_handshake_metadata")
    base.write_text(base.read_text(encoding="utf-8").replace(
        "class KVConnectorHandshakeMetadata(", "class KVConnectorHandshakeMetadataV2("),
        encoding="utf-8")
    return root, compat.check(vllm=root)


def test_a_new_sub_config_field_is_unknown_and_closes_the_gate(
        changed_vllm: tuple[Path, compat.CompatReport]) -> None:
    _, report = changed_vllm
    assert report.engine_fields.unknown == ("cache_config.kvp_test_knob",)
    assert report.engine_fields.stale == ("kv_events_config.topic",)
    assert any("cache_config.kvp_test_knob" in r for r in report.gate_reasons)
    assert report.exit_code == 2
    assert [f.name for f in report.features if not f.on] == []


def test_base_class_changes_are_reported(changed_vllm: tuple[Path, compat.CompatReport]) -> None:
    _, report = changed_vllm
    surface = {(f.kind, f.name): f for f in report.api if f.kind != "import"}
    changed = surface["params-changed", "KVConnectorBase_V1.get_num_new_matched_tokens"]
    assert changed.severity == "breaks"
    assert "kvp_extra" in changed.detail and "LMCacheMPConnector" in changed.detail
    added = surface["added", "KVConnectorBase_V1.kvp_new_duty"]
    assert added.severity == "breaks" and "DisabledKvConnector" in added.detail
    hook = surface["added", "KVConnectorBase_V1.kvp_new_hook"]
    assert hook.severity == "info" and "forwarded" in hook.detail
    class_hook = surface["added", "KVConnectorBase_V1.kvp_new_class_hook"]
    assert "not forwarded" in class_hook.detail
    removed = surface["removed", "KVConnectorBase_V1.set_xfer_handshake_metadata"]
    assert removed.severity == "breaks" and "KvPersistConnector" in removed.detail
    assert len(surface) == 5


def test_imports_the_target_lacks_are_reported(
        changed_vllm: tuple[Path, compat.CompatReport]) -> None:
    _, report = changed_vllm
    imports = {f.name: f for f in report.api if f.kind == "import"}
    own = [f for n, f in imports.items() if n.startswith("kvpersist/") and f.severity != "info"]
    assert [(f.name.rpartition(":")[0], f.severity) for f in own] == [
        ("kvpersist/serving/connector/kv_connector.py", "breaks")]
    # an import kvpersist guards (the run-time weight watch closes the gate without it) is noted
    noted = {f.name.rpartition(":")[0] for n, f in imports.items()
             if n.startswith("kvpersist/") and f.severity == "info"}
    assert noted <= {"kvpersist/serving/lmcache_compat/engine_rpc.py"}
    assert "base.KVConnectorHandshakeMetadata not found" in own[0].detail
    assert "at import" in own[0].detail
    # LMCache's MP connector, which kvpersist loads, imports vLLM modules this copy lacks
    assert any(f.severity == "breaks" for n, f in imports.items()
               if n.startswith("lmcache/integration/vllm/lmcache_mp_connector.py:"))
    # LMCache's old connector is never loaded by kvpersist; its failures are only noted
    old = [f for n, f in imports.items() if n.startswith("lmcache/integration/vllm/"
                                                           "lmcache_connector_v1.py:")]
    assert old and {f.severity for f in old} == {"info"}


def test_a_wheel_is_read_in_memory(tmp_path: Path,
                                   changed_vllm: tuple[Path, compat.CompatReport]) -> None:
    root, expected = changed_vllm
    wheel = tmp_path / "vllm-0.32.1-cp38-abi3-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path in sorted(root.rglob("*.py")):
            z.write(path, path.relative_to(root).as_posix())
        z.writestr("vllm-0.32.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: vllm\n"
                   "Version: 0.32.1\n")
    report = compat.check(vllm=wheel)
    assert report.vllm.version == "0.32.1"
    assert report.engine_fields == expected.engine_fields
    assert report.api == expected.api



def test_a_release_after_an_entrys_own_lacking_it_reports_it_stale(
        tmp_path: Path, changed_vllm: tuple[Path, compat.CompatReport]) -> None:
    """Entries vLLM 0.33.0 added are expected absent from the 0.32 tree the fixture copies
    while it says it is 0.32.1, and stale once the same tree says it is 0.99.0."""
    root, _ = changed_vllm
    added = tuple(ADDED_AFTER_TESTED)
    for version, stale in (("0.32.1", ()), ("0.99.0", added)):
        wheel = tmp_path / f"vllm-{version}-cp38-abi3-linux_x86_64.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            for path in sorted(root.rglob("*.py")):
                z.write(path, path.relative_to(root).as_posix())
            z.writestr(f"vllm-{version}.dist-info/METADATA",
                       f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
        report = compat.check(vllm=wheel)
        assert set(report.engine_fields.stale) == {"kv_events_config.topic", *stale}, version

# -- the command ----------------------------------------------------------------------------------

def test_cli_reads_the_installed_versions_without_importing_them() -> None:
    code = ("import json, sys\nfrom kvpersist.admin.cli import main\n"
            "rc = main(['compat', '--json'])\n"
            "print(json.dumps(sorted(m for m in ('vllm', 'lmcache', 'torch') if m in "
            "sys.modules)), file=sys.stderr)\nsys.exit(rc)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stderr.strip().splitlines()[-1]) == []
    report = json.loads(done.stdout)
    assert report["exit_code"] == 0 and report["gate_closes"] is False
    assert report["vllm"]["version"] == pins.TESTED_VERSIONS["vllm"]
    assert {f["name"]: f["on"] for f in report["features"]} == dict.fromkeys(pins.FEATURES, True)


def test_cli_exit_codes(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                        changed_vllm: tuple[Path, compat.CompatReport]) -> None:
    root, _ = changed_vllm
    assert main(["compat", "--vllm", str(root)]) == 2
    out = capsys.readouterr().out
    assert out.startswith("compat: CLOSED")
    assert "unknown (closes the gate): cache_config.kvp_test_knob" in out
    assert main(["compat", "--vllm", str(tmp_path / "nowhere")]) == 2
    assert "no top-level package 'vllm'" in capsys.readouterr().err
    assert main(["compat", "--help"]) == 0
    assert "Exit codes: 0" in capsys.readouterr().out


def test_preflight_reports_a_changed_pin_and_the_closing_gate_before_start(
        tmp_path: Path) -> None:
    from kvpersist.admin.preflight import compatibility_checks

    report = lmcache_with_edit(tmp_path, "lmcache.integration.vllm.vllm_multi_process_adapter",
                               "LMCacheMPWorkerAdapter.get_finished")
    found = {c.name: c for c in compatibility_checks(report)}
    assert found["fence load_fence"].level == "error"
    assert "LMCacheMPWorkerAdapter.get_finished" in found["fence load_fence"].message
    assert found["gate"].level == "error" and "load_fence" in found["gate"].message
    assert "load_fence" not in found["fence"].message  # the features still on
    clean = {c.name: c for c in compatibility_checks(compat.check_installed())}
    assert clean["gate"].level == clean["versions"].level == "ok"
