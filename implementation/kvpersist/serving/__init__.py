"""Serving: the processes around the cache, one folder per process.

========================  ======================================  ================================
folder                    runs in                                  may import (besides stdlib)
========================  ======================================  ================================
``server/``               the LMCache MP server (``entry`` is its  ``config``, ``identity``, the
                          main; ``log_relay`` its log's process)   fence, the shared modules
                          and the commands that start and stop it  below; LMCache
                          (``lifecycle``: ``kvp-server``,
                          ``kvp-admin``)
``connector/``            vLLM's processes: ``kv_connector`` and   ``config``, ``identity``, the
                          ``gate`` in both; ``scheduler/`` in the  fence, the shared modules;
                          EngineCore; ``worker/`` in each worker   vLLM and LMCache
``launcher/``             ``kvp-vllm`` (vLLM's launcher), and the  ``config``, the shared modules
                          client that drives a vLLM from outside
                          (``vllm_client``: demo, tests, benches)
``lmcache_compat/``       the fence around LMCache's and vLLM's    ``identity``, the shared modules
                          internals, used by the server and the    (never a process folder)
                          connector
shared modules            any of them: ``http`` (the one HTTP      ``config``, ``atomic``
                          client), ``pidfile``, ``restore_window``
                          (the L1 window's rules and the route
                          both sides use), ``shm_sweep``
========================  ======================================  ================================

Process folders never import each other: what two processes share is a shared module or the
fence.  ``tests/test_layers.py`` keeps this table true.  Depends on :mod:`kvpersist.config`
and :mod:`kvpersist.identity`; :mod:`kvpersist.connector` is the module path vLLM loads.
"""
