"""A stateful, property-based model of the L2 store (issue 35): random puts, reads, deletes,
evictions and restarts (with and without the index snapshot), each possibly under an injected
system-call fault (:mod:`kvpersist.testing.syscall_faults`), over keys drawn from the whole
space of model ids, salts and adapters' derived salts.  After every step the store's
``check()`` is clean and its index equals an oracle: a dict of what must be stored.

CI runs a fixed seed and a small budget; a longer run::

    KVP_MODEL_EXAMPLES=2000 KVP_MODEL_STEPS=60 .venv/bin/python -m pytest -q \\
        tests/l2/test_store_model.py
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule

from kvpersist.l2.format import HEADER_SIZE
from kvpersist.l2.layout import KeyFields, is_temp_name
from kvpersist.l2.store import READ_ERRORS_TO_QUARANTINE, KvFileStore
from kvpersist.testing.syscall_faults import FAULTS, Fault, injected

NS = "kvp-" + "d" * 32
#: Model ids as operators name them, the issue's included (``--`` in them, a local folder).
MODEL_IDS = ["org/model", "team--x/chat--v2", "a-/b", "a/-b", "100%/m", "local/folder/m",
             "m" * 150]
#: Salts as users choose them, and as kvpersist derives them for LoRA adapters.
SALTS = ["", "team.tmp.a", "user/7", "50%", "s" * 100, "u" * 120,
         "kvpk-lora0123456789ab-" + "f" * 32]

keys = st.builds(
    lambda model_id, salt, rank, group, chunk: KeyFields(
        f"{model_id}/{NS}", rank, group, chunk.to_bytes(32, "big"), salt),
    st.sampled_from(MODEL_IDS), st.sampled_from(SALTS), st.sampled_from([0, 0x01000100]),
    st.sampled_from([0, 1]), st.integers(0, 3))


#: Faults by the operation they hit (the others leave it alone, which the model checks too).
READ_FAULTS = [f for f in FAULTS if f.call in ("open-read", "read")]
WRITE_FAULTS = [f for f in FAULTS if f.call in ("open-write", "write", "rename")]
OTHER_FAULTS = [f for f in FAULTS if f.call == "unlink"]


def payload_of(key: KeyFields, size: int) -> bytes:
    seed = hash(key) & 0xFF
    return bytes((seed + i * 7) % 251 for i in range(size))


class StoreModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="kvp-model-")) / "root"
        self.snapshot = True
        self.store = self._open()
        self.oracle: dict[KeyFields, bytes] = {}
        self.media_errors: dict[KeyFields, int] = {}

    def _open(self) -> KvFileStore:
        # O_DIRECT reads and writes, as the adapter's default (buffered where refused)
        store = KvFileStore(self.root, 10**9, scan_snapshot=self.snapshot, direct_io=True)
        store.open(background_scan=False)
        return store

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.root.parent, ignore_errors=True)

    # -- operations, each with its expected outcome
    def _put(self, key: KeyFields, size: int, fault: Fault | None) -> None:
        payload = payload_of(key, size)
        result = self.store.put(key, payload)
        if key in self.oracle:
            assert result == "exists", result
        elif fault is not None and fault.call in ("open-write", "write", "rename"):
            assert result in ("error", "rejected-disk-full"), (fault, result)
        else:
            assert result == "stored", result
            self.oracle[key] = payload

    def _read(self, key: KeyFields, fault: Fault | None) -> None:
        want = self.oracle.get(key)
        buf = bytearray(len(want) if want is not None else 1024)
        hit = self.store.read_into(key, buf)
        reads_fail = fault is not None and fault.call in ("open-read", "read")
        if want is None or reads_fail:
            assert not hit
        else:
            assert hit and bytes(buf) == want
            self.media_errors.pop(key, None)
        if want is not None and fault is not None and fault.call == "read":
            streak = self.media_errors.get(key, 0) + 1
            self.media_errors[key] = streak
            if streak >= READ_ERRORS_TO_QUARANTINE:  # quarantined: gone, the next put repairs
                del self.oracle[key]
                del self.media_errors[key]

    def _delete(self, key: KeyFields, fault: Fault | None) -> None:
        size = self.store.delete(key)
        if fault is not None and fault.call == "unlink" and key in self.oracle:
            assert size is None  # nothing changed: the file and its count stay
            return
        want = self.oracle.pop(key, None)
        self.media_errors.pop(key, None)
        assert (size is None) == (want is None)
        if want is not None:
            assert size == HEADER_SIZE + len(want)

    # -- rules: keys put before are drawn again (``stored``), so reads, deletes and faults hit
    # files that exist as often as keys that do not
    stored = Bundle("stored")

    @rule(target=stored, key=keys, size=st.sampled_from([512, 4096]))
    def put(self, key: KeyFields, size: int) -> KeyFields:
        self._put(key, size, None)
        return key

    @rule(key=stored, size=st.sampled_from([512, 4096]))
    def put_again(self, key: KeyFields, size: int) -> None:
        self._put(key, size, None)

    @rule(key=st.one_of(stored, keys))
    def read(self, key: KeyFields) -> None:
        self._read(key, None)

    @rule(key=st.one_of(stored, keys))
    def delete(self, key: KeyFields) -> None:
        self._delete(key, None)

    @precondition(lambda self: bool(self.oracle))
    @rule()
    def evict_oldest(self) -> None:
        oldest = self.store.index.ordered()[0][0]
        self._delete(oldest, None)

    @rule(fault=st.sampled_from(READ_FAULTS + OTHER_FAULTS), key=st.one_of(stored, keys))
    def read_under_fault(self, fault: Fault, key: KeyFields) -> None:
        with injected(fault):
            self._read(key, fault)

    @rule(key=stored, count=st.integers(1, READ_ERRORS_TO_QUARANTINE + 1))
    def media_errors_in_a_row(self, key: KeyFields, count: int) -> None:
        """A device failing one file's payload again and again: quarantined at the limit."""
        with injected(Fault("read", errno.EIO)):
            for _ in range(count):
                self._read(key, Fault("read", errno.EIO))

    @rule(fault=st.sampled_from(WRITE_FAULTS + OTHER_FAULTS), key=st.one_of(keys, stored),
          size=st.sampled_from([512, 4096]))
    def put_under_fault(self, fault: Fault, key: KeyFields, size: int) -> None:
        with injected(fault):
            self._put(key, size, fault)

    @rule(fault=st.sampled_from(FAULTS), key=stored)
    def delete_under_fault(self, fault: Fault, key: KeyFields) -> None:
        with injected(fault):
            self._delete(key, fault)

    @rule(snapshot=st.booleans())
    def restart(self, snapshot: bool) -> None:
        self.store.close()
        self.snapshot = snapshot
        self.store = self._open()
        self.media_errors.clear()  # counted in a row within one server's life
        assert self.store.scan_error is None

    # -- what must hold after every step
    @invariant()
    def index_is_the_oracle_and_check_is_clean(self) -> None:
        assert set(self.store.index.snapshot()) == set(self.oracle)
        assert self.store.used_bytes == sum(HEADER_SIZE + len(p) for p in self.oracle.values())
        assert self.store.check() == []
        assert [n for n in os.listdir(self.root) if is_temp_name(n)] == []


StoreModel.TestCase.settings = settings(
    max_examples=int(os.environ.get("KVP_MODEL_EXAMPLES", "40")),
    stateful_step_count=int(os.environ.get("KVP_MODEL_STEPS", "40")),
    deadline=None, derandomize=True, database=None)
TestStoreModel = StoreModel.TestCase
