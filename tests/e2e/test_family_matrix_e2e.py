"""The architecture matrix's fixed core in CI (the whole matrix: ``scripts/family-matrix.sh``,
docs/models.md): tiny random-weight checkpoints through ``write-pins``, ``kvp-server`` and
``kvp-vllm``, both processes restarted between a cold and a restored answer.

* DeepSeek-V3 style MLA (bfloat16, an MoE) with its multi-token-prediction (MTP) layer as the
  speculative draft: on a host with AMX, every full chunk from L2, bit-identical to cold, each
  chunk file holding the MTP layer's latent KV beside the target's three layers; without the
  re-pointing of MLA's layer views (``lmcache_compat.kv_views``) the restored answer of an MLA
  model differed from its first token (measured on DeepSeek-V2, the reason MLA is in the core).
  On a host without AMX (an AMD EPYC CI host) vLLM runs MLA on its reference kernel, which
  cannot continue a prefill from cached KV: the gate refuses it by name, and the pins writer
  names the block size vLLM forces there (16).
* Llama with an EAGLE-3 head (speculative decoding with a draft model reading three of the
  target's hidden states): cached under the draft's digest, every full chunk from L2
  bit-identical to cold, each chunk file holding the head's KV layer beside the target's two,
  the head drafting in both rounds.  (Whether a restored draft KV is the stored one shows only
  in the acceptance rate, and a random draft's proposals are never accepted: that check is a
  GPU run's, docs/models.md.)  EAGLE, DeepSeek-V2 and n-gram proposers (which add no KV and
  keep the target's namespace, ``tests/serving/test_connector_gate.py``) are in the whole
  matrix.

The refused families (window groups, recurrent state) are left to the whole matrix: their gate
refusals are unit-tested on vLLM's real configs, and a closed gate serving vLLM is shown end to
end by ``test_late_attach_e2e.py``; CI's 30 minutes are spent on what only a restore shows.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpersist.demo.tiny_families import FAMILIES
from kvpersist.l2.format import HEADER_SIZE
from kvpersist.testing.family_matrix import run_matrix

pytestmark = pytest.mark.e2e

CORE = ("deepseek-v3-mtp", "llama-eagle3")
#: A full chunk of the tiny Llama with its EAGLE-3 head: 256 tokens x (2 target layers + 1 draft
#: layer) x K and V x 2 KV heads x 32 x 4 bytes (float32), after the file's header.
EAGLE3_CHUNK_PAYLOAD = 256 * 3 * 2 * 2 * 32 * 4
#: A full chunk of the tiny DeepSeek-V3 with its MTP layer: 256 tokens x (3 target layers + 1
#: MTP layer) x a latent of 512 + 64 x 2 bytes (bfloat16), after the file's header.
MTP_CHUNK_PAYLOAD = 256 * 4 * (512 + 64) * 2


def test_the_core_families_are_cached_exactly(tmp_path: Path) -> None:
    results = run_matrix([FAMILIES[name] for name in CORE], tmp_path / "models", tmp_path)
    report = "\n".join(f"{r.family}: {r.outcome} {r.problems} {r.gate_line[-200:]}"
                       for r in results)
    for r in results:
        assert r.passed, report
    cached = {r.family: r for r in results if r.outcome == "cached"}
    # on a host without AMX the MLA family is refused by name (family_matrix.for_this_host)
    assert set(cached) == {r.family for r in results if r.expect == "cached"}, report
    assert "llama-eagle3" in cached, report
    for r in cached.values():  # the judgement had something to judge
        assert r.full_chunks >= 3 and r.restored_tokens == 256 * r.full_chunks, report
        assert r.identical is True, report
        assert len(r.spec_drafted) == 2 and min(r.spec_drafted) > 0, report  # it drafted
    assert cached["llama-eagle3"].chunk_bytes == HEADER_SIZE + EAGLE3_CHUNK_PAYLOAD, report
    if "deepseek-v3-mtp" in cached:
        assert cached["deepseek-v3-mtp"].chunk_bytes == HEADER_SIZE + MTP_CHUNK_PAYLOAD, report
