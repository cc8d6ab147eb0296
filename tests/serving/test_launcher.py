"""kvp-vllm: the recipe's arguments pass through; persistence adds exactly the connector config."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from kvpersist.config.client import load_launcher_settings
from kvpersist.config.server import load_settings
from kvpersist.config.values import SettingsError
from kvpersist.serving.launcher import kvp_vllm
from kvpersist.serving.launcher.kvp_vllm import (
    PROMPT_DETAILS_FLAG,
    default_transfer_mode,
    parallel_layout,
    vllm_command,
)
from kvpersist.testing.helpers import TINY_PINS

RECIPE = ["--host", "127.0.0.1", "-tp", "1", "--chat-template", "tmpl.jinja"]


def test_persistence_adds_the_connector_and_nothing_else(tmp_path: Path) -> None:
    settings = load_settings(environ={"KVP_CACHE_ROOT": str(tmp_path), "KVP_ZMQ_PORT": "6001"})
    launcher = load_launcher_settings({"KVP_IDENTITY_PINS": str(TINY_PINS), "KVP_PYTHON": "/py"})
    cmd = vllm_command("/models/m", RECIPE, launcher=launcher, settings=settings)
    assert cmd[:5] == ["/py", "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/m"]
    assert cmd[5:5 + len(RECIPE)] == RECIPE
    config = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert config["kv_connector_module_path"] == "kvpersist.connector"
    assert config["kv_load_failure_policy"] == "recompute"  # a failed load is a recompute
    extra = config["kv_connector_extra_config"]
    assert extra["lmcache.mp.server_urls"] == f"ipc://{tmp_path}/run/request.sock"
    assert extra["kvpersist.http_url"] == settings.http_url
    assert extra["kvpersist.http_url"].startswith("http+unix://%2F")
    assert extra["kvpersist.pins"] == str(TINY_PINS)
    assert extra["kvpersist.chat_template_file"] == str(Path("tmpl.jinja").absolute())
    assert (extra["kvpersist.lookup_timeout_s"], extra["kvpersist.lookup_max_s"]) == (5.0, 600.0)
    assert cmd.count(PROMPT_DETAILS_FLAG) == 1


def test_bypass_reaches_the_connector_config(tmp_path: Path) -> None:
    settings = load_settings(environ={"KVP_CACHE_ROOT": str(tmp_path)})
    launcher = load_launcher_settings({"KVP_IDENTITY_PINS": str(TINY_PINS), "KVP_CACHE_BYPASS": "1"})
    cmd = vllm_command("/models/m", RECIPE, launcher=launcher, settings=settings)
    extra = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert extra["kvpersist.cache_bypass"] is True
    plain = load_launcher_settings({"KVP_IDENTITY_PINS": str(TINY_PINS)})
    cmd = vllm_command("/models/m", RECIPE, launcher=plain, settings=settings)
    assert "kvpersist.cache_bypass" not in cmd[cmd.index("--kv-transfer-config") + 1]


def test_kv_persist_0_runs_the_recipe_untouched() -> None:
    launcher = load_launcher_settings({"KV_PERSIST": "0", "KVP_VLLM_EXEC": "numactl -N0",
                                       "KVP_PYTHON": "/opt/v/bin/python"})
    cmd = vllm_command("m", RECIPE, launcher=launcher, settings=None, environ={})
    assert cmd[:3] == ["numactl", "-N0", "/opt/v/bin/python"]
    assert cmd[-len(RECIPE):] == RECIPE and "--kv-transfer-config" not in cmd


def test_a_container_exec_gets_the_environment_and_its_own_python(tmp_path: Path) -> None:
    site = tmp_path / "kvpersist.env"
    site.write_text("KVP_LOOKUP_TIMEOUT_S=7\n")
    environ = {"KVP_CONFIG": str(site), "KVP_VLLM_EXEC": "docker exec -u vllm c1",
               "KVP_PYTHON": "/usr/bin/python3", "VLLM_CPU_KVCACHE_SPACE": "4",
               "HOME": "/root", "LMCACHE_TRACK_USAGE": "true"}
    launcher = load_launcher_settings({**environ, "KV_PERSIST": "0"})
    cmd = vllm_command("m", RECIPE, launcher=launcher, settings=None, environ=environ)
    runtime, python = cmd[:2], cmd.index("/usr/bin/python3")
    passed = cmd[2:python]
    assert runtime == ["docker", "exec"] and passed[-3:] == ["-u", "vllm", "c1"]
    flags = dict(p[2:].split("=", 1) for p in passed if p.startswith("-e"))
    assert flags["KVP_LOOKUP_TIMEOUT_S"] == "7" and flags["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert flags["LMCACHE_TRACK_USAGE"] == "false" and flags["DO_NOT_TRACK"] == "1"
    assert "HOME" not in flags and "KVP_CONFIG" not in flags
    no_python = load_launcher_settings({"KVP_VLLM_EXEC": "docker exec c1", "KV_PERSIST": "0"})
    with pytest.raises(SettingsError, match="KVP_VLLM_EXEC needs KVP_PYTHON"):
        vllm_command("m", RECIPE, launcher=no_python, settings=None, environ={})


def test_persistence_without_pins_is_a_clear_error(tmp_path: Path) -> None:
    settings = load_settings(environ={"KVP_CACHE_ROOT": str(tmp_path)})
    with pytest.raises(SettingsError, match="KVP_IDENTITY_PINS"):
        vllm_command("m", [], launcher=load_launcher_settings({}), settings=settings)


def _free_gib(monkeypatch: pytest.MonkeyPatch, gib: float) -> None:
    """``/dev/shm`` reports ``gib`` free: the choice is a rule over one measurement, and the
    real free space moves while parallel tests write beside this one."""
    monkeypatch.setattr(kvp_vllm, "shm_free_bytes", lambda _dir: int(gib * 2**30))


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CUDA: the mode is auto")
def test_without_cuda_the_kv_cache_goes_to_shared_memory_when_it_fits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert kvp_vllm.shm_free_bytes(tmp_path) == shutil.disk_usage(tmp_path).free
    assert default_transfer_mode({"VLLM_CPU_KVCACHE_SPACE": "1"}, tmp_path / "none")[0] == \
        "engine_driven"  # a missing directory is measured for real and refused
    _free_gib(monkeypatch, 1.2)
    assert default_transfer_mode({"VLLM_CPU_KVCACHE_SPACE": "1"}, tmp_path)[0] == \
        "lmcache_driven"
    mode, why = default_transfer_mode({"VLLM_CPU_KVCACHE_SPACE": "1"}, tmp_path,
                                      server_uid=os.geteuid() + 1)
    assert mode == "engine_driven" and "another account" in why
    assert default_transfer_mode({"VLLM_CPU_KVCACHE_SPACE": "1"}, tmp_path,
                                 server_uid=os.geteuid())[0] == "lmcache_driven"
    _free_gib(monkeypatch, 1.1)  # under the 1/8 margin: a full tmpfs would SIGBUS the worker
    mode, why = default_transfer_mode({"VLLM_CPU_KVCACHE_SPACE": "1"}, tmp_path)
    assert mode == "engine_driven" and "1.1 GiB free" in why, why
    mode, why = default_transfer_mode({}, tmp_path)
    assert mode == "engine_driven" and "VLLM_CPU_KVCACHE_SPACE" in why


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CUDA: the mode is auto")
def test_shared_memory_is_counted_for_every_worker_and_unproven_layouts_are_pickled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _free_gib(monkeypatch, 5)  # 4 GiB fits once with its margin, not twice
    env = {"VLLM_CPU_KVCACHE_SPACE": "4"}
    assert default_transfer_mode(env, tmp_path, layout=(1, 1))[0] == "lmcache_driven"
    mode, why = default_transfer_mode(env, tmp_path, layout=(2, 1))
    assert mode == "engine_driven" and "2 x 4 GiB" in why, why
    assert default_transfer_mode({"VLLM_CPU_KVCACHE_SPACE": "2"}, tmp_path,
                                 layout=(2, 1))[0] == "lmcache_driven"
    mode, why = default_transfer_mode({"VLLM_CPU_KVCACHE_SPACE": "1"}, tmp_path, layout=(2, 2))
    assert mode == "engine_driven" and "PP 2" in why, why
    mode, why = default_transfer_mode({"VLLM_CPU_KVCACHE_SPACE": "1"}, tmp_path, layout=(4, 1))
    assert mode == "engine_driven" and "TP 4" in why, why


def test_the_parallel_layout_is_read_as_vllm_reads_it() -> None:
    assert parallel_layout([]) == (1, 1)
    assert parallel_layout(["--tensor-parallel-size", "2", "-pp=2"]) == (2, 2)
    assert parallel_layout(["-tp", "4", "--pipeline-parallel-size=1"]) == (4, 1)
    with pytest.raises(SettingsError, match="invalid int value: 'x'"):
        parallel_layout(["-tp", "x"])
    with pytest.raises(SettingsError, match="must be positive"):
        parallel_layout(["-pp", "0"])
