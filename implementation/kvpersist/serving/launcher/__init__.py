"""Starting and driving vLLM from outside: ``kvp_vllm`` (the ``kvp-vllm`` command: vLLM's
OpenAI server with the kvpersist connector, an unchanged recipe) and ``vllm_client`` (a client
of that server and a handle on its process, for the demo, the tests and the benchmarks).
Runs in the operator's shell, never inside vLLM or the cache server; imports ``config`` and
the shared serving modules, never ``server/`` or ``connector/``."""
