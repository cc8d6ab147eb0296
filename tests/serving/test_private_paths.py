"""The server's paths are private to its account: each way one can be wrong is refused with a fix.

These run the real start-up checks (:func:`check_preconditions`) on real directories; paths
owned by another account are made with ``chown`` (the suite runs as root in CI).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from kvpersist.config.server import SettingsError, load_settings
from kvpersist.serving.server.lifecycle import ServerError, check_preconditions
from kvpersist.serving.server.private_paths import PrivatePathError, check_private_file, open_private_log

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another account needs root")


def settings_for(tmp_path: Path, **over: str):  # type: ignore[no-untyped-def]
    return load_settings(environ={"KVP_CACHE_ROOT": str(tmp_path / "root"),
                                  "KVP_L1_SIZE_GB": "1", **over})


def test_created_private_and_accepted(tmp_path: Path) -> None:
    s = settings_for(tmp_path)
    check_preconditions(s)
    assert (s.cache_root.stat().st_mode & 0o777) == 0o700
    assert (s.socket_dir.stat().st_mode & 0o777) == 0o700
    check_preconditions(s)  # idempotent


@pytest.mark.parametrize("mode", [0o750, 0o755, 0o701, 0o770])
def test_open_cache_root_refused_with_the_fix(tmp_path: Path, mode: int) -> None:
    s = settings_for(tmp_path)
    s.cache_root.mkdir()
    s.cache_root.chmod(mode)
    with pytest.raises(ServerError, match=f"mode {mode:04o}.*chmod 0700 {s.cache_root}"):
        check_preconditions(s)
    assert (s.cache_root.stat().st_mode & 0o777) == mode  # nothing changed behind our back


@needs_root
def test_cache_root_of_another_account_refused(tmp_path: Path) -> None:
    s = settings_for(tmp_path)
    s.cache_root.mkdir(mode=0o700)
    os.chown(s.cache_root, NOBODY, NOBODY)
    with pytest.raises(ServerError, match=f"owned by uid {NOBODY}, not by this account"):
        check_preconditions(s)


def test_cache_root_may_be_a_symlink_to_a_private_dir(tmp_path: Path) -> None:
    target = tmp_path / "nvme"
    target.mkdir(mode=0o700)
    (tmp_path / "root").symlink_to(target)
    check_preconditions(settings_for(tmp_path))
    target.chmod(0o755)
    with pytest.raises(ServerError, match="mode 0755"):
        check_preconditions(settings_for(tmp_path))


@needs_root
def test_runtime_dir_pre_created_by_another_account_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    os.chown(run, NOBODY, NOBODY)
    with pytest.raises(ServerError, match=f"KVP_RUNTIME_DIR {run} is owned by uid {NOBODY}"):
        check_preconditions(settings_for(tmp_path, KVP_RUNTIME_DIR=str(run)))


def test_runtime_dir_symlink_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "run").symlink_to(real)
    with pytest.raises(ServerError, match="is a symlink; refusing it"):
        check_preconditions(settings_for(tmp_path, KVP_RUNTIME_DIR=str(tmp_path / "run")))


def test_open_runtime_dir_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    run.chmod(0o777)
    with pytest.raises(ServerError, match="mode 0777"):
        check_preconditions(settings_for(tmp_path, KVP_RUNTIME_DIR=str(run)))


def test_symlink_or_file_where_a_socket_goes_is_refused(tmp_path: Path) -> None:
    s = settings_for(tmp_path)
    check_preconditions(s)
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    s.http_socket.symlink_to(victim)
    with pytest.raises(ServerError, match="is a symlink; refusing to replace it"):
        check_preconditions(s)
    s.http_socket.unlink()
    s.request_socket.write_text("not a socket")
    with pytest.raises(ServerError, match="not a socket"):
        check_preconditions(s)
    assert victim.read_text() == "keep me" and s.request_socket.read_text() == "not a socket"


def test_stale_socket_of_a_dead_server_is_cleared(tmp_path: Path) -> None:
    s = settings_for(tmp_path)
    check_preconditions(s)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(s.http_socket))
    assert s.http_socket.exists()
    check_preconditions(s)
    assert not s.http_socket.exists()


def test_pid_file_and_log_are_checked(tmp_path: Path) -> None:
    s = settings_for(tmp_path)
    check_preconditions(s)
    s.log_file.write_text("old log\n")
    s.log_file.chmod(0o644)
    with pytest.raises(ServerError, match=f"the server log {s.log_file} has mode 0644.*chmod 0600"):
        check_preconditions(s)
    s.log_file.unlink()
    s.log_file.symlink_to(tmp_path / "elsewhere.log")
    with pytest.raises(ServerError, match="is a symlink; refusing to follow it"):
        check_preconditions(s)
    s.log_file.unlink()
    s.pid_file.write_text("{}")
    s.pid_file.chmod(0o666)
    with pytest.raises(ServerError, match=r"the pid file .* has mode 0666"):
        check_preconditions(s)


@needs_root
def test_log_of_another_account_refused(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("")
    log.chmod(0o600)
    os.chown(log, NOBODY, NOBODY)
    with pytest.raises(PrivatePathError, match=f"owned by uid {NOBODY}"):
        check_private_file(log, "the server log")


def test_log_is_created_0600_and_never_through_a_symlink(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    os.close(open_private_log(log))
    assert (log.stat().st_mode & 0o777) == 0o600
    target = tmp_path / "target"
    link = tmp_path / "link.log"
    link.symlink_to(target)
    with pytest.raises(PrivatePathError, match="symlink"):
        open_private_log(link)
    assert not target.exists()


@pytest.mark.parametrize(
    ("over", "fragment"),
    [
        ({"KVP_ACCESS": "everyone"}, "KVP_ACCESS='everyone' must be one of unix, tcp"),
        ({"KVP_ACCESS_GROUP": "no-such-group-kvp"}, "is not a group on this host"),
        ({"KVP_ACCESS_GROUP": "nogroup"}, "needs KVP_RUNTIME_DIR outside KVP_CACHE_ROOT"),
        ({"KVP_ACCESS": "tcp", "KVP_ACCESS_GROUP": "nogroup"}, "applies to KVP_ACCESS=unix"),
        ({"KVP_RUNTIME_DIR": "/tmp/" + "d" * 100}, "longer than 107 bytes"),
    ],
)
def test_access_settings_errors_say_how_to_fix(tmp_path: Path, over: dict[str, str],
                                               fragment: str) -> None:
    with pytest.raises(SettingsError, match=fragment):
        settings_for(tmp_path, **over)
