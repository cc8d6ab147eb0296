"""The CPU demo: a long chat survives a restart of vLLM *and* the LMCache server.

Steps: build the tiny model; start the LMCache server (kvpersist settings, L2 on disk) and
vLLM with the kvpersist connector; send a long chat; stop both; start both; send the same
chat; print the tokens served from the persistent cache, the L2 files with their namespace,
what ``kvp-admin`` reports about them (usage and the recorded identity of the namespace), and
whether the two answers (temperature 0, logprobs) are identical.

Exit status 0 only if the second answer is identical *and* came (partly) from L2.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from ..admin.budget import BudgetModel
from ..admin.report import build_report
from ..config.server import describe_access, load_settings
from ..identity import load_pins
from ..identity.records import list_records
from ..l2.inventory import build_inventory
from ..l2.layout import sanitize_model_name
from ..serving import http
from ..serving.server.lifecycle import start_server, stop_server
from .stack import ChatResult, VllmProcess, chat, free_port, long_conversation, metric_sum
from .tiny_model import TINY_PINS, build_tiny_model

PINS = TINY_PINS


def _say(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def l2_files(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_file() and p.suffix in (".bin", ".kvp"))


def wait_for_files(root: Path, count: int, timeout: float = 60.0) -> None:
    """Wait until ``count`` L2 files exist (a store is published by rename, never partly)."""
    deadline = time.monotonic() + timeout
    while len(l2_files(root)) < count and time.monotonic() < deadline:
        time.sleep(0.2)


def _print_admin_view(cache_root: Path, budget_gb: float) -> None:
    """What ``kvp-admin report`` and ``kvp-admin identity show`` say about the cache."""
    inv = build_inventory(cache_root)
    report = build_report(inv, BudgetModel.from_gb(budget_gb), {}, set())
    records = list_records(cache_root)
    for row in report["namespaces"]:
        ns = row["namespace"]
        print(f"kvp-admin report                       : {ns}: {row['files']} files, "
              f"{row['bytes']} B, {100 * row['budget_share']:.3f}% of the budget")
        rec = records.get(ns, "no identity record")
        if isinstance(rec, str):
            print(f"kvp-admin identity show                : {rec}")
        else:
            print(f"kvp-admin identity show                : {rec.model_id}@{rec.model_revision[:12]}, "
                  f"{rec.kv_cache_dtype}, block {rec.block_size}, tp {rec.tensor_parallel_size}, "
                  f"max len {rec.max_model_len}, {rec.build}")


def run_demo(work: Path, cache_root: Path, *, tokens: int, keep: bool) -> int:
    models = work / "models"
    models.mkdir(parents=True, exist_ok=True)
    _say(f"building the tiny model under {models}")
    model_dir = build_tiny_model(models)
    pins = load_pins(PINS)
    if model_dir.name != pins["model_revision"]:
        _say(f"ERROR: built revision {model_dir.name} differs from the pin in {PINS}")
        return 1
    server_env = {
        "KVP_CACHE_ROOT": str(cache_root),
        "KVP_ZMQ_PORT": str(free_port()),
        "KVP_HTTP_PORT": str(free_port()),
        "KVP_L1_SIZE_GB": "1",  # the demo machine has 24 GiB; production default is 64
        "KVP_CACHE_BUDGET_GB": "4",
    }
    settings = load_settings(server_env)
    messages = long_conversation(tokens)
    answers: list[ChatResult] = []
    hits_vllm = hits_l2 = 0.0
    vllm = VllmProcess(model_dir, PINS, work / "vllm.log", server_env, compile=True)
    try:
        for round_no in (1, 2):
            res = start_server(settings)
            _say(f"round {round_no}: LMCache server pid {res.pid} ready in {res.seconds:.1f}s "
                 f"({describe_access(settings)}; root {cache_root})")
            ready = vllm.start()
            _say(f"round {round_no}: vLLM ready in {ready:.0f}s on {vllm.base_url}")
            answer = chat(vllm.base_url, messages)
            answers.append(answer)
            _say(f"round {round_no}: {answer.prompt_tokens} prompt tokens answered in "
                 f"{answer.seconds:.2f}s: {answer.text!r}")
            if round_no == 2:
                hits_vllm = metric_sum(vllm.metrics(), "vllm:external_prefix_cache_hits_total")
                body = http.get(settings.http_url + "/metrics").body
                hits_l2 = metric_sum(body.decode(), "lmcache_mp_lookup_hit_l2_tokens_total")
            else:  # the write-through to L2 is asynchronous: wait for it before stopping
                wait_for_files(cache_root, answer.prompt_tokens // 256)
            vllm.stop()
            stopped = stop_server(settings)
            _say(f"round {round_no}: stopped vLLM and {stopped.describe(settings.pid_file)}")
            if round_no == 1:
                files = l2_files(cache_root)
                _say(f"L2 after round 1: {len(files)} files")
    finally:
        vllm.kill()
        stop_server(settings)

    files = l2_files(cache_root)
    print()
    print("=" * 78)
    print("kvpersist CPU demo: the same long chat before and after restarting vLLM and LMCache")
    print("=" * 78)
    print(f"prompt tokens                          : {answers[0].prompt_tokens}")
    print(f"tokens served from the persistent cache: {hits_vllm:.0f} "
          f"(vLLM external prefix hits); LMCache L2 lookup hits: {hits_l2:.0f}")
    print(f"L2 files in {cache_root}: {len(files)}")
    for path in files:
        print(f"  {path.stat().st_size:>9} B  {path.name}")
    prefix = sanitize_model_name(f"{pins['model_id']}/<namespace>")
    print(f"file-name prefix (model name part)      : {prefix}")
    _print_admin_view(cache_root, settings.budget_gb)
    identical = (answers[0].text == answers[1].text and answers[0].tokens == answers[1].tokens
                 and answers[0].logprobs == answers[1].logprobs)
    drift = max((abs(a - b) for a, b in zip(answers[0].logprobs, answers[1].logprobs, strict=False)),
                default=0.0)
    print(f"answers identical (text + logprobs)    : {'YES' if identical else 'NO'} "
          f"(largest logprob difference {drift:.3g})")
    print(f"  before restart: {answers[0].text!r} {answers[0].logprobs[:4]}...")
    print(f"  after restart : {answers[1].text!r} {answers[1].logprobs[:4]}...")
    print(f"time to answer   before {answers[0].seconds:.2f}s, after {answers[1].seconds:.2f}s")
    ok = identical and hits_vllm > 0
    print("RESULT: " + ("OK, the prefill was served from the persistent L2 tier" if ok else
                        "FAILED (see vllm.log and lmcache-server.log)"))
    _say(f"logs in {work}" + ("" if keep else f"; the temporary {cache_root} is removed"))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvpersist.demo",
        description="CPU demo of the whole stack: tiny model, LMCache MP server with a "
        "persistent L2, vLLM with the kvpersist connector, restart of both, same chat again.",
    )
    parser.add_argument("--cache-root", help="KVP_CACHE_ROOT to use (default: a fresh temp dir)")
    parser.add_argument("--work-dir", default=str(Path.cwd() / ".kvp-demo"),
                        help="where the model and logs go (default: ./.kvp-demo)")
    parser.add_argument("--tokens", type=int, default=900, help="approximate chat length")
    parser.add_argument("--keep", action="store_true", help="keep a temporary cache root")
    args = parser.parse_args(argv)
    work = Path(args.work_dir).absolute()
    work.mkdir(parents=True, exist_ok=True)
    if args.cache_root:
        return run_demo(work, Path(args.cache_root).absolute(), tokens=args.tokens, keep=True)
    tmp = Path(tempfile.mkdtemp(prefix="kvp-demo-cache-"))
    try:
        return run_demo(work, tmp, tokens=args.tokens, keep=args.keep)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
