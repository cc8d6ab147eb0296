"""The operator's side: ``kvp-admin`` (``cli/``, one module per command) and what it computes,
from the disk: ``report``, ``budget`` (cap, ceiling, quotas), ``retention`` (the cleanup plan),
``cleanup`` (applying it), ``verify`` (scrub), ``metrics`` (Prometheus text), ``preflight``.
The inventory and its walkers belong to :mod:`kvpersist.l2` (the server's start-up scan uses
them too).  Depends on every other package; none depends on it.
"""
