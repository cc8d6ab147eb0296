"""L1 as a window, not a precondition: kvpersist's changes to LMCache 0.5.6's restore path.

LMCache's server restores a prefix only if all of it fits in *free* L1 at once: the prefetch
reserves each row's L1 buffers all or nothing, nothing is evicted to make room, and a row that
does not fit drops every L2 chunk of the hit.  This package, installed in the server by
:mod:`kvpersist.serving.server.entry` before LMCache builds anything, changes that in four
places and nowhere else (the rules are :mod:`kvpersist.serving.restore_window`), one module
each: :mod:`.eviction`, :mod:`.lookup_window`, :mod:`.streamed_retrieve`, :mod:`.abandoned`;
:mod:`.state` holds what they share, :mod:`.route` the served-prefix route, :mod:`.install`
the replacements:

1. **Eviction on demand** (each L1 manager's ``reserve_write``): a reservation that runs out of
   memory evicts *clean* objects (ones an L2 adapter reported stored) that nobody holds, oldest
   first, and tries again; what still does not fit is reserved as the longest prefix of each
   row that fits (never all-or-nothing), so a restore gets the longest prefix L1 can take.
2. **A lookup window** (the prefetch controller's ``_plan_load``, for lookups of models whose
   engines registered in ``lmcache_driven`` mode): the lookup loads only the first window of the
   prefix from L2 and returns the rest of its L2 locks; the hit it reports
   (``LookupModule._consume_prefetch_result``) is the whole present prefix once that window
   landed.  The session records only what the lookup locked, so LMCache's own lock releases
   stay exact.
3. **A streamed retrieve** (``LMCacheDrivenTransferModule.retrieve``): the locked columns are
   handed over as LMCache would; the deferred ones are loaded window by window through
   LMCache's own prefetch (verified reads, L1 locks), each handed over with LMCache's own
   retrieve and released before the window after the next.  A window that does not load in full
   (a bad file, a deleted file) ends the retrieve as failed, never serving a hole; the chunks
   already handed over are recorded (``restore_window.SERVED_ROUTE``), so the worker's
   :mod:`kvpersist.serving.connector.worker.served_prefix` reports only the blocks from the
   failed chunk on and vLLM recomputes from there, not the whole prefix.
4. **An abandoned lookup is released** (``LookupModule.free_lookup_locks``): a prefetch still
   running when the connector gives its lookup up is settled in the background when it
   finishes, instead of holding its L1 buffers until the read-lock TTL (300 s).

``engine_driven`` retrieves hand the engine L1 buffers it copies itself, all in one reply, so
they cannot stream in this version: their lookups are never windowed and get the longest
prefix that fits (1.), with the shortfall logged and counted (``cut_short``).

:data:`FEATURE` (``l1_window`` in :mod:`..pins`) lists every LMCache function these hooks rely
on, pinned by source: when one changed, :func:`install` installs nothing, and the server keeps
LMCache's own restore path (the contract test fails first).
"""

from .install import FEATURE, install
from .state import WindowState

__all__ = ["FEATURE", "WindowState", "install"]
