"""``kvp-vllm``: vLLM's OpenAI server with the kvpersist connector, for an unchanged recipe.

    kvp-vllm MODEL [vLLM args...]           (scripts/run-vllm-with-persist.sh calls this)
    kvp-vllm --print-config --pins FILE     (only the --kv-transfer-config JSON)

Invariants
----------
* The connector is always ``KvPersistConnector`` from ``kvpersist.connector`` (fail-closed
  identity gate over LMCache's MP connector); the pins file is always passed, as an absolute
  path, so scheduler and workers resolve the same identity.
* The LMCache server address comes from the same settings as the server launcher
  (``KVP_BIND_HOST``, ``KVP_ZMQ_PORT``), so the two cannot drift apart.
* A dead cache service is noticed within ``KVP_HEARTBEAT_S`` (default 2 s; LMCache's default is
  10 s); a lookup is abandoned after ``KVP_LOOKUP_TIMEOUT_S`` (5 s) without progress, or after
  ``KVP_LOOKUP_MAX_S`` (600 s) in all (:mod:`kvpersist.serving.connector.scheduler.lookup_deadline`); blocking
  LMCache calls (registration, shutdown) give up after ``KVP_MQ_TIMEOUT_S`` (15 s; LMCache: 300 s).
* The transfer mode is LMCache's zero-copy ``lmcache_driven`` (``auto`` with CUDA), and on a
  machine without CUDA ``engine_driven`` (pickled) where ``/dev/shm`` cannot hold every
  worker's KV cache or the parallel layout is not one proven here
  (:func:`default_transfer_mode`); ``KVP_MP_TRANSFER_MODE`` overrides.  Shared-memory
  segments earlier CPU runs left in ``/dev/shm`` are removed before vLLM starts
  (:mod:`kvpersist.serving.shm_sweep`).
* With persistence on, vLLM also gets ``--enable-prompt-tokens-details``, so a client sees the
  restored prefix as ``usage.prompt_tokens_details.cached_tokens``.
* A failed KV load is recomputed (``kv_load_failure_policy: recompute``), never an error.
* ``KV_PERSIST=0`` runs the recipe's arguments untouched; the vLLM process always gets the
  telemetry-off environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ...config.client import (
    CONNECTOR_CLASS,
    CONNECTOR_MODULE,
    LauncherSettings,
    load_launcher_settings,
)
from ...config.environment import process_env
from ...config.server import ServerSettings, load_settings
from ...config.site import CONFIG_VARIABLE, effective_environ
from ...config.values import SettingsError
from ...identity.engine_flags import EngineFlagsError, IdentityFlags, identity_flags
from ..shm_sweep import SHM_DIR, sweep_python_segments, sweep_stale_segments

VLLM_ENTRY = ("-m", "vllm.entrypoints.openai.api_server")  # `vllm serve` needs a dist named vllm
PROMPT_DETAILS_FLAG = "--enable-prompt-tokens-details"


#: Layouts (tensor, pipeline parallel size) whose CPU ``lmcache_driven`` restores are proven
#: exact here, a late write included (tests/e2e/test_load_fence_e2e.py, TP 1-2) and every
#: rank's own KV after a restart (tests/e2e/test_parallel_restore_e2e.py, TP 2 and PP 2);
#: others are pickled.
PROVEN_CPU_LMCACHE_DRIVEN = ((1, 1), (2, 1), (1, 2))


def recipe_flags(args: Sequence[str]) -> IdentityFlags:
    """The identity flags of a recipe's vLLM arguments, read by the one parser of them
    (:func:`kvpersist.identity.engine_flags.identity_flags`); a malformed one is a
    SettingsError."""
    try:
        return identity_flags(list(args))
    except EngineFlagsError as exc:
        raise SettingsError(str(exc)) from None


def parallel_layout(args: Sequence[str]) -> tuple[int, int]:
    """(tensor, pipeline) parallel size a vLLM argument list asks for; vLLM's default is 1."""
    flags = recipe_flags(args)
    layout = (int(flags.tensor_parallel_size or 0), int(flags.pipeline_parallel_size or 0))
    if min(layout) < 1:
        raise SettingsError(f"-tp {layout[0]} -pp {layout[1]}: parallel sizes must be positive")
    return layout


