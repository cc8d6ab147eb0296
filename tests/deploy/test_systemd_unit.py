"""The systemd unit for the server: hardened as promised, matched to the server's timeouts and to
the site configuration it names, and accepted without a warning by ``systemd-analyze verify``
(with the example drop-in)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvpersist.config.envfile import parse_env_lines
from kvpersist.config.server import DEFAULTS

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "configs" / "systemd" / "kvp-server.service"
METRICS_UNIT = REPO / "configs" / "systemd" / "kvp-metrics.service"
DROP_IN = REPO / "configs" / "systemd" / "kvp-server.service.d" / "example.conf"
INSTALLED_EXEC = "/opt/kvpersist/venv/bin/kvp-server"
SITE = REPO / "configs" / "systemd" / "kvpersist.env"


def site_settings() -> dict[str, str]:
    return {k: v for _, k, v in parse_env_lines(SITE.read_text(), str(SITE))}


def directives(path: Path) -> dict[str, dict[str, list[str]]]:
    """Section -> key -> every value (systemd keys may repeat)."""
    out: dict[str, dict[str, list[str]]] = {}
    section = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            out.setdefault(section, {})
            continue
        key, _, value = line.partition("=")
        out[section].setdefault(key, []).append(value)
    return out


def test_unit_is_hardened_and_matches_the_server_settings() -> None:
    service = directives(UNIT)["Service"]
    one = {k: v[-1] for k, v in service.items()}
    assert one["User"] not in ("", "root") and one["Group"] not in ("", "root")
    assert one["UMask"] == "0077"
    assert one["ProtectSystem"] == "strict"
    assert one["NoNewPrivileges"] == "yes" and one["PrivateTmp"] == "yes"
    env = dict(item.split("=", 1) for value in service["Environment"] for item in value.split())
    site = site_settings()
    assert env["KVP_CONFIG"] == "/etc/kvpersist/kvpersist.env"  # and no setting of its own
    assert service["ReadWritePaths"] == [site["KVP_CACHE_ROOT"]]  # the cache root only
    assert site["KVP_ACCESS"] == "unix"
    assert site["KVP_RUNTIME_DIR"] == "/run/" + one["RuntimeDirectory"]
    assert one["RuntimeDirectoryMode"] == "0700"
    assert env["LMCACHE_TRACK_USAGE"] == "false" and env["DO_NOT_TRACK"] == "1"
    assert float(one["TimeoutStopSec"]) == float(DEFAULTS["KVP_STOP_TIMEOUT_S"])
    assert float(one["TimeoutStartSec"]) == float(DEFAULTS["KVP_START_TIMEOUT_S"])
    assert one["ExecStart"] == f"{INSTALLED_EXEC} run" and one["Type"] == "simple"


def test_drop_in_moves_the_writable_path_with_the_root() -> None:
    """The drop-in holds what systemd needs (the writable path, the group), the settings stay
    in the site file: the example's root and group are the ones its comment tells the site
    file to say."""
    service = directives(DROP_IN)["Service"]
    assert "Environment" not in service
    text = DROP_IN.read_text()
    root = service["ReadWritePaths"][1]
    assert service["ReadWritePaths"] == ["", root]  # reset, then the new root
    assert "KVP_CACHE_ROOT in the" in text and root in text
    assert service["RuntimeDirectoryMode"] == ["0750"]
    # systemd gives the runtime directory the service's group: it must be the access group
    assert f"KVP_ACCESS_GROUP={service['Group'][0]}" in text


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed (Debian: apt-get install systemd)")
@pytest.mark.parametrize("unit_file", [UNIT, METRICS_UNIT], ids=lambda p: p.name)
def test_systemd_analyze_verify_accepts_units_and_drop_in(tmp_path: Path, unit_file: Path) -> None:
    bin_dir = Path(sys.executable).parent
    unit = tmp_path / unit_file.name
    text = unit_file.read_text()
    for tool in ("kvp-server", "kvp-admin"):
        assert (bin_dir / tool).exists(), bin_dir / tool
        text = text.replace(f"/opt/kvpersist/venv/bin/{tool}", str(bin_dir / tool))
    unit.write_text(text)
    if unit_file == UNIT:
        (tmp_path / f"{UNIT.name}.d").mkdir()
        shutil.copy(DROP_IN, tmp_path / f"{UNIT.name}.d" / DROP_IN.name)
    done = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path,
                          env={"SYSTEMD_UNIT_PATH": f"{tmp_path}:", "PATH": "/usr/bin:/bin"})
    # verify exits 0 on unknown keys and unparsable values (it only warns): no output at all
    assert done.returncode == 0 and done.stdout + done.stderr == "", done.stdout + done.stderr


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_verify_would_catch_a_typo(tmp_path: Path) -> None:
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace(INSTALLED_EXEC, "/bin/true")
                    .replace("TimeoutStopSec=30", "TimeoutStopSec=thirty"))
    done = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path,
                          env={"SYSTEMD_UNIT_PATH": f"{tmp_path}:", "PATH": "/usr/bin:/bin"})
    assert "thirty" in done.stdout + done.stderr
