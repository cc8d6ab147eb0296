"""The cache server: the LMCache MP server's process and the commands that run it.

* Inside the server process: ``entry`` (its main, ``python -m kvpersist.serving.server.entry``,
  LMCache's ``lmcache server`` under kvpersist's policy), which installs the fence's server
  features (Unix sockets, the L1 window, adapter loading, fault injection in tests) before
  LMCache builds anything; ``cpu_priority`` and ``restore_metrics`` (the window's counters).
* Its log's own process: ``log_relay`` (a pipe to ``lmcache-server.log``).
* In the controlling command (``kvp-server``, ``kvp-admin``, the tests): ``lifecycle`` (command
  line, start, health, stop) and ``private_paths`` (the server's paths private to its account).

Inputs: the validated :class:`kvpersist.config.server.ServerSettings`.  Imports the shared
serving modules and the fence, never ``connector/`` or ``launcher/``.
"""
