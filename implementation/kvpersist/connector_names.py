"""Names under which vLLM loads the kvpersist connector (kept apart from ``connector.py``,
which imports vLLM and LMCache, so launchers can use them without those imports)."""

CONNECTOR_CLASS = "KvPersistConnector"
CONNECTOR_MODULE = "kvpersist.connector"
