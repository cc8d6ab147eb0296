"""kvpersist: a persistent, verified KV-cache tier for vLLM through LMCache's MP server."""

__version__ = "0.1.0"