def server_account(settings: ServerSettings | None) -> int | None:
    """The uid that owns the server's runtime directory (the server's account), or None when
    it is not known (TCP access, no directory yet)."""
    if settings is None or not settings.unix_sockets:
        return None
    try:
        return settings.socket_dir.stat().st_uid
    except OSError:
        return None


def shm_free_bytes(shm_dir: Path) -> int:
    """Bytes free in ``shm_dir`` now (the one measurement the mode choice rests on)."""
    return shutil.disk_usage(shm_dir).free


def default_transfer_mode(environ: Mapping[str, str] | None = None,
                          shm_dir: Path = SHM_DIR, *, layout: tuple[int, int] = (1, 1),
                          server_uid: int | None = None) -> tuple[str, str]:
    """LMCache's transfer mode for this machine and parallel ``layout``, and why.  With CUDA:
    ``auto`` (zero-copy ``lmcache_driven``).  Without: ``lmcache_driven`` too (vLLM's KV cache
    in a ``/dev/shm`` segment per worker that the server maps: a 516 MiB restore took 1.6 s
    against 5.5 s pickled) for the layouts in :data:`PROVEN_CPU_LMCACHE_DRIVEN`, when
    ``/dev/shm`` has room for every worker's ``VLLM_CPU_KVCACHE_SPACE`` (a full tmpfs kills a
    worker with SIGBUS), and when the server runs as this account (a worker's segment is its
    own, mode 0600: a server of another account cannot map it, and the worker's registration
    fails); otherwise ``engine_driven`` (pickled over ZMQ)."""
    try:
        import torch

        if torch.cuda.is_available():
            return "auto", "CUDA"
    except Exception:  # torch missing or broken: certainly no CUDA transfer path
        pass
    tp, pp = layout
    if layout not in PROVEN_CPU_LMCACHE_DRIVEN:
        return "engine_driven", (f"no CUDA, and lmcache_driven is proven on CPU only for "
                                 f"TP 1-2 at PP 1 and PP 2 at TP 1 (this is TP {tp}, PP {pp})")
    if server_uid is not None and server_uid != os.geteuid():
        return "engine_driven", (f"no CUDA, and the server runs as another account (uid "
                                 f"{server_uid}), which cannot map this account's {shm_dir} "
                                 "segments")
    env = os.environ if environ is None else environ
    space = env.get("VLLM_CPU_KVCACHE_SPACE", "").strip()
    if not space.isdigit() or int(space) <= 0:
        return "engine_driven", ("no CUDA, and VLLM_CPU_KVCACHE_SPACE does not say how much of "
                                 f"{shm_dir} the KV cache would take")
    workers = tp * pp
    need = (int(space) << 30) * workers
    try:
        free = shm_free_bytes(shm_dir)
    except OSError as exc:
        return "engine_driven", f"no CUDA, and {shm_dir} cannot be used ({exc.strerror})"
    total = f"{workers} x {space} GiB KV cache" if workers > 1 else f"{space} GiB KV cache"
    if free < need + (need >> 3):  # the KV caches and room to spare (other segments)
        return "engine_driven", (f"no CUDA, and {shm_dir} has {free / 2**30:.1f} GiB free for a "
                                 f"{total}")
    return "lmcache_driven", f"no CUDA; the {total} fits in {shm_dir}"


