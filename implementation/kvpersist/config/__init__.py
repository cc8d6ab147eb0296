"""Configuration: every ``KVP_*`` setting and ``kvpersist.*`` connector option, typed and
validated in one place (``values`` parses, ``server``/``client``/``admin`` group them), the
templates as package data, and the environment of the processes kvpersist starts.

Nothing here imports another kvpersist package: configuration is the bottom layer.
"""

from .server import ServerSettings, load_settings
from .values import SettingsError

__all__ = ["ServerSettings", "SettingsError", "load_settings"]
