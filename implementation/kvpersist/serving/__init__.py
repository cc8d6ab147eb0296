"""Serving: the LMCache server's lifecycle (``server``, ``pidfile``), the one HTTP client
(``http``), the identity gate (``gate``, free of vLLM imports), the vLLM connector
(``connector``) and the launcher (``launcher``, the ``kvp-vllm`` command).
Depends on :mod:`kvpersist.config` and :mod:`kvpersist.identity`.
"""
