"""The connector's worker side, in each vLLM worker process: how long a worker waits for the
server (``transfer_wait``), when a transfer into vLLM's KV memory may be reported finished
(``load_fence``, ``store_fence``, ``server_process``), and what a cut restore served
(``served_prefix``).  Imports the connector's shared modules, never ``scheduler/``."""
