"""kvpersist's vLLM KV connector, by the vLLM process it runs in.

* Both sides: ``kv_connector`` (the class vLLM loads through :mod:`kvpersist.connector`),
  ``gate`` (whether this instance may cache; free of vLLM imports), ``request_keys`` (what a
  request adds to LMCache's key), ``metrics`` (the connector's numbers in vLLM's ``/metrics``),
  ``heartbeat``.
* ``scheduler/``: the EngineCore's side (lookups, their deadline, late attach).
* ``worker/``: each worker's side (waits for the server, the load and store fences, the served
  prefix of a cut restore).

Inputs: vLLM's config and the pins file (the identity), the server's sockets.  Imports the
shared serving modules and the fence, never ``server/`` or ``launcher/``; this ``__init__``
imports nothing, so ``gate`` loads without vLLM.
"""
