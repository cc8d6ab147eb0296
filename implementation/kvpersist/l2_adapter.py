"""The module path of earlier releases: configs that name ``kvpersist.l2_adapter`` keep working.
The adapter lives in :mod:`kvpersist.l2.adapter`."""

from .l2.adapter import KvPersistL2Adapter, KvPersistL2AdapterConfig

__all__ = ["KvPersistL2Adapter", "KvPersistL2AdapterConfig"]
