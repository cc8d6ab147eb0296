"""The connector's scheduler side, in vLLM's EngineCore process: when a lookup is answered,
waited for or abandoned (``side``, ``lookup_deadline``), and an engine that attaches to a
server started after it (``late_attach``).  Imports the connector's shared modules, never
``worker/``."""
