"""Benchmark for a GPU host (never in CI): time to first token of a long chat, cold and after
restarting both vLLM and the LMCache server, restored from kvpersist's L2 and, beside it, from
LMCache's ``nixl_store_dynamic``.

The model has the KV geometry of Llama-3.1-8B (32 layers, 8 KV heads, head_dim 128: 128 KiB of
bf16 KV per token, so a 128k-token chat is 16 GiB of KV) with random weights, built locally; its
hidden size is 1024 (8 query heads), so it computes less per token than a real 8B model: the cold
TTFT is an underestimate, and so is every speed-up measured against it.

For each adapter, one vLLM start serves every length cold (each chat stored as computed); then
vLLM and the server are both restarted, the page cache is dropped, and every length is asked
again: ``cached_tokens`` says how much came from L2.  TTFT is the latency of a max_tokens=1
request.  Results: ``benchmarks/results/ttft-gpu.json`` (``--out``).

    bash benchmarks/gpu/run.sh                         # on the GPU host: < 8 minutes
    .venv/bin/python benchmarks/gpu/bench_ttft_gpu.py --smoke   # the same flow on CPU, small
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvpersist.config.server import load_settings
from kvpersist.demo.stack import VllmProcess, chat, long_conversation
from kvpersist.demo.tiny_model import Geometry, build_tiny_model
from kvpersist.serving.server.lifecycle import start_server, stop_server
from kvpersist.testing.helpers import server_env, wait_for_l2_files
from kvpersist.testing.slow_disk import drop_caches

RESULTS = Path(__file__).resolve().parents[1] / "results"
#: Llama-3.1-8B's KV geometry (what a restore moves); a small hidden size keeps the weights at
#: about 2 GB.
LLAMA8B_KV = Geometry("kvpersist/llama-3.1-8b-kv-geometry", 1024, 32, 8, 8, 128, 133120)
#: The smoke run's model: the same flow, small enough for a CPU.
SMOKE = Geometry("kvpersist/tiny-llama-wide-kv-long", 512, 16, 8, 8, 64, 8192)
ADAPTERS = ("kvpersist", "nixl_store_dynamic")
CHUNK = 256


def engine_args(model: Path, max_len: int, gpu: bool) -> list[str]:
    """The recipe: the same list gives the pins and the engine."""
    if gpu:
        return [str(model), "--dtype", "bfloat16", "--block-size", "16", "--max-model-len",
                str(max_len), "--max-num-batched-tokens", "16384", "--enforce-eager",
                "--gpu-memory-utilization", "0.85"]
    return [str(model), "--dtype", "float32", "--block-size", "128", "--max-model-len",
            str(max_len)]


def write_pins(path: Path, recipe: list[str]) -> Path:
    """``kvp-admin identity write-pins`` from the recipe, as an operator would (it reads the
    identity flags and ignores the rest)."""
    done = subprocess.run([sys.executable, "-m", "kvpersist.admin.cli", "identity", "write-pins",
                           str(path), "--force", "--vllm-args", " ".join(recipe)],
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"write-pins failed: {done.stderr.strip()}")
    return path


def ttft(vllm: VllmProcess, messages: list[dict[str, str]]) -> dict[str, float]:
    began = time.perf_counter()
    reply = chat(vllm.base_url, messages, max_tokens=1, timeout=3600)
    return {"ttft_s": round(time.perf_counter() - began, 3), "prompt_tokens": reply.prompt_tokens,
            "cached_tokens": reply.cached_tokens}


def run_adapter(adapter: str, model: Path, pins: Path, recipe: list[str], work: Path,
                chats: dict[int, list[dict[str, str]]], *, l1_gb: int, budget_gb: int
                ) -> dict[str, Any]:
    """Cold TTFT of every chat, then TTFT after restarting vLLM and the server (page cache
    dropped), with ``adapter`` as L2."""
    root = work / f"cache-{adapter}"
    shutil.rmtree(root, ignore_errors=True)
    env = server_env(root, KVP_L2_ADAPTER=adapter, KVP_L1_SIZE_GB=str(l1_gb),
                     KVP_CACHE_BUDGET_GB=str(budget_gb))
    settings = load_settings(env)
    out: dict[str, Any] = {}
    vllm = None
    try:
        for phase in ("cold", "after restart"):
            start_server(settings)
            vllm = VllmProcess(model, pins, work / f"vllm-{adapter}-{phase[0]}.log", env,
                               extra_args=recipe[1:], compile=True, max_model_len=int(recipe[
                                   recipe.index("--max-model-len") + 1]))
            began = time.monotonic()
            vllm.start(timeout=900)
            out.setdefault("vllm_start_s", []).append(round(time.monotonic() - began, 1))
            if phase == "after restart":
                drop_caches()
            for length, messages in chats.items():
                result = ttft(vllm, messages)
                out.setdefault(str(length), {})[phase] = result
                if phase == "cold":
                    wait_for_l2_files(root, int(result["prompt_tokens"]) // CHUNK, timeout=600)
                print(f"{adapter} {length} {phase}: {result}", flush=True)
            vllm.stop()
            vllm = None
            stop_server(settings)
    except Exception as exc:  # a peer that does not run here is reported, not fatal
        out["error"] = f"{type(exc).__name__}: {exc}"[:500]
        print(f"{adapter}: {out['error']}", flush=True)
    finally:
        if vllm is not None:
            vllm.kill()
        stop_server(settings)
        shutil.rmtree(root, ignore_errors=True)  # the next adapter needs the disk
    return out


def host_facts() -> dict[str, Any]:
    facts: dict[str, Any] = {"python": platform.python_version(), "machine": platform.machine()}
    try:
        facts["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total",
                                       "--format=csv,noheader"], capture_output=True, text=True,
                                      timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        facts["gpu"] = None
    for package in ("vllm", "lmcache", "torch"):
        try:
            module = __import__(package)
            facts[package] = getattr(module, "__version__", "?")
        except ImportError:
            facts[package] = None
    return facts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", help="chat lengths in tokens (default 32000,128000; "
                        "--smoke: 1000,3000)")
    parser.add_argument("--smoke", action="store_true",
                        help="the same flow on CPU with a small model (checks the script)")
    parser.add_argument("--adapters", default=",".join(ADAPTERS))
    parser.add_argument("--work", help="work directory (default: a temp dir)")
    parser.add_argument("--out", type=Path, help="JSON results (default: "
                        "benchmarks/results/ttft-gpu.json; --smoke: ttft-gpu-smoke.json)")
    args = parser.parse_args()
    gpu = not args.smoke
    lengths = [int(x) for x in (args.lengths or ("1000,3000" if args.smoke
                                                 else "32000,128000")).split(",")]
    work = Path(args.work or tempfile.mkdtemp(prefix="kvp-ttft-gpu-"))
    began = time.monotonic()
    model = build_tiny_model(work / "models", LLAMA8B_KV if gpu else SMOKE)
    max_len = max(lengths) + 2048
    recipe = engine_args(model, max_len, gpu)
    pins = write_pins(work / "identity.env", recipe)
    chats = {n: long_conversation(n, f"a chat of {n} tokens") for n in lengths}
    kv_per_token = 2 * 32 * 8 * 128 * 2 if gpu else SMOKE.kv_bytes_per_token
    kv_gb = -(-max(lengths) * kv_per_token * 5 // 4 // 2**30)
    results: dict[str, Any] = {"host": host_facts(), "smoke": args.smoke, "lengths": lengths,
                               "recipe": recipe[1:], "kv_bytes_per_token": kv_per_token,
                               "adapters": {}}
    for adapter in args.adapters.split(","):
        results["adapters"][adapter] = run_adapter(
            adapter, model, pins, recipe, work, chats, l1_gb=max(4, kv_gb),
            budget_gb=max(8, 2 * kv_gb))
    results["wall_s"] = round(time.monotonic() - began, 1)
    print("\nTTFT (s), max_tokens=1; speed-up = cold / after restart")
    for adapter, rows in results["adapters"].items():
        for length in lengths:
            row = rows.get(str(length))
            if row and "after restart" in row:
                cold, warm = row["cold"]["ttft_s"], row["after restart"]["ttft_s"]
                print(f"{adapter:<20} {length:>7}: cold {cold:8.2f}  after restart {warm:8.2f} "
                      f"({cold / warm:5.1f}x, {row['after restart']['cached_tokens']} of "
                      f"{row['after restart']['prompt_tokens']} tokens cached)")
        if "error" in rows:
            print(f"{adapter:<20}: {rows['error']}")
    out = args.out or RESULTS / ("ttft-gpu-smoke.json" if args.smoke else "ttft-gpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"results: {out} ({results['wall_s']} s in all)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
