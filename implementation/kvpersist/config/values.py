"""Typed parsers for setting values, one per kind, shared by every place that reads a setting.

Invariant: each parser returns a value of its type or raises :class:`SettingsError` whose
message names the setting, shows the bad value and says what is expected.  Booleans are read
the same way everywhere (``1/true/yes/on`` and ``0/false/no/off``, any case); anything else is an
error, never silently false.
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Mapping


class SettingsError(ValueError):
    """A setting is invalid; the message says which and how to fix it."""


TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def present(environ: Mapping[str, str], name: str) -> str | None:
    """``environ[name]`` when set and not empty (an empty variable means "use the default")."""
    value = environ.get(name)
    return value if value not in (None, "") else None


def boolean(name: str, raw: object) -> bool:
    if isinstance(raw, bool):
        return raw
    low = str(raw).strip().lower()
    if low in TRUE_WORDS:
        return True
    if low in FALSE_WORDS:
        return False
    raise SettingsError(f"{name}={raw!r} must be true or false (1/0, yes/no, on/off)")


def number(name: str, raw: object) -> float:
    if isinstance(raw, bool):
        raise SettingsError(f"{name}={raw!r} is not a number")
    try:
        value = float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise SettingsError(f"{name}={raw!r} is not a number; e.g. 1500") from None
    return value


def positive_float(name: str, raw: object) -> float:
    value = number(name, raw)
    if not math.isfinite(value) or value <= 0:
        raise SettingsError(f"{name}={raw!r} must be a positive finite number")
    return value


def fraction(name: str, raw: object) -> float:
    value = positive_float(name, raw)
    if value >= 1:
        raise SettingsError(f"{name}={raw!r} must be between 0 and 1 (exclusive)")
    return value


def integer(name: str, raw: object, *, minimum: int) -> int:
    if isinstance(raw, bool):
        raise SettingsError(f"{name}={raw!r} is not an integer")
    if isinstance(raw, int):
        value = raw
    else:
        try:
            value = int(str(raw).strip(), 10)
        except ValueError:
            raise SettingsError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise SettingsError(f"{name}={raw!r} must be at least {minimum}")
    return value


def positive_int(name: str, raw: object) -> int:
    return integer(name, raw, minimum=1)


def port(name: str, raw: object) -> int:
    try:
        value = integer(name, raw, minimum=1)
    except SettingsError:
        raise SettingsError(f"{name}={raw!r} is not a port number (a TCP port in 1..65535)") from None
    if value > 65535:
        raise SettingsError(f"{name}={raw!r} must be a TCP port in 1..65535")
    return value


def host(name: str, raw: object) -> str:
    text = str(raw).strip()
    if text == "localhost":
        return text
    try:
        ipaddress.ip_address(text)
    except ValueError:
        raise SettingsError(f"{name}={raw!r} must be an IP address (e.g. 127.0.0.1)") from None
    return text


def choice(name: str, raw: object, options: tuple[str, ...]) -> str:
    text = str(raw).strip()
    if text not in options:
        raise SettingsError(f"{name}={raw!r} must be one of {', '.join(options)}")
    return text


def is_loopback(address: str) -> bool:
    return address == "localhost" or ipaddress.ip_address(address).is_loopback
