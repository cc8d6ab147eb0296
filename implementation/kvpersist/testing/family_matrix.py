"""The architecture matrix: each model family of :mod:`kvpersist.demo.tiny_families` through the
real stack, as an operator brings up a new model: ``kvp-admin identity write-pins`` from the
recipe's arguments, ``kvp-server``, ``kvp-vllm``.

Per family: round 1 (a cold start of both processes) answers a ~1,000-token chat and stores its
full chunks; both processes are restarted; round 2 answers the same chat.  A family expected
``cached`` passes when round 2 got every full chunk from L2 (vLLM's external prefix-cache
hits and the client's ``cached_tokens``) and its tokens and logprobs are bit-identical to round
1's cold answer.  A family expected ``refused: <words>`` passes when vLLM started, answered,
stored nothing, and logged the gate's refusal containing those words.

Invariants
----------
* One LMCache server serves every family of a round (each family is its own namespace); it is
  restarted between the rounds, so every hit of round 2 comes from L2 files.
* Round 1 stops vLLM only once every full chunk of a cached family is an L2 file (60 s at
  most): stopping the engine unregisters it, and the server rejects stores it had not taken
  yet, which would judge a lost store as the family's fault.
* vLLM's own prefix cache is off and the prefill runs one chunk per step, so a cold and a
  restored answer are comparable bit for bit.
* A family never passes on a missing reading: no answer, no log line or fewer hits than full
  chunks is a failure with the reason in ``FamilyResult.problems``.
* A restored answer that differs from cold is compared with a fresh engine's own answers:
  one engine with its prefix cache on and kvpersist bypassed answers the chat twice (a cold
  answer, then its own prefix-cache hit).  When that cold answer equals round 1's and the
  restored one equals the hit, the family is cached at vLLM's prefix-cache exactness
  (``cached-prefix``).  When the engine's two cold answers differ, the engine is not
  deterministic for this family and a restored answer equal to one of its own answers is
  ``cached-noisy``.  A family must be expected to be either; anything else fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..config.registry import DEFAULT_CHUNK_TOKENS
from ..config.server import load_settings
from ..demo.stack import VllmProcess, chat, long_conversation, metric_sum
from ..demo.tiny_drafts import build_draft
from ..demo.tiny_families import (
    FAMILIES,
    Family,
    add_families_argument,
    build_family,
    chosen_families,
)
from ..identity.fields import NAMESPACE_IN_TEXT
from ..l2.layout import sanitize_model_name
from ..serving.launcher.vllm_client import ChatResult, complete
from ..serving.server.lifecycle import start_server, stop_server
from .helpers import l2_data_files, l2_files, server_env

HITS = "vllm:external_prefix_cache_hits_total"
#: Draft tokens the target accepted (speculative decoding): equal in both rounds when the
#: restored draft KV is the stored one, since every proposal then repeats
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
DRAFTED = "vllm:spec_decode_num_draft_tokens_total"
CHUNK = DEFAULT_CHUNK_TOKENS
REQUEST_TIMEOUT = 300.0


#: Outcomes a family's expected kind accepts, where that is more than the kind itself.
_ACCEPTED = {"cached-noisy": ("cached", "cached-noisy")}


@dataclass
class FamilyResult:
    """What one family's run measured."""

    family: str
    expect: str
    outcome: str = "not run"
    prompt_tokens: int = 0
    full_chunks: int = 0
    stored_files: int = 0
    #: the size of the largest file stored (a full chunk: every KV layer the engine registered,
    #: a draft's included, times the chunk's tokens, plus the header)
    chunk_bytes: int = 0
    restored_tokens: float = 0.0
    identical: bool | None = None
    #: the restored answer against vLLM's own prefix-cache hit (asked only when not identical)
    prefix_cache_identical: bool | None = None
    #: whether a fresh engine's cold answer equalled round 1's (asked only when not identical)
    cold_repeatable: bool | None = None
    gate_line: str = ""
    #: seconds from vLLM's launch to its first answer on /health, per round
    start_s: list[float] = field(default_factory=list)
    #: draft tokens accepted per round (a speculative recipe; empty otherwise)
    spec_accepted: list[float] = field(default_factory=list)
    #: draft tokens proposed per round
    spec_drafted: list[float] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """No problem, and the outcome expected (a ``cached-noisy`` family may also come out
        bit-identical: its noise did not show this time)."""
        kind = self.expect.split(":")[0]
        return not self.problems and self.outcome in _ACCEPTED.get(kind, (kind,))


