"""The module path vLLM loads (``kv_connector_module_path: kvpersist.connector``); deployments
name it, so it stays.  The connector lives in :mod:`kvpersist.serving.connector.kv_connector`."""

from .serving.connector.kv_connector import KvPersistConnector

__all__ = ["KvPersistConnector"]