def kv_transfer_config(
    settings: ServerSettings,
    pins: str | Path,
    *,
    launcher: LauncherSettings | None = None,
    chat_template_file: str | None = None,
    extra: dict[str, Any] | None = None,
    layout: tuple[int, int] = (1, 1),
) -> dict[str, Any]:
    pins_path = Path(pins).absolute()
    if not pins_path.is_file():
        raise FileNotFoundError(f"identity pins file {pins_path} does not exist")
    run = launcher or load_launcher_settings()
    extra_config: dict[str, Any] = {
        "lmcache.mp.server_urls": settings.request_url,
        "lmcache.mp.mp_transfer_mode": run.transfer_mode or default_transfer_mode(
            layout=layout)[0],
        "lmcache.mp.heartbeat_interval": run.heartbeat_s,
        "lmcache.mp.mq_timeout": run.mq_timeout_s,
        "kvpersist.pins": str(pins_path),
        "kvpersist.http_url": settings.http_url,
        "kvpersist.cache_root": str(settings.cache_root),
        "kvpersist.lookup_timeout_s": run.lookup_timeout_s,
        "kvpersist.lookup_max_s": run.lookup_max_s,
        "kvpersist.chunk_size": settings.chunk_size,
    }
    if run.bypass:
        extra_config["kvpersist.cache_bypass"] = True
    if chat_template_file:
        extra_config["kvpersist.chat_template_file"] = str(Path(chat_template_file).absolute())
    if extra:
        extra_config.update(extra)
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        # A KV load that fails (a server that died or flapped mid-retrieve) costs a recompute,
        # never a failed request: vLLM's default policy, "fail", errors the request (and, seen
        # with vLLM 0.32 on a 2 GiB restore, took the engine down).
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra_config,
    }


#: Container runtimes whose ``exec`` starts vLLM with none of the launcher's environment: the
#: variables :func:`container_variables` picks are handed over as ``-e NAME=value``.
CONTAINER_RUNTIMES = ("docker", "podman", "nerdctl")
#: What a vLLM process needs of the launcher's environment inside a container.
CONTAINER_PREFIXES = ("KVP_", "KV_PERSIST", "VLLM_", "LMCACHE_", "HF_", "DO_NOT_TRACK")


