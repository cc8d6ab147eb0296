"""Is a restore through kvpersist bit-identical to the cold answer round after round, on a quiet
host and on a loaded one, from L1 and from L2?

One LMCache server with kvpersist's L2 and one vLLM with its own prefix cache off (so every
hit is the connector's).  Round 0 computes the chat cold and stores it; every later round
sends the same chat again, restored from L1, or from L2 after L1 was emptied (every other
pair of rounds), with busy loops on the host's cores every other round, as CI's other worker
loads it.  A control round under a new ``cache_salt`` is computed cold again every fourth
round: if the engine itself moves, the control shows it.

Why: two restores in CI parted from their cold answer by about 5e-4 in every logprob, same
tokens, with the chunk files bit-identical to vLLM's (``33f9f29``;
``tests/e2e/test_kv_writer_e2e.py`` in the clean-clone run of 2026-12-07), and vLLM alone was
deterministic under the same load (``cpu_determinism.py``).  A random-weights model moves its
logprobs only a little when some of its KV is wrong, so such a drift may be a restore that
wrote part of the KV late or wrong.

Usage::

    .venv/bin/python benchmarks/diagnostics/restore_determinism.py --rounds 40 --busy 2 \\
        --json benchmarks/results/restore-determinism.json
    .venv/bin/python benchmarks/diagnostics/restore_determinism.py --restart --rounds 10 \\
        --json benchmarks/results/restore-determinism-restarts.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvpersist.config.registry import DEFAULT_CHUNK_TOKENS
from kvpersist.config.server import load_settings
from kvpersist.demo.stack import VllmProcess, chat, long_conversation
from kvpersist.demo.tiny_model import build_tiny_model
from kvpersist.serving.server.lifecycle import start_server, stop_server
from kvpersist.testing.answer_diff import difference, differing_line
from kvpersist.testing.busy_host import busy_loops
from kvpersist.testing.helpers import clear_l1, pins_for_model, server_env, wait_for_l2_files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=40, help="restores to compare (40)")
    parser.add_argument("--busy", type=int, default=2,
                        help="busy loops during every other round (default 2: both cores)")
    parser.add_argument("--tokens", type=int, default=1200, help="the chat's length (1200)")
    parser.add_argument("--mode", choices=("lmcache_driven", "engine_driven"),
                        help="KVP_MP_TRANSFER_MODE for vLLM (default: the site's)")
    parser.add_argument("--restart", action="store_true",
                        help="restart the server and vLLM before every restore (L1 empty; the "
                             "restore is the new engine's first request, as in "
                             "test_kv_writer_e2e.py), vLLM started under that round's load")
    parser.add_argument("--json", type=Path, help="write the rounds here")
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvp-restore-determinism-") as tmp:
        model = build_tiny_model(Path(tmp) / "models")
        pins = pins_for_model(model, Path(tmp) / "pins.env")
        env = server_env(Path(tmp) / "root")
        if args.mode:
            env["KVP_MP_TRANSFER_MODE"] = args.mode
        settings = load_settings(env)
        start_server(settings)
        vllm = VllmProcess(model, pins, Path(tmp) / "vllm.log", env,
                           extra_args=["--no-enable-prefix-caching"])
        messages = long_conversation(args.tokens, "the same chat every round")
        try:
            vllm.start()
            cold = chat(vllm.base_url, messages)
            wait_for_l2_files(settings.cache_root, cold.prompt_tokens // DEFAULT_CHUNK_TOKENS,
                              timeout=120)
            for i in range(1, args.rounds + 1):
                busy = args.busy if i % 2 else 0
                control = i % 4 == 0
                from_l2 = not control and (i // 2) % 2 == 1
                if from_l2 and not args.restart:
                    clear_l1(settings)
                with busy_loops(busy):
                    if args.restart and not control:
                        vllm.kill()
                        stop_server(settings)
                        start_server(settings)
                        vllm = VllmProcess(model, pins, Path(tmp) / f"vllm-{i}.log", env,
                                           extra_args=["--no-enable-prefix-caching"])
                        vllm.start()
                    answer = chat(vllm.base_url, messages,
                                  cache_salt=f"control-{i}" if control else None)
                kind = "control" if control else ("l2" if from_l2 or args.restart else "l1")
                row = {"round": i, "busy": busy, "kind": kind, **difference(answer, cold)}
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            vllm.kill()
            stop_server(settings)
    for kind in ("l1", "l2", "control"):
        print(f"{kind}: " + differing_line((r for r in rows if r["kind"] == kind), "the cold one"))
    if args.json:
        args.json.write_text(json.dumps({"mode": args.mode, "restart": args.restart,
                                         "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
