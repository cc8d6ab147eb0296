"""The site configuration file: one ``KEY=value`` file every kvpersist command reads.

Invariants
----------
* The file is ``$KVP_CONFIG`` when that is set (a missing file is an error), else
  :data:`DEFAULT_SITE_CONFIG` when it exists, else there is none; the file an older release
  read (:data:`LEGACY_SITE_FILE`) left alone without a site file is an error, so settings are
  never dropped silently by an upgrade.
* Precedence, the same for every command: a command-line value > the process environment (a
  variable set and not empty) > the site file > the registry's default.
* Every key in the file is a setting of :mod:`.registry`; an unknown or retired key is a
  :class:`SettingsError` naming the file and line (a typo never goes unnoticed), and a retired
  name in the environment is one too.
* The file is read on every call (a command reads it once at start); it never holds secrets
  beyond paths (a serde's key stays in its own file).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from pathlib import Path

from .envfile import EnvLineError, parse_env_lines
from .registry import BY_NAME, RETIRED
from .values import SettingsError

CONFIG_VARIABLE = "KVP_CONFIG"
DEFAULT_SITE_CONFIG = Path("/etc/kvpersist/kvpersist.env")
#: What kvpersist 0.1 read next to the units (EnvironmentFile=); no command reads it now.
LEGACY_SITE_FILE = Path("/etc/kvpersist/lmcache-server.env")


def site_config_path(environ: Mapping[str, str] | None = None) -> Path | None:
    """The site file in force, or None (see the module invariants)."""
    env = os.environ if environ is None else environ
    named = env.get(CONFIG_VARIABLE, "").strip()
    if named:
        path = Path(named).expanduser()
        if not path.is_file():
            raise SettingsError(f"{CONFIG_VARIABLE}={named}: no such file (the site "
                                "configuration; unset KVP_CONFIG to run without one)")
        return path
    if DEFAULT_SITE_CONFIG.is_file():
        return DEFAULT_SITE_CONFIG
    if LEGACY_SITE_FILE.is_file():
        raise SettingsError(f"{LEGACY_SITE_FILE} is no longer read: move its settings to the "
                            f"site configuration {DEFAULT_SITE_CONFIG} (the same KEY=value "
                            "lines) and remove it; see docs/upgrading.md")
    return None


def read_site_config(path: Path) -> dict[str, str]:
    """The file's settings; SettingsError names a malformed line or an unknown key."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SettingsError(f"cannot read the site configuration {path}: {exc.strerror}"
                            ) from None
    found: dict[str, str] = {}
    try:
        for lineno, key, value in parse_env_lines(text, str(path)):
            if key in RETIRED:
                raise SettingsError(f"{path}:{lineno}: {RETIRED[key]}")
            if key not in BY_NAME or key == CONFIG_VARIABLE:
                near = difflib.get_close_matches(key, list(BY_NAME), n=1)
                hint = f"; did you mean {near[0]}?" if near else ""
                raise SettingsError(f"{path}:{lineno}: {key} is not a kvpersist setting{hint} "
                                    "(docs/configuration.md lists them)")
            found[key] = value
    except EnvLineError as exc:
        raise SettingsError(str(exc)) from None
    return found


def check_retired(environ: Mapping[str, str]) -> None:
    """SettingsError when the environment sets a retired name."""
    for name, message in RETIRED.items():
        if environ.get(name):
            raise SettingsError(message)


def effective_environ(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default: this process's) over the site file's settings: what every loader
    of settings reads.  A variable that is empty in the environment leaves the file's value."""
    env = os.environ if environ is None else environ
    check_retired(env)
    path = site_config_path(env)
    merged = read_site_config(path) if path is not None else {}
    merged.update({k: v for k, v in env.items() if v != "" or k not in merged})
    return merged