def container_variables(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables a containerised vLLM gets from the launcher (telemetry off included); the
    site file's name is not among them (the file is the host's), its settings are."""
    env = dict(effective_environ(environ))
    env.update(process_env({}))
    return {k: v for k, v in sorted(env.items())
            if k.startswith(CONTAINER_PREFIXES) and k != CONFIG_VARIABLE and v != ""}


def exec_prefix(launcher: LauncherSettings, environ: Mapping[str, str]) -> list[str]:
    """``KVP_VLLM_EXEC`` as words; for ``docker/podman/nerdctl exec`` with the environment vLLM
    needs passed in (``-e``), since such an exec inherits none of it."""
    words = shlex.split(launcher.vllm_exec)
    if not words:
        return []
    if launcher.python is None:
        raise SettingsError("KVP_VLLM_EXEC needs KVP_PYTHON: the Python with vLLM, LMCache and "
                            "kvpersist where the prefix runs it (this host's "
                            f"{sys.executable} means nothing inside a container)")
    if Path(words[0]).name in CONTAINER_RUNTIMES and words[1:2] == ["exec"]:
        passed = [f"-e{k}={v}" for k, v in container_variables(environ).items()]
        return [words[0], "exec", *passed, *words[2:]]
    return words


def vllm_command(model: str, recipe_args: Sequence[str], *, launcher: LauncherSettings,
                 settings: ServerSettings | None,
                 environ: Mapping[str, str] | None = None) -> list[str]:
    """The full command: the recipe's arguments, plus the connector when persistence is on."""
    args = list(recipe_args)
    if launcher.persist:
        if launcher.identity_pins is None:
            raise SettingsError("KVP_IDENTITY_PINS is not set: point it at "
                                "configs/<model>/identity.env (or set KV_PERSIST=0)")
        assert settings is not None
        config = kv_transfer_config(settings, launcher.identity_pins, launcher=launcher,
                                    chat_template_file=recipe_flags(args).chat_template)
        args += ["--kv-transfer-config", json.dumps(config, separators=(",", ":"))]
        if PROMPT_DETAILS_FLAG not in args:  # clients see usage.prompt_tokens_details.cached_tokens
            args.append(PROMPT_DETAILS_FLAG)
    python = launcher.python or sys.executable
    prefix = exec_prefix(launcher, os.environ if environ is None else environ)
    return [*prefix, python, *VLLM_ENTRY, "--model", model, *args]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvp-vllm",
        usage="kvp-vllm MODEL [vLLM args...]  |  kvp-vllm --print-config --pins FILE",
        description="Run vLLM's OpenAI server with the kvpersist KV connector. The recipe's vLLM "
        "arguments pass through unchanged; --kv-transfer-config is added. Environment: "
        "KV_PERSIST=1 (default; 0 runs the recipe without the connector), KVP_IDENTITY_PINS "
        "(configs/<model>/identity.env), KVP_CACHE_ROOT/KVP_RUNTIME_DIR (the server's sockets; "
        "KVP_ACCESS=tcp: KVP_BIND_HOST/KVP_ZMQ_PORT/KVP_HTTP_PORT), KVP_CACHE_BYPASS=1 (keep the "
        "connector and its identity, never look up or store), "
        "KVP_LOOKUP_TIMEOUT_S, KVP_LOOKUP_MAX_S, KVP_HEARTBEAT_S, KVP_MQ_TIMEOUT_S, KVP_MP_TRANSFER_MODE, "
        "KVP_PYTHON (the Python with vLLM), KVP_VLLM_EXEC (a prefix such as "
        "'docker exec <container>': docker/podman exec get the KVP_*, VLLM_*, LMCACHE_*, HF_* "
        "variables as -e; needs KVP_PYTHON). Every KVP_ setting may come from the site "
        "configuration file (KVP_CONFIG, default /etc/kvpersist/kvpersist.env).",
    )
    parser.add_argument("--print-config", action="store_true",
                        help="print the --kv-transfer-config JSON and exit")
    parser.add_argument("--pins", help="with --print-config: the identity pins file")
    parser.add_argument("--chat-template", help="with --print-config: vLLM's --chat-template")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "--print-config"):
        args = _parser().parse_args(argv)
        if not args.print_config:
            _parser().print_help()
            return 0 if argv else 2
        if not args.pins:
            print("kvp-vllm: --print-config needs --pins FILE", file=sys.stderr)
            return 2
    try:
        launcher = load_launcher_settings()
        settings = load_settings() if launcher.persist or argv[0] == "--print-config" else None
        if argv[0] == "--print-config":
            assert settings is not None
            config = kv_transfer_config(settings, args.pins, launcher=launcher,
                                        chat_template_file=args.chat_template)
            print(json.dumps(config, separators=(",", ":")))
            return 0
        mode, why = launcher.transfer_mode, "KVP_MP_TRANSFER_MODE"
        if launcher.persist and not mode:  # resolved once: the mode printed is the mode given
            mode, why = default_transfer_mode(layout=parallel_layout(argv[1:]),
                                              server_uid=server_account(settings))
            launcher = dataclasses.replace(launcher, transfer_mode=mode)
        command = vllm_command(argv[0], argv[1:], launcher=launcher, settings=settings)
    except (SettingsError, FileNotFoundError) as exc:
        print(f"kvp-vllm: {exc}", file=sys.stderr)
        return 2
    print("kvpersist: KV persistence " + (f"on (pins {launcher.identity_pins})"
          if launcher.persist else "off (KV_PERSIST=0): the recipe runs without the connector"),
          file=sys.stderr)
    if launcher.persist:
        print(f"kvpersist: LMCache transfer mode {mode} ({why})", file=sys.stderr)
    swept = sweep_stale_segments()
    if swept.segments:
        print(f"kvpersist: removed {swept} left by earlier vLLM runs", file=sys.stderr)
    orphans = sweep_python_segments()
    if orphans.segments:
        print(f"kvpersist: removed {orphans.segments} orphaned Python shared-memory segment(s) "
              f"({orphans.bytes / 2**30:.2f} GiB) left by killed vLLM runs", file=sys.stderr)
    env = process_env()
    env.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.execvpe(command[0], command, env)


if __name__ == "__main__":
    raise SystemExit(main())
