"""LMCache's engine_driven pickle transport, waiting by kvpersist's policy
(:class:`kvpersist.serving.connector.worker.transfer_wait.ServerWait`) instead of one fixed ``mq_timeout``.

Invariants
----------
* Each replacement is LMCache 0.5.6's method apart from the wait, statement for statement; it is
  installed only when the pinned sources match (feature ``pickle_waits`` of :mod:`.pins`).
* Without an installed policy a replacement waits exactly as LMCache does.
"""

from __future__ import annotations

import contextlib
import pickle
import threading
from collections.abc import Callable
from typing import Any, Protocol

from . import pins


class TransferWait(Protocol):
    """How a worker waits for the server's answers (the connector's
    :class:`kvpersist.serving.connector.worker.transfer_wait.ServerWait`)."""

    def reply(self, future: Any) -> Any: ...

    def receipt(self, future: Any) -> Any: ...


FEATURE = "pickle_waits"
REPLACED = ("prepare_store", "commit_store", "prepare_retrieve", "commit_retrieve")

_installed: TransferWait | None = None
_originals: dict[str, Any] = {}
_install_lock = threading.Lock()


def _policy_result(transport: Any, future: Any, *, restore: bool) -> Any:
    """``future``'s result under the installed policy (LMCache's own timeout without one)."""
    policy = _installed
    if policy is None:
        return future.result(timeout=transport.mq_timeout)
    return policy.reply(future) if restore else policy.receipt(future)


def prepare_store(self: Any, key: Any, instance_id: int) -> Any:
    future = self.req_client.prepare_store(key, instance_id)
    with contextlib.suppress(TimeoutError):
        _policy_result(self, future, restore=False)
    return None


def commit_store(self: Any, key: Any, instance_id: int, chunks: list[Any]) -> bool:
    serialised = pickle.dumps(chunks)
    future = self.req_client.commit_store(key, instance_id, serialised)
    try:
        return bool(_policy_result(self, future, restore=False))
    except TimeoutError:
        return False


def prepare_retrieve(self: Any, key: Any, instance_id: int) -> Any:
    future = self.req_client.prepare_retrieve(key, instance_id)
    try:
        response = _policy_result(self, future, restore=True)
    except TimeoutError:
        return None
    if not response.success or not response.data:
        return None
    return pickle.loads(response.data)


def commit_retrieve(self: Any, key: Any, instance_id: int) -> bool:
    future = self.req_client.commit_retrieve(key, instance_id)
    with contextlib.suppress(TimeoutError):
        _policy_result(self, future, restore=False)
    return True


_REPLACEMENTS: dict[str, Callable[..., Any]] = {
    "prepare_store": prepare_store, "commit_store": commit_store,
    "prepare_retrieve": prepare_retrieve, "commit_retrieve": commit_retrieve}


def install(wait: TransferWait) -> bool:
    """Make LMCache's pickle transport wait by ``wait`` in this process.  Returns False (and
    changes nothing) when LMCache's methods are not the expected ones."""
    global _installed
    from lmcache.v1.multiprocess.transfer_context import pickle as transport

    cls = transport.EngineDrivenContextPickle
    with _install_lock:
        if not _originals:
            if not pins.available(FEATURE):
                return False
            for name in REPLACED:
                _originals[name] = getattr(cls, name)
                setattr(cls, name, _REPLACEMENTS[name])
        _installed = wait
    return True


def uninstall() -> None:
    """Give LMCache its own methods back (tests that install a policy in their own process)."""
    global _installed
    from lmcache.v1.multiprocess.transfer_context import pickle as transport

    with _install_lock:
        for name, method in _originals.items():
            setattr(transport.EngineDrivenContextPickle, name, method)
        _originals.clear()
        _installed = None
