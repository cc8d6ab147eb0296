"""The persistent L2 tier: one verified file per LMCache chunk under ``KVP_CACHE_ROOT``.

``layout`` (names, shards, quarantine) and ``format`` (the header) describe the files; ``files``
publishes, reads with verification and quarantines one file; ``index`` keeps the accounting;
``scan`` and ``inventory`` (with its C walker ``_walk.c``) read a tree; ``lock`` keeps one writer
per root; ``store`` is the facade over them and ``adapter`` the LMCache plugin over the store.
Depends on :mod:`kvpersist.config` only (and LMCache, in ``adapter``).
"""
