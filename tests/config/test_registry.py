"""The settings registry is the whole truth: every setting the code reads is a row, every row is
read, the configuration page and the site-file reference are what it generates, the units set
nothing but the site file's name, and the site file is read by every loader with the stated
precedence."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from kvpersist.config import reference
from kvpersist.config.admin import load_admin_settings
from kvpersist.config.client import ConnectorOptions, load_launcher_settings
from kvpersist.config.envfile import parse_env_lines
from kvpersist.config.registry import BY_NAME, RETIRED, SETTINGS
from kvpersist.config.server import load_settings
from kvpersist.config.values import SettingsError
from kvpersist.identity.fields import BY_ENV

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "implementation" / "kvpersist"
NAME = re.compile(r"KVP?_[A-Z0-9_]+")
#: Names that are not settings: identity pins keys, the tests' fault switches.
NOT_SETTINGS = set(BY_ENV) | {"KVP_FAULT_STOP_IN_RETRIEVE_S", "KVP_FAULT_STOP_IN_STORE_S",
                              "KVP_FAULT_STOP_IN_SECOND_STORE_S",
                              "KVP_FAULT_HOLD_L2_LOADS_WHILE", "KVP_FAULT_JOURNAL"}


def names_in_code() -> set[str]:
    """Every string constant of the package (tests' support excluded) that is a whole
    ``KVP_*`` name: what the code can read."""
    found: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        if "testing" in path.relative_to(PACKAGE).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and NAME.fullmatch(node.value) and node.value != "KVP_":
                found.add(node.value)
    return found - NOT_SETTINGS


def test_every_setting_read_in_the_code_is_registered_and_every_row_is_read() -> None:
    registered = set(BY_NAME) | set(RETIRED)
    assert names_in_code() - registered == set()
    assert registered - names_in_code() == set()


def test_the_page_and_the_site_reference_are_generated_from_the_registry() -> None:
    assert reference.stale() == []
    page = reference.CONFIG_PAGE.read_text()
    for setting in SETTINGS:
        assert f"| `{setting.name}` |" in page


def test_shipped_env_files_and_units_use_only_registered_names() -> None:
    for path in (REPO / "configs" / "systemd" / "kvpersist.env",
                 REPO / "configs" / "generic" / "kvpersist.env"):
        text = path.read_text()
        keys = {k for _, k, _ in parse_env_lines(text, str(path))}
        commented = set(re.findall(r"^#(KVP?_[A-Z0-9_]+)=", text, re.M))
        assert keys | commented <= set(BY_NAME), path
    site = dict((k, v) for _, k, v in parse_env_lines(
        (REPO / "configs" / "systemd" / "kvpersist.env").read_text(), "site"))
    for unit in (REPO / "configs" / "systemd").glob("*.service"):
        text = unit.read_text()
        set_here = re.findall(r"^Environment=(.*)$", text, re.M)
        names = {w.split("=", 1)[0] for line in set_here for w in line.split()}
        assert {n for n in names if n.startswith("KVP")} == {"KVP_CONFIG"}, unit
        assert "Environment=KVP_CONFIG=/etc/kvpersist/kvpersist.env" in text
    server_unit = (REPO / "configs" / "systemd" / "kvp-server.service").read_text()
    assert f"ReadWritePaths={site['KVP_CACHE_ROOT']}" in server_unit
    assert site["KVP_RUNTIME_DIR"] == "/run/kvpersist" and "RuntimeDirectory=kvpersist" in server_unit


def _site(tmp_path: Path, text: str) -> dict[str, str]:
    path = tmp_path / "kvpersist.env"
    path.write_text(text)
    return {"KVP_CONFIG": str(path)}


def test_every_loader_reads_the_site_file_and_the_environment_wins(tmp_path: Path) -> None:
    env = _site(tmp_path, f"KVP_CACHE_ROOT={tmp_path}/c\nKVP_RUNTIME_DIR={tmp_path}/r\n"
                          "KVP_L1_SIZE_GB=2\nKVP_L2_FILE_THREADS=3\nKVP_LOOKUP_TIMEOUT_S=7\n"
                          "KVP_WALKER=python\nKVP_SERVER_RESTART=systemctl restart kvp-server\n")
    server = load_settings(environ=env)
    assert server.request_socket == tmp_path / "r" / "request.sock"
    assert (server.l1_size_gb, server.l2_file_threads) == (2, 3)
    assert load_launcher_settings(env).lookup_timeout_s == 7
    assert ConnectorOptions.from_extra_config({}, env).lookup_timeout_s == 7
    admin = load_admin_settings(env)
    assert (admin.walker, admin.server_restart) == ("python", "systemctl restart kvp-server")
    over = load_settings(environ={**env, "KVP_L1_SIZE_GB": "4", "KVP_L2_FILE_THREADS": ""})
    assert (over.l1_size_gb, over.l2_file_threads) == (4, 3)  # empty: the file's value
    assert load_settings({"KVP_L1_SIZE_GB": "5"}, environ=env).l1_size_gb == 5
    assert ConnectorOptions.from_extra_config(
        {"kvpersist.lookup_timeout_s": 9}, env).lookup_timeout_s == 9


@pytest.mark.parametrize(("text", "message"), [
    ("KVP_L1_SIZE_G=2\n", r"kvpersist.env:1: KVP_L1_SIZE_G is not a kvpersist setting; did you "
                          r"mean KVP_L1_SIZE_GB\?"),
    ("# fine\nKVP_CACHE_DEVICE=/dev/nvme0n1\n", r":2: KVP_CACHE_DEVICE meant two things"),
    ("PATH=/bin\n", r"PATH is not a kvpersist setting"),
    ("KVP_L1_SIZE_GB 2\n", r"kvpersist.env:1: expected KEY=value"),
])
def test_a_bad_site_file_is_an_error_naming_the_line(tmp_path: Path, text: str,
                                                     message: str) -> None:
    env = _site(tmp_path, text)
    for load in (lambda: load_settings(environ=env), lambda: load_admin_settings(env),
                 lambda: load_launcher_settings(env)):
        with pytest.raises(SettingsError, match=message):
            load()


def test_a_missing_named_file_and_a_retired_variable_are_errors(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"KVP_CONFIG=.*no such file"):
        load_settings(environ={"KVP_CONFIG": str(tmp_path / "none.env")})
    with pytest.raises(SettingsError, match="KVP_CACHE_BLOCK_DEVICE"):
        load_admin_settings({"KVP_CACHE_DEVICE": "nvme0n1"})


def test_adapter_settings_reach_the_adapter_config(tmp_path: Path) -> None:
    from kvpersist.config.adapters import l2_adapter_config
    from kvpersist.l2.adapter import KvPersistL2AdapterConfig

    settings = load_settings({"KVP_CACHE_ROOT": str(tmp_path), "KVP_L2_FSYNC": "true",
                              "KVP_L2_IO_THREADS": "2", "KVP_L2_FILE_THREADS": "5",
                              "KVP_L2_QUARANTINE_MAX_FILES": "7"}, environ={})
    config = KvPersistL2AdapterConfig.from_dict(l2_adapter_config(settings)["adapter_params"])
    assert (config.fsync, config.io_threads, config.file_threads,
            config.quarantine_max_files) == (True, 2, 5, 7)


def test_the_file_an_older_release_read_is_not_dropped_silently(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpersist.config import site

    legacy = tmp_path / "lmcache-server.env"
    legacy.write_text("KVP_L1_SIZE_GB=8\n")
    monkeypatch.setattr(site, "LEGACY_SITE_FILE", legacy)
    monkeypatch.setattr(site, "DEFAULT_SITE_CONFIG", tmp_path / "kvpersist.env")
    with pytest.raises(SettingsError, match="no longer read: move its settings"):
        load_settings(environ={})
    (tmp_path / "kvpersist.env").write_text("KVP_L1_SIZE_GB=8\n")
    assert load_settings(environ={}).l1_size_gb == 8
