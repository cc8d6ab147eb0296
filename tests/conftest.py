"""Fixtures shared by every suite.  Tests import the installed ``kvpersist`` package (editable
in the project's venv) and its test support, :mod:`kvpersist.testing`; nothing edits sys.path."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpersist.config.environment import apply_to_current_process
from kvpersist.config.server import ServerSettings
from kvpersist.demo.tiny_model import WIDE_KV, build_tiny_model
from kvpersist.serving.server.lifecycle import stop_server
from kvpersist.testing.failure_logs import summarize
from kvpersist.testing.helpers import kvpersist_settings

# LMCache's client runs inside the test process too (its bench client): telemetry off here as well.
apply_to_current_process()


def _isolate_digest_cache() -> None:
    """The weights digests of the suite's throwaway models go to a cache of this process's own
    (removed at exit), not the account's; vLLM's and Hugging Face's caches stay where they were
    (vLLM's compile cache saves a start tens of seconds)."""
    home_cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"),
                                                                   ".cache")
    os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(home_cache, "vllm"))
    os.environ.setdefault("HF_HOME", os.path.join(home_cache, "huggingface"))
    private = tempfile.mkdtemp(prefix="kvp-test-xdg-")
    os.environ["XDG_CACHE_HOME"] = private
    atexit.register(shutil.rmtree, private, ignore_errors=True)


_isolate_digest_cache()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def wide_kv_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wide-KV model (64 KiB of KV per token), built once.  vLLM keys its compile cache by
    the model's path among other settings: a vLLM started on the same path with the same
    settings as an earlier one loads the compiled graph instead of compiling it (a start took
    38 s against 50 s here)."""
    return build_tiny_model(tmp_path_factory.mktemp("wide-kv-model"), WIDE_KV)


@pytest.fixture
def settings(tmp_path: Path) -> Iterator[ServerSettings]:
    """A kvpersist-adapter server's settings on a fresh root (1 GiB budget); stopped after the
    test.  The e2e suite overrides it with a 2 GiB budget."""
    s = kvpersist_settings(tmp_path / "cache")
    yield s
    stop_server(s)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 3 MiB tmpfs mounted for the test (ENOSPC comes fast); skipped where mounting is not
    permitted."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m,mode=0700", "tmpfs", str(mnt)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({res.stderr.strip()})")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test's report carries what the process logs under its ``tmp_path`` said
    (:mod:`kvpersist.testing.failure_logs`): a CI run keeps nothing else of a failure that does
    not repeat on demand."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    tmp_path = getattr(item, "funcargs", {}).get("tmp_path")
    if report.failed and report.when == "call" and isinstance(tmp_path, Path):
        logs = summarize(tmp_path)
        if logs:
            report.sections.append(("process logs under tmp_path", logs))


def _weight(item: pytest.Item) -> int:
    """0 for end-to-end tests (minutes each), 1 for tests with a server process, 2 for the rest."""
    if item.get_closest_marker("e2e"):
        return 0
    return 1 if item.get_closest_marker("integration") else 2


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Heaviest files first, each file's tests kept together and in their order.

    The two-worker pass (``--dist loadfile --no-loadscope-reorder``, :file:`scripts/test.sh`)
    runs each file whole on one worker (a module-scoped stack is built once, its tests keep
    their order) and hands the files out in this order: the run ends sooner when the long
    files start first than when one is left for last.  (The GlusterFS modules go to one worker
    together, :func:`pytest_xdist_make_scheduler`.)"""
    first_index: dict[str, int] = {}
    weight: dict[str, int] = {}
    for i, item in enumerate(items):
        path = str(item.path)
        first_index.setdefault(path, i)
        weight[path] = min(weight.get(path, 2), _weight(item))
    items.sort(key=lambda it: (weight[str(it.path)], first_index[str(it.path)]))


#: Folders whose files run on one worker, one after another: they share a machine-wide resource
#: (one glusterd per machine).  Split over two workers, one waited minutes on the other's turn
#: (:func:`kvpersist.testing.glusterfs.machine_turn`).
ONE_WORKER_FOLDERS = ("tests/shared/",)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """xdist's per-file scheduling, with each of :data:`ONE_WORKER_FOLDERS` one unit of work.
    (``--dist loadgroup`` would do this by mark, but with this pytest the marks never reach the
    workers: docs/testing.md.)  Only with ``--dist loadfile`` (``scripts/test.sh``'s first
    pass); any other mode is xdist's own."""
    if config.getoption("dist", None) != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FolderOrFileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            for folder in ONE_WORKER_FOLDERS:
                if nodeid.startswith(folder):
                    return folder
            return super()._split_scope(nodeid)

    return FolderOrFileScheduling(config, log)  # type: ignore[arg-type]
