"""Loop the SIGKILL sequence that once restored a logprob differing from cold (issue 49), and
compare every chunk file's KV bytes with a reference store, not only the answer.

The sequence is the one ``tests/e2e/test_service_down_e2e.py`` ran when it failed at
``33f9f29``: a cold chat; vLLM SIGKILLed as soon as the first chunk file is on disk (so later
chunks of the chat are stored, if at all, by the next request's own prefill); a new vLLM asks
again; both processes SIGKILLed; both restarted; the chat again from L2.  Per round it reports
the hits, whether each answer is bit-identical to the reference cold answer, and each chunk file
whose payload (the bytes after the 4 KiB header) differs from the reference run's file of the
same name (same key: same namespace, same tokens).

Usage::

    .venv/bin/python benchmarks/diagnostics/sigkill_payloads.py --rounds 10 --busy 1 \\
        --json /tmp/sigkill-payloads.json

``--busy N`` runs N busy loops beside each round, as CI's second worker loads the host.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvpersist.config.server import ServerSettings, load_settings
from kvpersist.demo.stack import ChatResult, VllmProcess, chat, long_conversation, metric_sum
from kvpersist.demo.tiny_model import build_tiny_model
from kvpersist.l2.format import HEADER_SIZE
from kvpersist.serving.server.lifecycle import start_server, stop_server
from kvpersist.testing.busy_host import busy_loops
from kvpersist.testing.helpers import (
    TINY_PINS,
    chunk_hashes,
    l2_data_files,
    server_env,
    wait_for_l2_files,
    wait_until,
)
from kvpersist.testing.kv_writer import CHUNK_TOKENS
from kvpersist.testing.processes import kill_server


def payloads(root: Path) -> dict[str, str]:
    """File name -> sha256 of its KV bytes (the header, which holds the key and checksum, left
    out), for every chunk file directly in ``root``."""
    return {p.name: hashlib.sha256(p.read_bytes()[HEADER_SIZE:]).hexdigest()
            for p in l2_data_files(root)}


def same(a: ChatResult, b: ChatResult) -> bool:
    return a.tokens == b.tokens and a.logprobs == b.logprobs


def hits(vllm: VllmProcess) -> int:
    return int(metric_sum(vllm.metrics(), "vllm:external_prefix_cache_hits_total"))


def reference(model: Path, work: Path, messages: list[dict[str, str]]
              ) -> tuple[ChatResult, dict[str, str]]:
    """The cold answer and every full chunk's payload, stored with nothing killed."""
    env = server_env(work / "cache-ref", KVP_CACHE_BUDGET_GB="1", KVP_L2_ADAPTER="kvpersist")
    settings = load_settings(env)
    vllm = VllmProcess(model, TINY_PINS, work / "ref-vllm.log", env)
    try:
        start_server(settings)
        vllm.start()
        cold = chat(vllm.base_url, messages, timeout=120)
        wait_for_l2_files(settings.cache_root, cold.prompt_tokens // CHUNK_TOKENS)
        return cold, payloads(settings.cache_root)
    finally:
        vllm.stop()
        stop_server(settings)


def one_round(model: Path, work: Path, messages: list[dict[str, str]], cold: ChatResult,
              ref: dict[str, str], keep: int | None = None) -> dict[str, Any]:
    """The failing test's sequence on a fresh root; what each phase restored and stored.

    ``keep``: instead of killing vLLM at the first file, store every chunk, stop both, and
    leave only the file of the chat's ``keep``-th chunk (prompt order, by LMCache's chunk
    hashes) on disk: for the first chunk, the next request restores it and stores the others
    from a prefill that began after it; for a later one it restores nothing."""
    env = server_env(work / "cache", KVP_CACHE_BUDGET_GB="1", KVP_L2_ADAPTER="kvpersist")
    settings: ServerSettings = load_settings(env)
    root = settings.cache_root
    vllm = VllmProcess(model, TINY_PINS, work / "vllm.log", env)
    full_chunks = cold.prompt_tokens // CHUNK_TOKENS
    out: dict[str, Any] = {}
    try:
        start_server(settings)
        vllm.start()
        base = chat(vllm.base_url, messages, timeout=120)
        out["base_equals_reference"] = same(base, cold)
        if keep is None:
            wait_until(lambda: bool(payloads(root)), timeout=60,
                       message="no chunk file stored", interval=0.02)
            out["files_at_first_kill"] = len(payloads(root))
            vllm.kill()
        else:
            wait_for_l2_files(root, full_chunks)
            vllm.kill()
            kill_server(settings)
            kept_hash = chunk_hashes(model, messages)[keep].hex()
            out["kept_chunk"] = keep
            for path in l2_data_files(root):
                if path.stem.rsplit("_", 1)[1] != kept_hash:
                    path.unlink()
            start_server(settings)
        vllm.start()
        again = chat(vllm.base_url, messages, timeout=120)
        out["again_hits"] = hits(vllm)
        out["again_equals_cold"] = same(again, cold)
        if keep is None:
            time.sleep(3)  # the again request's stores, as the test's next step came after them
        else:
            wait_for_l2_files(root, full_chunks)
        vllm.kill()
        kill_server(settings)
        stored = payloads(root)
        out["files_before_warm"] = len(stored)
        out["payloads_differing"] = sorted(n for n, d in stored.items() if ref.get(n) != d)
        start_server(settings)
        vllm.start()
        warm = chat(vllm.base_url, messages, timeout=120)
        out["warm_hits"] = hits(vllm)
        out["warm_equals_cold"] = same(warm, cold)
        if not out["warm_equals_cold"]:
            out["warm_logprobs"], out["cold_logprobs"] = warm.logprobs[:4], cold.logprobs[:4]
    finally:
        vllm.kill()
        stop_server(settings)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10, help="rounds of the sequence")
    parser.add_argument("--busy", type=int, default=0,
                        help="busy loops beside each round (CI's other worker's load)")
    parser.add_argument("--keep-one", action="store_true",
                        help="each round stores the chat, leaves one chunk's file (round i: "
                             "chunk i mod chunks, in prompt order) and lets the next request "
                             "store the rest from its own prefill, then restores them all")
    parser.add_argument("--json", type=Path, help="write every round's findings here")
    args = parser.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so each round's finally stops its vLLM and server.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    base = Path(tempfile.mkdtemp(prefix="kvp-sigkill-"))
    try:
        model = build_tiny_model(base / "model")
        messages = long_conversation(900, "topic A")
        cold, ref = reference(model, base / "ref", messages)
        print(f"reference: {len(ref)} chunk files, first logprobs {cold.logprobs[:3]}",
              flush=True)
        rounds: list[dict[str, Any]] = []
        for i in range(args.rounds):
            work = base / f"round-{i}"
            with busy_loops(args.busy if i % 2 == 0 else 0):
                result = one_round(model, work, messages, cold, ref,
                                   i % len(ref) if args.keep_one else None)
            result["busy"] = args.busy if i % 2 == 0 else 0
            rounds.append(result)
            print(f"round {i}: {json.dumps(result)}", flush=True)
            shutil.rmtree(work, ignore_errors=True)
        bad = [r for r in rounds if r["payloads_differing"] or not r["warm_equals_cold"]
               or not r["again_equals_cold"]]
        print(f"{len(rounds) - len(bad)} of {len(rounds)} rounds exact (every payload equal to "
              "the reference store's, both answers bit-identical to cold)")
        if args.json:
            args.json.write_text(json.dumps({"reference_files": len(ref), "rounds": rounds},
                                            indent=2) + "\n")
        return 1 if bad else 0
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
