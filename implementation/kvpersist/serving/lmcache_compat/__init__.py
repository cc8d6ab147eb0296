"""The fence around LMCache's and vLLM's internals: the only code of kvpersist that reads their
private attributes or replaces, wraps or re-binds their functions.

Everything else in kvpersist uses LMCache and vLLM through their public APIs (the L2 adapter
protocol, the KV connector base class, the server's command line) or calls this package.

* :mod:`.pins`: every internal function relied upon, pinned by a digest of its source, grouped in
  features; the versions they were taken from; which features are safe to run without.
* :mod:`.status`: the server's ``/status`` document, read in one place.
* :mod:`.adapters`: the MP worker and scheduler adapters' private state (heartbeat, timeouts,
  transfers in flight, deferred registration) and the request tracker.
* :mod:`.pickle_transport`: the engine_driven transport's four waits, re-bound.
* :mod:`.unix_endpoints`: the server's request and admin endpoints moved onto Unix sockets.
* :mod:`.l1_window`: the server's restore path changed so that L1 is a window.

Invariants
----------
* A patch is installed only when :func:`.pins.available` says its feature's pinned sources match
  the installed code; otherwise LMCache's own behaviour stays, one log line names what changed,
  and where that would be unsafe (:func:`.pins.unsafe_reasons`) the connector's gate closes.
* Importing this package imports neither LMCache nor vLLM; its submodules do so when used.
"""
