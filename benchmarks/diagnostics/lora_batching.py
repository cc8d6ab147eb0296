"""Does vLLM compute a request without a LoRA adapter correctly when it shares a batch with
adapter requests?  vLLM's offline engine alone, no connector and no cache: the batched
answers against each prompt's answer alone, prompt by prompt (the diagnostic behind the gate's
``lora_batches_miscomputed`` refusal, issue 49).

Usage::

    VLLM_CPU_KVCACHE_SPACE=2 .venv/bin/python benchmarks/diagnostics/lora_batching.py \\
        --json /tmp/lora-batching.json
    # the control: the same batch with no adapter
    VLLM_CPU_KVCACHE_SPACE=2 .venv/bin/python benchmarks/diagnostics/lora_batching.py --no-adapters

The traffic model (4 KiB of KV per token) and two random adapters on ``k_proj``/``v_proj`` are
built under ``--workdir``.  Exit status 1 when any row differs from its answer alone.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvpersist.demo.tiny_model import TRAFFIC, build_tiny_model
from kvpersist.testing.lora import build_random_lora


def prompts(count: int, chars: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice("abcdefghij klmnopqrstuvwxyz.") for _ in range(chars))
            for _ in range(count)]


def compare(batched: Any, alone: Any) -> dict[str, Any]:
    """One row: the first tokens and whether the answers are the same bit for bit."""
    b, a = batched.outputs[0], alone.outputs[0]
    same = list(b.token_ids) == list(a.token_ids) and all(
        b.logprobs[k][t].logprob == a.logprobs[k][t].logprob for k, t in enumerate(a.token_ids))
    return {"same": same, "batched_first": b.token_ids[0], "alone_first": a.token_ids[0],
            "batched_first_logprob": b.logprobs[0][b.token_ids[0]].logprob,
            "alone_first_logprob": a.logprobs[0][a.token_ids[0]].logprob}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8,
                        help="prompts in the batch: no adapter, adapter 1, no adapter, "
                        "adapter 2, ...")
    parser.add_argument("--chars", type=int, default=1500, help="prompt length (tokens)")
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--no-adapters", action="store_true",
                        help="the control: the same batch, every row without an adapter")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    for name in ("VLLM_NO_USAGE_STATS", "DO_NOT_TRACK"):
        os.environ.setdefault(name, "1")
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvp-lora-batching-"))
    model = build_tiny_model(workdir / "models", TRAFFIC)
    adapters = [build_random_lora(workdir / f"lora-{i}", seed=i + 1, geometry=TRAFFIC)
                for i in range(2)]
    llm = LLM(model=str(model), dtype="float32", max_model_len=8192,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=256,
              enable_prefix_caching=False, enable_lora=True, max_lora_rank=8, max_loras=2,
              enforce_eager=True)
    texts = prompts(args.prompts, args.chars, seed=1)
    requests = [None if i % 2 == 0 or args.no_adapters else
                LoRARequest(f"lora-{(i // 2) % 2}", (i // 2) % 2 + 1, str(adapters[(i // 2) % 2]))
                for i in range(len(texts))]
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0)
    batched = llm.generate(texts, params, lora_request=requests)
    rows = []
    for i, text in enumerate(texts):
        request = requests[i]
        alone = llm.generate([text], params, lora_request=request)[0]
        row = {"prompt": i, "adapter": request.lora_name if request is not None else None,
               **compare(batched[i], alone)}
        rows.append(row)
        print(f"prompt {i} adapter {row['adapter']}: "
              f"{'same as alone' if row['same'] else 'DIFFERS from alone'} (first token "
              f"{row['batched_first']} at {row['batched_first_logprob']:.4f} batched, "
              f"{row['alone_first']} at {row['alone_first_logprob']:.4f} alone)", flush=True)
    differ = [r for r in rows if not r["same"]]
    print(f"{len(differ)} of {len(rows)} rows differ from their answer alone "
          f"({sum(r['adapter'] is None for r in differ)} without an adapter)")
    if args.json:
        args.json.write_text(json.dumps({"no_adapters": args.no_adapters, "rows": rows},
                                        indent=1) + "\n")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
