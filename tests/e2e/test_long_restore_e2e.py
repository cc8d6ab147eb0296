"""A restore whose L2→L1 load takes several times the lookup deadline is waited for, because it
progresses; the same restore under a 5 s ceiling is abandoned and recomputed.  Real vLLM and a
real LMCache server; the cache root is a slow disk (a loop device read at 5 MiB/s through the
blkio cgroup the server is admitted to) and the cache files' pages are evicted before each
restore (:meth:`SlowDisk.evict_files`: the files only, so what is slow is the disk, not every
process faulting its libraries back in after a whole page-cache drop)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from kvpersist.config.server import load_settings
from kvpersist.demo.stack import VllmProcess, chat, long_conversation, metric_sum
from kvpersist.demo.tiny_model import WIDE_KV
from kvpersist.serving.connector.metrics import BYPASS_METRIC
from kvpersist.serving.server.lifecycle import start_server, stop_server
from kvpersist.testing import slow_disk
from kvpersist.testing.helpers import cache_diagnosis, clear_l1, pins_for_model, server_env, wait_for_l2_files
from kvpersist.testing.processes import server_pid

# serial: the restore must outlast the deadline because of the throttled disk, not stall on
# CPU shared with another test (beside one, the lookup was bypassed and the hit lost)
pytestmark = [pytest.mark.e2e, pytest.mark.serial,
              pytest.mark.skipif(slow_disk.unavailable() is not None,
                                 reason=f"no slow disk here: {slow_disk.unavailable()}")]

RATE = 5 << 20  # bytes per second the server may read from the cache's device
DEADLINE_S = 5.0  # the plain lookup deadline (KVP_LOOKUP_TIMEOUT_S's default)
REQUEST_TIMEOUT = 600.0
HITS = "vllm:external_prefix_cache_hits_total"


def test_a_progressing_restore_is_waited_for_a_stalled_one_is_not(tmp_path: Path,
                                                                 wide_kv_model: Path) -> None:
    model = wide_kv_model
    pins = pins_for_model(model, tmp_path / "wide.env")
    messages = long_conversation(1850)
    with slow_disk.slow_disk(tmp_path, size_mb=512, read_bytes_per_s=RATE) as disk:
        # At 5 MiB/s, a segment completes only when all reads in flight before it do (the
        # throttle shares the device among them): with the default 16 file threads reading
        # 2 MiB segments, 32 MiB in flight take 6.4 s, past the deadline with no completion
        # at all. Four threads keep a completion every 1.6 s at most, as on any device whose
        # rate times the deadline is well above KVP_L2_FILE_THREADS x 2 MiB (docs/sizing.md).
        env = server_env(disk.mount / "cache", KVP_CACHE_BUDGET_GB="0.4",
                         KVP_L2_FILE_THREADS="4")
        settings = load_settings(env)
        vllm = VllmProcess(model, pins, tmp_path / "vllm-1.log", env)
        try:
            start_server(settings)
            vllm.start()
            cold = chat(vllm.base_url, messages, timeout=REQUEST_TIMEOUT)
            chunks = cold.prompt_tokens // 256
            assert chunks >= 6, cold.prompt_tokens
            stored = wait_for_l2_files(settings.cache_root, chunks)
            restore_bytes = chunks * 256 * WIDE_KV.kv_bytes_per_token
            # The set-up really is past the deadline: reading the prefix at RATE takes ≥ 3x it.
            assert restore_bytes / RATE >= 3 * DEADLINE_S, restore_bytes
            vllm.stop()
            stop_server(settings)

            # Round 2: both restarted, the files' pages evicted, the server's reads at RATE.
            start_server(settings)
            disk.admit(server_pid(settings))
            vllm = VllmProcess(model, pins, tmp_path / "vllm-2.log", env)
            vllm.start()
            assert disk.evict_files() >= chunks
            read_before = disk.read_bytes()
            warm = chat(vllm.base_url, messages, timeout=REQUEST_TIMEOUT)
            metrics = vllm.metrics()
            hits = metric_sum(metrics, HITS)
            assert hits == 256 * chunks, (  # every full chunk from L2
                f"{hits} hits in {warm.seconds:.1f}s, "
                f"{(disk.read_bytes() - read_before) / 2**20:.0f} MiB read from the slow disk, "
                f"{metric_sum(metrics, BYPASS_METRIC):.0f} bypasses, load average "
                f"{os.getloadavg()}\n{cache_diagnosis(vllm.log_path, settings.log_file)}")
            assert warm.cached_tokens == 256 * chunks
            assert (warm.tokens, warm.logprobs, warm.text) == (cold.tokens, cold.logprobs,
                                                               cold.text)
            assert disk.read_bytes() - read_before >= restore_bytes  # from the slow device
            assert "bypasses the KV cache" not in vllm.log_tail(10_000)
            print(f"\n{restore_bytes / 2**20:.0f} MiB at {RATE / 2**20:.0f} MiB/s: cold "
                  f"{cold.seconds:.1f}s, restored {warm.seconds:.1f}s")
            vllm.stop()

            # Round 3: the same restore under a 5 s ceiling is abandoned: recomputed, identical.
            clear_l1(settings)
            assert disk.evict_files() >= chunks
            vllm = VllmProcess(model, pins, tmp_path / "vllm-3.log",
                               {**env, "KVP_LOOKUP_MAX_S": str(DEADLINE_S)})
            vllm.start()
            capped = chat(vllm.base_url, messages, timeout=REQUEST_TIMEOUT)
            assert metric_sum(vllm.metrics(), HITS) == 0
            assert (capped.tokens, capped.logprobs) == (cold.tokens, cold.logprobs)
            assert "still loading after" in vllm.log_tail(10_000)
            assert set(stored) <= set(wait_for_l2_files(settings.cache_root, chunks))
        finally:
            vllm.kill()
            stop_server(settings)
            if settings.log_file.exists():  # kept for a failure's diagnosis; the disk goes away
                shutil.copyfile(settings.log_file, tmp_path / "lmcache-server.log")