def write_pins(family: Family, snapshot: Path, out: Path) -> Path:
    """The pins of ``family`` as the operator writes them: ``kvp-admin identity write-pins`` from
    the recipe's vLLM arguments."""
    recipe = (f"{snapshot} --block-size {family.block_size} --max-model-len 2048 "
              f"--dtype {family.dtype}")  # the spec-decoding config is no identity field
    res = subprocess.run([sys.executable, "-m", "kvpersist.admin.cli", "identity", "write-pins",
                          str(out), "--vllm-args", recipe, "--force"],
                         capture_output=True, text=True, timeout=120)
    if res.returncode != 0:
        raise RuntimeError(f"write-pins for {family.name} failed: {res.stderr.strip()}")
    return out


def recipe_args(family: Family, draft: Path | None) -> list[str]:
    """The family's own vLLM arguments, with its draft's folder in place of ``{draft}``."""
    if any("{draft}" in arg for arg in family.extra_args) and draft is None:
        raise ValueError(f"family {family.name} names a draft that was not built")
    return [arg.replace("{draft}", str(draft)) for arg in family.extra_args]


def _vllm(family: Family, snapshot: Path, pins: Path, log: Path, env: dict[str, str],
          *, draft: Path | None = None, prefix_cache: bool = False) -> VllmProcess:
    """The family's recipe through ``kvp-vllm``; vLLM's own prefix cache off unless asked."""
    env = {**env, "VLLM_CPU_KVCACHE_SPACE": str(family.kv_cache_gib)}
    return VllmProcess(snapshot, pins, log, env, dtype=family.dtype,
                       extra_args=["--block-size", str(family.block_size),
                                   "--enable-prefix-caching" if prefix_cache
                                   else "--no-enable-prefix-caching",
                                   *recipe_args(family, draft)])


def as_text(messages: list[dict[str, str]]) -> str:
    """A chat as one completion prompt (``role: content`` lines)."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def _gate_line(log: Path) -> str:
    """The worker's gate decision in a vLLM log: the 'caching ON' or the refusal line."""
    for line in log.read_text(errors="replace").splitlines():
        if "kvpersist: caching ON" in line or "serves without the KV cache tier" in line:
            return line.strip()
    return ""


def _family_files(root: Path, namespace: str) -> int:
    return sum(1 for name in l2_files(root) if namespace in name)


def _wait_for_stores(log: Path, root: Path, full_chunks: int, timeout: float = 60.0) -> None:
    """Until every full chunk of a cached family's chat is an L2 file (or ``timeout``), so that
    stopping vLLM cannot cut off a store still in flight: stopping the engine unregisters it,
    and the server then rejects the stores it had not yet taken (a miss, not the family's
    fault).  Returns at once for a family the gate refused."""
    gate_line = _gate_line(log)
    if "caching ON" not in gate_line:
        return
    namespace = _namespace(gate_line)
    deadline = time.monotonic() + timeout
    while _family_files(root, namespace) < full_chunks and time.monotonic() < deadline:
        time.sleep(0.2)


def _largest_file(root: Path, namespace: str) -> int:
    return max((p.stat().st_size for p in l2_data_files(root) if namespace in p.name),
               default=0)


def _namespace(gate_line: str) -> str:
    match = NAMESPACE_IN_TEXT.search(gate_line)
    return match.group(0) if match else "(no namespace)"


#: What the gate says of an MLA model on a CPU host without AMX
#: (serving.connector.platform_refusals).
MLA_WITHOUT_AMX = "refused: cannot continue a prefill from cached KV"


def for_this_host(family: Family) -> Family:
    """``family`` with what this host's vLLM makes of it: an MLA model runs on vLLM's CPU
    reference kernel without AMX, which cannot continue a prefill from cached KV, and the gate
    refuses it (``prefill_cannot_resume``); with AMX it is cached as the family says."""
    from ..admin.vllm_block_size import amx_mla, uses_mla

    if uses_mla({"model_type": family.model_type, **family.config}) and not amx_mla():
        return dataclasses.replace(family, expect=MLA_WITHOUT_AMX)
    return family


