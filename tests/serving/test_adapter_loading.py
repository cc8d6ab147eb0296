"""The server imports only the L2 adapters its command line names
(:mod:`kvpersist.serving.lmcache_compat.adapter_loading`), with LMCache's real parser: each case
runs in a fresh interpreter, since what matters is which modules get imported."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from kvpersist.serving.lmcache_compat import adapter_loading, pins

BIGTABLE = "lmcache.v1.distributed.l2_adapters.bigtable_l2_adapter"
PLUGIN = {"type": "plugin", "module_path": "kvpersist.l2.adapter",
          "class_name": "KvPersistL2Adapter", "config_class_name": "KvPersistL2AdapterConfig",
          "adapter_params": {"path": "/tmp/kvp-adapter-loading-test", "max_capacity_gb": 1}}
FS = {"type": "fs", "base_path": "/tmp/kvp-adapter-loading-fs"}

#: Builds LMCache's server arguments as `lmcache server` does and parses ``--l2-adapter`` values.
PROBE = """
import argparse, json, sys
from kvpersist.serving.lmcache_compat import adapter_loading
args, install = json.loads(sys.argv[1]), sys.argv[2] == "1"
values = [json.loads(a) for a in args[1::2]]
installed = adapter_loading.install(args, values) if install else False
from lmcache.v1.distributed.config import add_storage_manager_args
from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config
parser = argparse.ArgumentParser()
add_storage_manager_args(parser)
help_text = parser.format_help()
config = parse_args_to_l2_adapters_config(parser.parse_known_args(args)[0])
print(json.dumps({"installed": installed,
                  "configs": [type(c).__name__ for c in config.adapters],
                  "imported": sorted(m for m in sys.modules if m.endswith("_l2_adapter")),
                  "google": any(m.startswith("google.cloud") for m in sys.modules),
                  "help_lists": [t for t in ("plugin", "fs", "bigtable", "s3")
                                 if t in help_text]}))
"""


def probe(adapters: list[dict[str, Any]], *, install: bool) -> dict[str, Any]:
    args: list[str] = []
    for adapter in adapters:
        args += ["--l2-adapter", json.dumps(adapter)]
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(args), "1" if install else "0"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_only_the_named_adapters_are_imported_and_they_parse_as_in_lmcache() -> None:
    loaded = probe([PLUGIN, FS], install=True)
    plain = probe([PLUGIN, FS], install=False)
    assert loaded["installed"] is True
    assert loaded["configs"] == plain["configs"]  # the same config classes, in order
    assert [n.rsplit(".", 1)[-1] for n in loaded["imported"]] == ["fs_l2_adapter",
                                                                   "plugin_l2_adapter"]
    assert not loaded["google"]
    assert loaded["help_lists"] == plain["help_lists"] == ["plugin", "fs", "bigtable", "s3"]
    # LMCache alone imports them all (Bigtable's Google client included): what this saves
    assert BIGTABLE in plain["imported"] and plain["google"]


def test_a_type_without_a_module_of_its_name_is_left_to_lmcache() -> None:
    assert adapter_loading.module_of("plugin") == f"{adapter_loading.PACKAGE}.plugin_l2_adapter"
    assert adapter_loading.module_of("no_such_type") is None
    assert adapter_loading.module_of("../x") is None  # never a path
    assert adapter_loading.adapter_types([PLUGIN, FS, PLUGIN, "not json", {"type": 3}]) == [
        "plugin", "fs"]


def test_help_and_changed_pins_leave_lmcache_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    assert adapter_loading.install(["--help"], [PLUGIN]) is False
    feature = pins.FEATURES["adapter_loading"]
    module, qualname, _ = feature.sources[0]
    monkeypatch.setitem(pins.FEATURES, "adapter_loading", pins.Feature(
        feature.name, feature.purpose, feature.if_off,
        ((module, qualname, "0" * 16), *feature.sources[1:])))
    pins.available.cache_clear()
    try:
        assert adapter_loading.install([], [PLUGIN]) is False
    finally:
        monkeypatch.undo()
        pins.available.cache_clear()
