"""The package's folders are its layers, and data flows one way:

    atomic, observed_metrics, config → identity → l2 | serving → admin → demo → testing

A module may import from its own package and from packages to its left, never to its right nor
from a sibling layer (l2 and serving do not know each other); the shim ``kvpersist.connector``
(the module path vLLM loads) only re-exports.

Inside ``serving`` each process has its folder (``serving/__init__``'s table): ``server``,
``connector`` (its ``scheduler`` and ``worker`` sides apart) and ``launcher`` never import one
another; they share the fence (``lmcache_compat``) and the shared modules at ``serving``'s top,
which import no process folder.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import kvpersist

PACKAGE = Path(kvpersist.__file__).parent
RANK = {"atomic": 0, "observed_metrics": 0, "config": 0, "identity": 1, "l2": 2, "serving": 2,
        "admin": 3, "demo": 4, "testing": 5, "connector": 3}
#: serving's process folders; none imports another.
PROCESS_FOLDERS = ("server", "connector", "launcher")


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def imports_of(path: Path) -> set[str]:
    """kvpersist modules imported by ``path`` (relative imports resolved)."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module.removesuffix(
        ".__init__")
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            names = [f"{target}.{a.name}" for a in node.names]
            out.update(n for n in [target, *names] if n.startswith("kvpersist."))
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("kvpersist."))
    return out


def test_every_module_belongs_to_a_layer() -> None:
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] == "__init__.py":
            continue
        assert rel.parts[0].removesuffix(".py") in RANK, f"{rel} is in no layer"


def test_data_flows_one_way() -> None:
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] == "__init__.py":
            continue
        here = rel.parts[0].removesuffix(".py")
        for target in imports_of(path):
            there = layer_of(target)
            if there in ("", here) or there not in RANK:
                continue
            if RANK[there] >= RANK[here]:
                wrong.append(f"{rel} imports {target} ({here} must not depend on {there})")
    assert wrong == []


def test_the_bottom_layers_import_no_lmcache_or_vllm() -> None:
    """config, identity and the gate run anywhere (kvp-admin on a host without vLLM)."""
    for path in [*PACKAGE.joinpath("config").rglob("*.py"), *PACKAGE.joinpath("identity").rglob(
            "*.py"), PACKAGE / "serving" / "connector" / "gate.py",
            PACKAGE / "serving" / "server" / "lifecycle.py"]:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] in ("vllm", "lmcache") for n in names), path


def runtime_imports(path: Path) -> set[str]:
    """kvpersist modules imported at module level, outside ``if TYPE_CHECKING:`` blocks."""
    module_names = {str(p.relative_to(PACKAGE.parent).with_suffix("")).replace("/", ".")
                    .removesuffix(".__init__") for p in PACKAGE.rglob("*.py")}
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = [n for n in tree.body if not (isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(
        n.test))]
    found: set[str] = set()
    for node in top:
        if isinstance(node, ast.Import | ast.ImportFrom):
            wrapper = ast.Module(body=[node], type_ignores=[])
            scratch = path.with_name(path.name)  # same package context for relative imports
            for name in _imports_in(wrapper, scratch):
                while name and name not in module_names:
                    name = name.rpartition(".")[0]
                if name:
                    found.add(name)
    return found


def _imports_in(tree: ast.Module, path: Path) -> set[str]:
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module.removesuffix(
        ".__init__")
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")
            target = ".".join([*base[: len(base) - node.level + 1], *(
                [node.module] if node.module else [])]) if node.level else (node.module or "")
            out.update([target, *(f"{target}.{a.name}" for a in node.names)])
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {n for n in out if n.startswith("kvpersist")}


def test_no_import_cycles() -> None:
    graph = {str(p.relative_to(PACKAGE.parent).with_suffix("")).replace("/", ".")
             .removesuffix(".__init__"): runtime_imports(p) for p in PACKAGE.rglob("*.py")}
    for deps in graph.values():
        deps.discard("kvpersist")
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if dep == node or (node.startswith(dep + ".") and dep in graph):
                continue  # a package's own __init__ seen from inside it
            if state.get(dep) == 1 and not cycle:
                cycle.extend([*trail[trail.index(dep):], dep] if dep in trail else [node, dep])
            elif dep not in state:
                visit(dep, [*trail, dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycle == [], " -> ".join(cycle)


MODULES = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(
    ".__init__") for p in PACKAGE.rglob("*.py")}


def serving_part(name: str) -> str:
    """``serving``'s folder of the module ``name`` is in (``connector.scheduler`` for the
    connector's sides), or ``shared`` for a module at serving's top."""
    module = name
    while module not in MODULES and "." in module:
        module = module.rpartition(".")[0]
    parts = module.split(".")[2:]
    if len(parts) <= 1:
        return "shared"
    if parts[0] == "connector" and len(parts) > 2 and parts[1] in ("scheduler", "worker"):
        return f"connector.{parts[1]}"
    return parts[0]


#: serving's folder -> the folders it may import.
SERVING_IMPORTS = {
    "shared": {"shared"},
    "lmcache_compat": {"shared", "lmcache_compat"},
    "server": {"shared", "lmcache_compat", "server"},
    "launcher": {"shared", "launcher"},
    "connector": {"shared", "lmcache_compat", "connector", "connector.scheduler",
                  "connector.worker"},
    "connector.scheduler": {"shared", "lmcache_compat", "connector", "connector.scheduler"},
    "connector.worker": {"shared", "lmcache_compat", "connector", "connector.worker"},
}


def test_serving_folders_are_processes_that_do_not_import_each_other() -> None:
    wrong = []
    for path in PACKAGE.joinpath("serving").rglob("*.py"):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        here = serving_part(module.removesuffix(".__init__"))
        for target in imports_of(path):
            if target.startswith("kvpersist.serving.") and (
                    serving_part(target) not in SERVING_IMPORTS[here]):
                wrong.append(f"{module} ({here}) imports {target} ({serving_part(target)})")
    assert wrong == []


def test_every_serving_folder_says_which_process_runs_it() -> None:
    table = (PACKAGE / "serving" / "__init__.py").read_text(encoding="utf-8")
    folders = sorted(p.parent.name for p in PACKAGE.joinpath("serving").glob("*/__init__.py"))
    assert folders == ["connector", "launcher", "lmcache_compat", "server"]
    for folder in folders:
        assert f"``{folder}/``" in table, folder
        doc = (PACKAGE / "serving" / folder / "__init__.py").read_text(encoding="utf-8")
        assert doc.startswith('"""') and len(doc.split('"""')[1]) > 200, folder


def test_the_design_describes_the_house_with_the_folders_that_exist() -> None:
    """docs/design.md's table of processes names every serving folder, and no folder that is
    gone."""
    design = (PACKAGE.parents[1] / "docs" / "design.md").read_text(encoding="utf-8")
    house = design.split("### The house: which process runs what", 1)[1].split("\n### ", 1)[0]
    named = set(re.findall(r"`serving/([a-z_]+)/", house)) | (
        {"lmcache_compat"} if "`lmcache_compat/`" in house else set())
    folders = {p.parent.name for p in PACKAGE.joinpath("serving").glob("*/__init__.py")}
    assert named == folders
    for path in re.findall(r"`(serving/[a-z_/]+\.py)`", house):
        assert (PACKAGE / path).is_file(), path