def run_matrix(families: list[Family], models: Path, work: Path) -> list[FamilyResult]:
    """Both rounds for ``families`` (see the module docstring); never raises for a family's
    failure, which is recorded in its result."""
    families = [for_this_host(f) for f in families]
    work.mkdir(parents=True, exist_ok=True)
    env = server_env(work / "cache", KVP_CACHE_BUDGET_GB="2")
    settings = load_settings(env)
    results = {f.name: FamilyResult(f.name, f.expect) for f in families}
    snapshots: dict[str, Path] = {}
    drafts: dict[str, Path] = {}
    pins: dict[str, Path] = {}
    cold: dict[str, ChatResult] = {}
    for family in families:
        try:
            snapshots[family.name] = build_family(models, family)
            if family.draft:
                drafts[family.name] = build_draft(models, family)
            pins[family.name] = write_pins(family, snapshots[family.name],
                                           work / f"{family.name}.env")
        except Exception as exc:  # a family that cannot be built is that family's failure
            results[family.name].problems.append(f"build: {type(exc).__name__}: {exc}")
    ready = [f for f in families if f.name in pins]
    for round_no in (1, 2):
        start_server(settings)
        try:
            for family in ready:
                result = results[family.name]
                if round_no == 2 and (family.name not in cold or result.outcome != "cached"):
                    continue
                log = work / f"vllm-{family.name}-{round_no}.log"
                vllm = _vllm(family, snapshots[family.name], pins[family.name], log, env,
                             draft=drafts.get(family.name))
                try:
                    result.start_s.append(round(vllm.start(), 1))
                    answer = _ask(family, vllm.base_url)
                    if round_no == 1:
                        _wait_for_stores(log, settings.cache_root, answer.prompt_tokens // CHUNK)
                    metrics = vllm.metrics()
                    hits = metric_sum(metrics, HITS)
                    if family.speculative:
                        result.spec_accepted.append(metric_sum(metrics, ACCEPTED))
                        result.spec_drafted.append(metric_sum(metrics, DRAFTED))
                except Exception as exc:
                    result.problems.append(round_problem(round_no, exc, log, vllm.log_tail(12)))
                    continue
                finally:
                    vllm.stop()
                if round_no == 1:
                    _judge_cold(family, result, answer, log, settings.cache_root)
                    cold[family.name] = answer
                    continue
                reference = None
                if not _same(answer, cold[family.name]):
                    try:
                        reference = _prefix_cache_answers(family, snapshots[family.name],
                                                          pins[family.name], work, env,
                                                          drafts.get(family.name))
                    except Exception as exc:
                        result.problems.append(f"vLLM prefix-cache reference: "
                                               f"{type(exc).__name__}: {exc}")
                _judge_restored(result, cold[family.name], answer, hits, reference)
        finally:
            stop_server(settings)
    return [results[f.name] for f in families]


def round_problem(round_no: int, exc: Exception, log: Path, log_tail: str) -> str:
    """A failed round as its report line: the error and, unless the error already quotes it
    (a failed start does), the tail of vLLM's log, which says what ended the engine (a signal
    it received, an error of its own)."""
    line = f"round {round_no}: {type(exc).__name__}: {exc}"
    return line if str(log) in str(exc) else f"{line}; log {log}:\n{log_tail}"


def _judge_cold(family: Family, result: FamilyResult, answer: ChatResult, log: Path,
                root: Path) -> None:
    result.prompt_tokens = answer.prompt_tokens
    result.full_chunks = answer.prompt_tokens // CHUNK
    result.gate_line = _gate_line(log)
    result.stored_files = (_family_files(root, _namespace(result.gate_line))
                           if "caching ON" in result.gate_line
                           else _family_files(root, sanitize_model_name(family.model_id + "/")))
    if "caching ON" in result.gate_line:
        result.outcome = "cached"
        result.chunk_bytes = _largest_file(root, _namespace(result.gate_line))
        if result.stored_files < result.full_chunks:
            result.problems.append(f"{result.stored_files} files stored for "
                                   f"{result.full_chunks} full chunks")
        return
    result.outcome = "refused"
    words = family.expect.partition(":")[2].strip()
    if family.expect.startswith("refused") and words not in result.gate_line:
        result.problems.append(f"the gate's line does not name {words!r}")
    if result.stored_files:
        result.problems.append(f"a refused family stored {result.stored_files} files")


def _ask(family: Family, base_url: str) -> ChatResult:
    """The family's chat (a topic of its own: recipes of one checkpoint share nothing)."""
    messages = long_conversation(1000, f"the {family.name} family")
    if family.api == "chat":
        return chat(base_url, messages, timeout=REQUEST_TIMEOUT)
    return complete(base_url, as_text(messages), timeout=REQUEST_TIMEOUT)


def _prefix_cache_answers(family: Family, snapshot: Path, pins: Path, work: Path,
                          env: dict[str, str], draft: Path | None
                          ) -> tuple[ChatResult, ChatResult]:
    """The chat asked twice of one engine with its prefix cache on and kvpersist bypassed:
    its cold answer, then its answer from its own prefix cache (a hit on the first)."""
    vllm = _vllm(family, snapshot, pins, work / f"vllm-{family.name}-prefix-cache.log",
                 {**env, "KVP_CACHE_BYPASS": "1"}, draft=draft, prefix_cache=True)
    try:
        vllm.start()
        first = _ask(family, vllm.base_url)
        second = _ask(family, vllm.base_url)
    finally:
        vllm.stop()
    if second.cached_tokens == 0:
        raise RuntimeError("vLLM's prefix cache did not hit on the second request")
    return first, second


def _same(a: ChatResult, b: ChatResult) -> bool:
    return a.tokens == b.tokens and a.logprobs == b.logprobs


def _judge_restored(result: FamilyResult, cold: ChatResult, warm: ChatResult,
                    hits: float, reference: tuple[ChatResult, ChatResult] | None = None
                    ) -> None:
    result.restored_tokens = hits
    result.identical = _same(warm, cold)
    want = result.full_chunks * CHUNK
    if hits != want or warm.cached_tokens != want:
        result.problems.append(f"{hits:.0f} tokens from L2 ({warm.cached_tokens} cached) "
                               f"for {want} in full chunks")
    if result.identical or reference is None:
        if not result.identical:
            result.problems.append("answer differs from cold, and no reference was measured")
        return
    again, hit = reference
    result.cold_repeatable = _same(again, cold)
    result.prefix_cache_identical = _same(warm, hit)
    if result.cold_repeatable and result.prefix_cache_identical:
        result.outcome = "cached-prefix"
    elif not result.cold_repeatable and any(_same(warm, a) for a in (again, hit)):
        result.outcome = "cached-noisy"
    else:
        at = next((i for i, (a, b) in enumerate(zip(warm.logprobs, cold.logprobs, strict=False))
                   if a != b), len(warm.logprobs))
        result.problems.append(
            f"answer differs from cold at token {at} and from the engine's own answers: "
            f"{warm.tokens[at:at + 3]} {warm.logprobs[at:at + 3]} vs "
            f"{cold.tokens[at:at + 3]} {cold.logprobs[at:at + 3]}")


def write_results(path: Path, results: list[FamilyResult], today: str) -> None:
    """Record ``results`` in ``path``, each with the date it was measured; the families a
    partial run did not run keep their earlier result and date.  Listed in FAMILIES order."""
    kept: dict[str, dict[str, Any]] = {}
    if path.exists():
        earlier = json.loads(path.read_text(encoding="utf-8"))
        for old in earlier.get("results", []):
            kept[old["family"]] = {"date": earlier.get("date"), **old}
    for r in results:
        kept[r.family] = {"date": today, **asdict(r), "passed": r.passed}
    order = {name: i for i, name in enumerate(FAMILIES)}
    rows = sorted(kept.values(), key=lambda row: order.get(row["family"], len(order)))
    path.write_text(json.dumps({"date": max(str(row["date"]) for row in rows),
                                "results": rows}, indent=2) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvpersist.testing.family_matrix",
        description="Run model families through write-pins, kvp-server and kvp-vllm: a chat "
        "stored, both processes restarted, the chat again; each family must be cached and "
        "bit-identical to its cold answer, or refused by the gate with its named reason.")
    parser.add_argument("work", type=Path, help="a scratch folder (models, cache, logs)")
    add_families_argument(parser, "run")
    parser.add_argument("--json", type=Path, metavar="FILE",
                        help="also write the results (with the date) to FILE")
    args = parser.parse_args(argv)
    chosen = chosen_families(parser, args.families)
    results = run_matrix(chosen, args.work / "models", args.work)
    for r in results:
        mark = "PASS" if r.passed else "FAIL"
        detail = (f"{r.restored_tokens:.0f}/{r.full_chunks * CHUNK} tokens from L2, "
                  f"identical={r.identical}, prefix-cache identical={r.prefix_cache_identical}"
                  f", cold repeatable={r.cold_repeatable}, vLLM started in "
                  f"{' and '.join(f'{s:.0f}' for s in r.start_s)} s, chunk file "
                  f"{r.chunk_bytes} B" + (f", draft tokens accepted {r.spec_accepted} of "
                                         f"{r.spec_drafted}"
                                         if r.spec_drafted else "")
                  if r.outcome.startswith("cached") else r.gate_line[-160:])
        print(f"{mark}  {r.family:16} {r.outcome:8} {detail}")
        for problem in r.problems:
            print(f"      {problem}")
    if args.json:
        write_results(args.json, results, datetime.date.today().isoformat())
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
