"""Server lifecycle logic: settings validation, command line, pid files, preconditions."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvpersist.config.adapters import l2_adapter_config
from kvpersist.config.server import SettingsError, access_warning, load_settings
from kvpersist.serving.pidfile import (
    PidFileError,
    PidRecord,
    PidState,
    check_pid_file,
    process_start_ticks,
    write_pid_file,
)
from kvpersist.serving.server.lifecycle import (
    ServerError,
    check_preconditions,
    server_command,
    server_environment,
    stop_server,
)


def settings_for(tmp_path: Path, **over: str):  # type: ignore[no-untyped-def]
    env = {"KVP_CACHE_ROOT": str(tmp_path / "root"), **over}
    return load_settings(environ=env)


def small_l1(tmp_path: Path, **over: str):  # type: ignore[no-untyped-def]
    """Settings a start may check: L1 is held against the host's available memory (the default
    64 GB is a server's, not a test host's)."""
    return settings_for(tmp_path, KVP_L1_SIZE_GB="1", **over)


def test_defaults_follow_the_design(tmp_path: Path) -> None:
    s = settings_for(tmp_path)
    assert (s.bind_host, s.zmq_port, s.http_port) == ("127.0.0.1", 5555, 8080)
    assert (s.l1_size_gb, s.budget_gb) == (64, 1500)
    assert (s.eviction_watermark, s.eviction_ratio) == (0.9, 0.1)
    assert s.pid_file == tmp_path / "root" / "run" / "lmcache-server.pid"
    assert s.access == "unix" and s.socket_dir == tmp_path / "root" / "run"
    assert access_warning(s) is None


@pytest.mark.parametrize(
    ("var", "value", "fragment"),
    [
        ("KVP_CACHE_BUDGET_GB", "lots", "is not a number"),
        ("KVP_CACHE_BUDGET_GB", "-5", "positive"),
        ("KVP_CACHE_BUDGET_GB", "nan", "positive finite"),
        ("KVP_L1_SIZE_GB", "0", "positive"),
        ("KVP_ZMQ_PORT", "70000", "1..65535"),
        ("KVP_HTTP_PORT", "http", "not a port"),
        ("KVP_EVICTION_WATERMARK", "1.5", "between 0 and 1"),
        ("KVP_BIND_HOST", "my-host", "IP address"),
        ("KVP_L2_ADAPTER", "floppy", "not known"),
    ],
)
def test_bad_values_get_a_clear_error(tmp_path: Path, var: str, value: str, fragment: str) -> None:
    with pytest.raises(SettingsError) as info:
        settings_for(tmp_path, **{var: value})
    assert var in str(info.value) and fragment in str(info.value)


def test_same_ports_refused(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="must differ"):
        settings_for(tmp_path, KVP_ZMQ_PORT="6000", KVP_HTTP_PORT="6000")


def test_tcp_access_warns_and_non_loopback_says_so(tmp_path: Path) -> None:
    loopback = access_warning(settings_for(tmp_path, KVP_ACCESS="tcp"))
    assert loopback is not None and "any account on this host" in loopback
    warning = access_warning(settings_for(tmp_path, KVP_ACCESS="tcp", KVP_BIND_HOST="0.0.0.0"))
    assert warning is not None and "not loopback" in warning


def test_command_line_from_settings(tmp_path: Path) -> None:
    s = settings_for(tmp_path, KVP_CACHE_BUDGET_GB="2.5", KVP_L1_SIZE_GB="1", KVP_ACCESS="tcp",
                     KVP_ZMQ_PORT="6001", KVP_HTTP_PORT="6002", KVP_L2_ADAPTER="nixl_store_dynamic")
    cmd = server_command(s, python="/py")
    # the L1 window's size (KVP_RESTORE_WINDOW_GB=auto: L1/8) is kvpersist's, before LMCache's
    assert cmd[:7] == ["/py", "-m", "kvpersist.serving.server.entry", "--restore-window-gb",
                       "0.125", "--", "server"]
    flags = dict(zip(cmd[7::2], cmd[8::2], strict=True))
    assert flags["--host"] == flags["--http-host"] == "127.0.0.1"
    assert flags["--port"] == "6001" and flags["--http-port"] == "6002"
    assert flags["--l1-size-gb"] == "1"
    adapter = json.loads(flags["--l2-adapter"])
    assert adapter == l2_adapter_config(s)
    assert adapter["type"] == "nixl_store_dynamic"
    assert adapter["persist_enabled"] is True
    assert adapter["backend_params"]["file_path"] == str(tmp_path / "root")
    assert adapter["backend_params"]["max_capacity_gb"] == "2.5"
    assert adapter["eviction"] == {
        "eviction_policy": "LRU", "trigger_watermark": 0.9, "eviction_ratio": 0.1}


def test_unix_command_line_names_the_sockets(tmp_path: Path) -> None:
    s = settings_for(tmp_path)
    cmd = server_command(s, python="/py")
    split = cmd.index("--")
    entry = dict(zip(cmd[3:split:2], cmd[4:split:2], strict=True))
    assert entry == {"--restore-window-gb": "2",
                     "--request-socket": str(tmp_path / "root" / "run" / "request.sock"),
                     "--http-socket": str(tmp_path / "root" / "run" / "http.sock"),
                     "--socket-mode": "0600"}
    assert cmd[split + 1] == "server"


def test_the_one_pass_cpu_copy_is_on_unless_the_site_turns_it_off(tmp_path: Path) -> None:
    on = server_command(settings_for(tmp_path), python="/py")
    off = server_command(settings_for(tmp_path, KVP_CPU_DIRECT_COPY="false"), python="/py")
    assert "--no-cpu-direct-copy" not in on
    assert sorted(off[:off.index("--")]) == sorted([*on[:on.index("--")], "--no-cpu-direct-copy"])
    from kvpersist.serving.server.entry import build_parser

    assert build_parser().parse_args(["--no-cpu-direct-copy"]).cpu_direct_copy is False
    assert build_parser().parse_args([]).cpu_direct_copy is True


def test_default_adapter_is_kvpersist_plugin(tmp_path: Path) -> None:
    s = settings_for(tmp_path, KVP_CACHE_BUDGET_GB="3", KVP_L2_SHARDED="yes")
    adapter = l2_adapter_config(s)
    assert adapter["type"] == "plugin"
    assert (adapter["module_path"], adapter["class_name"]) == (
        "kvpersist.l2.adapter", "KvPersistL2Adapter")
    assert adapter["adapter_params"] == {  # typed values, as the settings validated them
        "path": str(tmp_path / "root"), "max_capacity_gb": 3.0, "sharded": True,
        "walker": "auto", "walk_threads": 0, "direct_io": True, "scan_snapshot": True,
        "fsync": False, "io_threads": 4, "file_threads": 16, "quarantine_max_files": 1024}
    assert adapter["persist_enabled"] is True
    assert adapter["eviction"]["trigger_watermark"] == 0.9
    with pytest.raises(SettingsError, match="KVP_L2_SHARDED"):
        settings_for(tmp_path, KVP_L2_SHARDED="maybe")


def test_environment_forces_telemetry_off() -> None:
    env = server_environment({"LMCACHE_TRACK_USAGE": "true", "PATH": "/bin"})
    assert env["LMCACHE_TRACK_USAGE"] == "false" and env["DO_NOT_TRACK"] == "1"
    assert env["PATH"] == "/bin"
    assert "PYTHONPATH" not in env  # the adapter comes from the installed package


def test_root_is_created_0700(tmp_path: Path) -> None:
    s = small_l1(tmp_path)
    check_preconditions(s)
    assert (s.cache_root.stat().st_mode & 0o777) == 0o700


def test_unwritable_root_refused(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    s = load_settings(environ={"KVP_CACHE_ROOT": str(blocker / "sub")})
    with pytest.raises(ServerError, match="cannot create KVP_CACHE_ROOT"):
        check_preconditions(s)
    s = load_settings(environ={"KVP_CACHE_ROOT": str(blocker)})
    with pytest.raises(ServerError, match="not a directory"):
        check_preconditions(s)


def test_busy_port_refused(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        s = small_l1(tmp_path, KVP_ACCESS="tcp", KVP_HTTP_PORT=str(port))
        with pytest.raises(ServerError, match=f"KVP_HTTP_PORT={port} is busy"):
            check_preconditions(s)


def _record(pid: int, ticks: int) -> PidRecord:
    return PidRecord(pid, ticks, "lmcache server", 5555, 8080)


def test_pid_file_states(tmp_path: Path) -> None:
    path = tmp_path / "x.pid"
    assert check_pid_file(path).state is PidState.ABSENT
    me = os.getpid()
    ticks = process_start_ticks(me)
    assert ticks is not None
    write_pid_file(path, _record(me, ticks))
    assert check_pid_file(path).state is PidState.RUNNING
    write_pid_file(path, _record(me, ticks + 1))
    assert check_pid_file(path).state is PidState.REUSED
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    write_pid_file(path, _record(dead.pid, 1))
    assert check_pid_file(path).state is PidState.DEAD


def test_stale_pid_is_never_signalled(tmp_path: Path) -> None:
    """A pid file naming a live process with another start time: stop reports, never kills."""
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        s = settings_for(tmp_path)
        s.socket_dir.mkdir(parents=True, mode=0o700)  # the runtime dir holds the pid file
        ticks = process_start_ticks(victim.pid)
        assert ticks is not None
        write_pid_file(s.pid_file, _record(victim.pid, ticks - 1))
        result = stop_server(s)
        assert not result.signalled and result.status.state is PidState.REUSED
        assert victim.poll() is None, "a reused pid was signalled"
        assert not s.pid_file.exists()
        assert "belongs to another program" in result.describe(s.pid_file)
    finally:
        victim.kill()
        victim.wait()


def test_stop_signals_the_recorded_process(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    s = settings_for(tmp_path, KVP_STOP_TIMEOUT_S="5")
    s.socket_dir.mkdir(parents=True, mode=0o700)  # the runtime dir holds the pid file
    ticks = process_start_ticks(child.pid)
    assert ticks is not None
    write_pid_file(s.pid_file, _record(child.pid, ticks))
    result = stop_server(s)
    assert result.signalled and result.graceful
    child.wait(timeout=5)
    assert process_start_ticks(child.pid) is None
    assert not s.pid_file.exists()


def test_pid_file_symlink_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.pid"
    write_pid_file(target, _record(os.getpid(), process_start_ticks(os.getpid()) or 0))
    link = tmp_path / "lmcache-server.pid"
    link.symlink_to(target)
    with pytest.raises(PidFileError, match="symlink"):
        check_pid_file(link)


def test_garbage_pid_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "x.pid"
    path.write_text("12345\n")
    with pytest.raises(PidFileError, match="not a kvpersist pid file"):
        check_pid_file(path)
