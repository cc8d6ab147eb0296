"""What the server's registration of a CPU engine's KV cache costs in prefaulting, by layers.

vLLM on CPU keeps every layer's KV in one buffer; LMCache moves it to one shared-memory segment
and the server maps the whole segment once per layer (``CpuShmTensorWrapper.to_tensor``).
kvpersist prefaults the mapping for writing so the first restore takes no page faults.  This
times the server's side of a registration on LMCache's real migration and mapping, three ways:
the whole mapping prefaulted per layer (kvpersist before this benchmark: a 64-layer model with
5 GiB of KV timed out its registration), each layer's own view prefaulted (now), and none.

    .venv/bin/python benchmarks/bench_registration_prefault.py --gib 2 --layers 64

Prints seconds per way and the ratios, and writes ``--json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lmcache.v1.platform.devices.cpu.shm import CpuShmTensorWrapper, migrate_to_shm_and_wrap

from kvpersist.serving.lmcache_compat import cpu_transfer

_PLAIN = CpuShmTensorWrapper.to_tensor


def _whole_mapping(wrapper: Any) -> Any:
    """The former way: the whole segment prefaulted at every layer's mapping."""
    out = _PLAIN(wrapper)
    base = out.data_ptr() - out.storage_offset() * out.element_size()
    cpu_transfer.prefault_for_writing(base, wrapper.nbytes)
    return out


WAYS: dict[str, Callable[[Any], Any]] = {
    "whole mapping per layer": _whole_mapping,
    "own view per layer": cpu_transfer._prefaulting(_PLAIN),
    "none": _PLAIN,
}


def time_way(wrappers: list[Any], to_tensor: Callable[[Any], Any]) -> float:
    began = time.perf_counter()
    mapped = [to_tensor(w) for w in wrappers]
    seconds = time.perf_counter() - began
    del mapped
    gc.collect()  # the mappings go before the next way maps again
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=2.0, help="KV cache size (GiB)")
    parser.add_argument("--layers", type=int, default=64, help="layers sharing the buffer")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    per_layer = int(args.gib * 2**30) // args.layers // 4096 * 4096
    buffer = torch.zeros(per_layer * args.layers, dtype=torch.uint8)
    views = [buffer[i * per_layer:(i + 1) * per_layer] for i in range(args.layers)]
    wrappers = [migrate_to_shm_and_wrap(v) for v in views]
    del buffer
    results = {name: time_way(wrappers, way) for name, way in WAYS.items()}
    for name, seconds in results.items():
        print(f"{name:24} {seconds:8.2f} s")
    ratio = results["whole mapping per layer"] / max(results["own view per layer"], 1e-9)
    print(f"whole / own view: {ratio:.1f}x ({args.layers} layers, {args.gib:g} GiB)")
    if args.json:
        args.json.write_text(json.dumps({"gib": args.gib, "layers": args.layers,
                                         "seconds": results, "ratio": ratio}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
