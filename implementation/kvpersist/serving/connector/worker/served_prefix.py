"""A restore the server cut short keeps what it served: the worker's side of the cut.

A streamed restore (:mod:`kvpersist.serving.lmcache_compat.l1_window`) that meets a file failing its check
in the middle has already written its first chunks into vLLM's KV memory, each by a completed
LMCache retrieve.  LMCache's worker adapter turns the failed reply into load errors for *every*
block of the retrieve, so vLLM would recompute the whole prefix.  The server records how many
chunks it handed over before it sends the failed reply; this module asks it, and takes those
chunks' blocks out of the load errors, so vLLM truncates the hit at the failed chunk (its
``_update_requests_with_invalid_blocks``) and recomputes only from there.

Invariants
----------
* Blocks leave the load errors only on the server's own record of that request's latest
  retrieve by this worker instance (the record names both; a retrieve clears it first).
* Only single-group engines: their load errors are block ids of one block list, in token order
  from the retrieve's first chunk.  A multi-group engine reports failed requests, not blocks,
  and its failure stays whole.
* Any doubt (no answer, no record, a malformed answer, a record covering every block) keeps
  LMCache's errors unchanged: the whole load is recomputed, which is always correct.
* A load reported failed because its server is gone is never asked about (it is not passed
  here): nothing answers for what a dead server wrote.
"""

from __future__ import annotations

import logging
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ... import http
from ...restore_window import SERVED_ROUTE, served_blocks

logger = logging.getLogger("vllm.kvpersist.served_prefix")  # inherits vLLM's log handler
ASK_TIMEOUT_S = 2.0
Fetch = Callable[[str], "dict[str, Any] | None"]


def _ask(url: str) -> dict[str, Any] | None:
    return http.get_object(url, timeout=ASK_TIMEOUT_S)


class ServedPrefixKeeper:
    """Keeps the served chunks of failed retrieves out of one worker adapter's load errors."""

    def __init__(self, adapter: Any, server_url: str | None, fetch: Fetch = _ask) -> None:
        self._adapter = adapter
        self._url = server_url.rstrip("/") if server_url else None
        self._fetch = fetch
        self.kept_chunks = 0  # chunks of failed restores kept, since start

    def served_chunks(self, request_id: str) -> int | None:
        """The chunks the server handed over in this worker's failed retrieve of
        ``request_id``, or None where it has no such record or does not answer."""
        if self._url is None:
            return None
        instance = int(self._adapter.instance_id)
        url = self._url + SERVED_ROUTE.replace(":path", "").format(
            request_id=urllib.parse.quote(request_id, safe=""), instance_id=instance)
        answer = self._fetch(url)
        if answer is None or answer.get("request_id") != request_id \
                or answer.get("instance_id") != instance:
            return None
        served = answer.get("served_chunks")
        return served if isinstance(served, int) and served >= 0 else None

    def keep(self, failed: Mapping[str, Sequence[int]]) -> None:
        """For each retrieve the server answered failed (request id -> its block ids), take the
        blocks of the chunks it served out of the adapter's load errors."""
        adapter = self._adapter
        if not failed or len(getattr(adapter, "engine_group_infos", ()) or ()) > 1:
            return
        per_chunk = int(adapter.blocks_in_chunk)
        for request_id, blocks in failed.items():
            served = self.served_chunks(request_id)
            if not served or served * per_chunk >= len(blocks):
                continue
            # LMCache's get_finished put every block in; the blocks after these stay errors
            adapter.error_block_ids.difference_update(served_blocks(blocks, served, per_chunk))
            self.kept_chunks += served
            logger.warning("kvpersist: request %s: the restore failed after %d chunk(s) were "
                           "written; vLLM keeps those and recomputes from the failed chunk on",
                           request_id, served)
