"""Every setting is parsed in one place, one way: the same words mean the same everywhere, and a
bad value is an error that names the setting."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvpersist.config import values
from kvpersist.config.admin import load_admin_settings
from kvpersist.config.client import ConnectorOptions, load_launcher_settings
from kvpersist.config.server import load_settings
from kvpersist.config.values import SettingsError
from kvpersist.l2.adapter import KvPersistL2AdapterConfig

WORDS = [("1", True), ("true", True), ("YES", True), ("on", True), (" On ", True),
         ("0", False), ("false", False), ("no", False), ("OFF", False)]


@pytest.mark.parametrize(("word", "meaning"), WORDS)
def test_booleans_mean_the_same_in_settings_and_in_the_adapter(tmp_path: Path, word: str,
                                                               meaning: bool) -> None:
    server = load_settings(environ={"KVP_CACHE_ROOT": str(tmp_path), "KVP_L2_SHARDED": word})
    adapter = KvPersistL2AdapterConfig.from_dict(
        {"path": str(tmp_path), "max_capacity_gb": 1, "sharded": word, "fsync": word})
    launcher = load_launcher_settings({"KV_PERSIST": word})
    assert server.l2_sharded is adapter.sharded is adapter.fsync is launcher.persist is meaning


@pytest.mark.parametrize("word", ["maybe", "2", "enabled", ""])
def test_an_unknown_boolean_is_an_error_everywhere(tmp_path: Path, word: str) -> None:
    if word:
        with pytest.raises(SettingsError, match="KVP_L2_SHARDED"):
            load_settings(environ={"KVP_CACHE_ROOT": str(tmp_path), "KVP_L2_SHARDED": word})
        with pytest.raises(SettingsError, match="KV_PERSIST"):
            load_launcher_settings({"KV_PERSIST": word})
    with pytest.raises(ValueError, match="kvpersist L2 adapter: sharded"):
        KvPersistL2AdapterConfig.from_dict({"path": "/x", "max_capacity_gb": 1, "sharded": word})


def test_connector_options_from_extra_config_then_environment() -> None:
    opts = ConnectorOptions.from_extra_config(
        {"kvpersist.pins": "/p.env", "kvpersist.lookup_timeout_s": 7, "lmcache.mp.port": 5555},
        environ={"KVP_LOOKUP_TIMEOUT_S": "9", "KVP_CACHE_ROOT": "/root"})
    assert (opts.pins, opts.lookup_timeout_s, opts.cache_root) == ("/p.env", 7.0, "/root")
    defaults = ConnectorOptions.from_extra_config({}, environ={})
    assert defaults.lookup_timeout_s == 5.0 and defaults.pins is None


@pytest.mark.parametrize(("extra", "environ", "named"), [
    ({"kvpersist.lookup_timeout_s": "abc"}, {}, "kvpersist.lookup_timeout_s"),
    ({"kvpersist.lookup_timeout_s": 0}, {}, "kvpersist.lookup_timeout_s"),
    ({"kvpersist.lookup_timeout_s": True}, {}, "kvpersist.lookup_timeout_s"),
    ({}, {"KVP_LOOKUP_TIMEOUT_S": "inf"}, "KVP_LOOKUP_TIMEOUT_S"),
    ({"kvpersist.cache_rot": "/x"}, {}, "kvpersist.cache_rot"),
    ({"kvpersist.http_url": ["x"]}, {}, "kvpersist.http_url"),
])
def test_bad_connector_options_name_the_setting(extra: dict[str, object], environ: dict[str, str],
                                                named: str) -> None:
    with pytest.raises(SettingsError, match=named.replace(".", r"\.")):
        ConnectorOptions.from_extra_config(extra, environ=environ)


@pytest.mark.parametrize(("var", "value"), [
    ("KVP_HEARTBEAT_S", "-1"), ("KVP_MQ_TIMEOUT_S", "soon"), ("KVP_LOOKUP_TIMEOUT_S", "nan"),
    ("KVP_MP_TRANSFER_MODE", "telepathy"), ("KV_PERSIST", "sometimes"),
])
def test_bad_launcher_variables_name_themselves(var: str, value: str) -> None:
    with pytest.raises(SettingsError, match=var):
        load_launcher_settings({var: value})


def test_launcher_defaults() -> None:
    s = load_launcher_settings({})
    assert (s.persist, s.lookup_timeout_s, s.heartbeat_s, s.mq_timeout_s, s.transfer_mode) == (
        True, 5.0, 2.0, 15.0, None)


@pytest.mark.parametrize(("var", "value"), [("KVP_WALKER", "rust"), ("KVP_WALK_THREADS", "-2"),
                                            ("KVP_WALK_THREADS", "many")])
def test_bad_admin_variables_name_themselves(var: str, value: str) -> None:
    with pytest.raises(SettingsError, match=var):
        load_admin_settings({var: value})


def test_admin_settings() -> None:
    s = load_admin_settings({"KVP_QUOTAS_FILE": "/q.json", "KVP_WALKER": "python",
                             "KVP_WALK_THREADS": "3", "KVP_CACHE_MOUNT": "/mnt/x",
                             "KVP_CACHE_BLOCK_DEVICE": "nvme0n1", "KVP_RESULTS_DIR": "/r"})
    assert (s.quotas_file, s.walker, s.walk_threads, s.cache_mount, s.block_device,
            s.results_dir) == (Path("/q.json"), "python", 3, Path("/mnt/x"), "nvme0n1",
                               Path("/r"))


def test_value_parsers_refuse_booleans_as_numbers() -> None:
    with pytest.raises(SettingsError):
        values.positive_float("x", True)
    with pytest.raises(SettingsError):
        values.positive_int("x", False)


def test_a_node_of_a_shared_tree_keeps_its_part_its_share_and_its_state_local(
        tmp_path: Path) -> None:
    from kvpersist.config.adapters import l2_adapter_config

    tree, run = tmp_path / "tree", tmp_path / "run-a"
    s = load_settings(environ={"KVP_CACHE_ROOT": str(tree), "KVP_NODE_ID": "node-a.1",
                               "KVP_SHARED_NODES": "4", "KVP_CACHE_BUDGET_GB": "100",
                               "KVP_RUNTIME_DIR": str(run)})
    assert s.shared and s.tree == tree and s.cache_root == tree / "nodes" / "node-a.1"
    assert s.node_budget_gb == 25
    assert s.pid_file.parent == run and s.log_file.parent == run  # never on the shared tree
    params = l2_adapter_config(s)["adapter_params"]
    assert params["path"] == str(s.cache_root) and params["shared_tree"] == str(tree)
    assert params["max_capacity_gb"] == 25.0  # typed, not template text
    config = KvPersistL2AdapterConfig.from_dict(params)  # the adapter reads exactly this back
    assert config.shared_tree == str(tree) and config.max_capacity_gb == 25.0
    alone = load_settings(environ={"KVP_CACHE_ROOT": str(tree)})
    assert not alone.shared and alone.cache_root == tree and alone.pid_file.parent == tree / "run"
    assert "shared_tree" not in l2_adapter_config(alone)["adapter_params"]


@pytest.mark.parametrize(("environ", "words"), [
    ({"KVP_NODE_ID": "a/b"}, "KVP_NODE_ID='a/b' is not a node id"),
    ({"KVP_NODE_ID": ".hidden"}, "is not a node id"),
    ({"KVP_NODE_ID": "a"}, "needs KVP_RUNTIME_DIR on the node's local disk"),
    ({"KVP_NODE_ID": "a", "KVP_RUNTIME_DIR": "{tree}/run"}, "outside KVP_CACHE_ROOT"),
    ({"KVP_NODE_ID": "a", "KVP_RUNTIME_DIR": "/run/x", "KVP_L2_ADAPTER": "fs"},
     "needs KVP_L2_ADAPTER=kvpersist"),
    ({"KVP_SHARED_NODES": "2"}, "KVP_SHARED_NODES=2 needs KVP_NODE_ID"),
    ({"KVP_NODE_ID": "a", "KVP_RUNTIME_DIR": "/run/x", "KVP_SHARED_NODES": "0"},
     "KVP_SHARED_NODES"),
])
def test_bad_shared_tree_settings_say_what_to_do(tmp_path: Path, environ: dict[str, str],
                                                  words: str) -> None:
    tree = tmp_path / "tree"
    env = {"KVP_CACHE_ROOT": str(tree),
           **{k: v.replace("{tree}", str(tree)) for k, v in environ.items()}}
    with pytest.raises(SettingsError, match=words.replace("(", r"\(").replace(".", r"\.")):
        load_settings(environ=env)


def test_the_server_validates_the_scan_walker_and_hands_it_to_the_adapter(tmp_path: Path
                                                                          ) -> None:
    from kvpersist.config.adapters import l2_adapter_config

    with pytest.raises(SettingsError, match="KVP_WALKER"):
        load_settings({"KVP_CACHE_ROOT": str(tmp_path), "KVP_WALKER": "rust"})
    with pytest.raises(SettingsError, match="KVP_WALK_THREADS"):
        load_settings({"KVP_CACHE_ROOT": str(tmp_path), "KVP_WALK_THREADS": "-1"})
    settings = load_settings({"KVP_CACHE_ROOT": str(tmp_path), "KVP_WALKER": "python",
                              "KVP_WALK_THREADS": "3"})
    params = l2_adapter_config(settings)["adapter_params"]
    config = KvPersistL2AdapterConfig.from_dict(params)
    assert (config.walker, config.walk_threads) == ("python", 3)


@pytest.mark.parametrize(("env", "named"), [
    ({"KVP_CACHE_BUDGET_GB": "1e-10"}, "KVP_CACHE_BUDGET_GB=1e-10"),
    ({"KVP_CACHE_BUDGET_GB": "0.002", "KVP_NODE_ID": "a", "KVP_SHARED_NODES": "4"},
     "KVP_CACHE_BUDGET_GB=0.002 shared by 4 nodes"),
    ({"KVP_L1_SIZE_GB": "1e-9"}, "KVP_L1_SIZE_GB=1e-09"),
])
def test_sizes_that_make_no_sense_are_refused_naming_the_variable(
        tmp_path: Path, env: dict[str, str], named: str) -> None:
    with pytest.raises(SettingsError, match=re.escape(named)):
        load_settings(environ={"KVP_CACHE_ROOT": str(tmp_path), **env})
    assert load_settings(environ={"KVP_CACHE_ROOT": str(tmp_path), "KVP_CACHE_BUDGET_GB": "0.001",
                                  "KVP_L1_SIZE_GB": "0.001"}).node_budget_gb == 0.001


def test_a_symlinked_root_is_resolved_once_and_its_store_scans(tmp_path: Path) -> None:
    """Every command gets the real directory; the scan (which opens the root with O_NOFOLLOW)
    walks it instead of failing forever."""
    from kvpersist.l2.store import KvFileStore

    real = tmp_path / "nvme" / "kv"
    real.mkdir(parents=True)
    (tmp_path / "link").symlink_to(real)
    settings = load_settings(environ={"KVP_CACHE_ROOT": str(tmp_path / "link")})
    assert settings.cache_root == real and settings.tree == real
    store = KvFileStore(settings.cache_root, 10**9)
    store.open(background_scan=False)
    try:
        assert store.scan_error is None and store.scan_done and store.check() == []
    finally:
        store.close()


def test_extra_roots_reach_the_adapter_resolved_and_each_root_its_share(tmp_path: Path) -> None:
    from kvpersist.config.adapters import l2_adapter_config

    (tmp_path / "nvme0").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "nvme0")
    settings = load_settings({"KVP_CACHE_ROOT": str(tmp_path / "nvme0" / "kv"),
                              "KVP_CACHE_BUDGET_GB": "3",
                              "KVP_CACHE_EXTRA_ROOTS": f"{tmp_path}/nvme1/kv: {tmp_path}/nvme2/kv"})
    assert settings.extra_roots == (tmp_path / "nvme1" / "kv", tmp_path / "nvme2" / "kv")
    params = l2_adapter_config(settings)["adapter_params"]
    config = KvPersistL2AdapterConfig.from_dict(params)
    assert config.extra_paths == (f"{tmp_path}/nvme1/kv", f"{tmp_path}/nvme2/kv")
    assert config.max_capacity_gb == 3  # split in equal shares by the adapter
    assert "extra_paths" not in l2_adapter_config(
        load_settings({"KVP_CACHE_ROOT": str(tmp_path / "one")}))["adapter_params"]


@pytest.mark.parametrize(("extra", "words"), [
    ("relative/kv", "is not an absolute path"),
    ("{tmp}/nvme0/kv", "overlap"),
    ("{tmp}/link/kv", "overlap"),  # the same directory through a symlink
    ("{tmp}/nvme0/kv/inner", "overlap"),
    ("{tmp}/nvme1:{tmp}/nvme1", "overlap"),
])
def test_extra_roots_that_are_not_separate_directories_are_refused(
        tmp_path: Path, extra: str, words: str) -> None:
    (tmp_path / "nvme0").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "nvme0")
    with pytest.raises(SettingsError, match=words):
        load_settings({"KVP_CACHE_ROOT": str(tmp_path / "nvme0" / "kv"),
                       "KVP_CACHE_EXTRA_ROOTS": extra.replace("{tmp}", str(tmp_path))})


def test_extra_roots_are_refused_on_a_shared_tree(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="KVP_CACHE_EXTRA_ROOTS needs"):
        load_settings({"KVP_CACHE_ROOT": str(tmp_path / "tree"), "KVP_NODE_ID": "a",
                       "KVP_RUNTIME_DIR": str(tmp_path / "run"),
                       "KVP_CACHE_EXTRA_ROOTS": str(tmp_path / "nvme1")})
