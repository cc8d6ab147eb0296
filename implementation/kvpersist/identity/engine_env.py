"""vLLM's environment variables and LMCache's connector options, classified once, as data: what
each does to KV.  The environment's counterpart of :mod:`kvpersist.identity.engine_fields`.

A variable of ``vllm.envs`` is either *neutral* (never changes the KV of a token sequence; the
reason is its group's) or *closes the gate* when it is set at all: kvpersist cannot key what it
changes.  LMCache's MP connector reads ``lmcache.*`` keys of ``kv_connector_extra_config``; each is
neutral or closes the gate unless it holds a safe value, and a key nobody classified closes it.

Invariants
----------
* Closed world: a contract test (``tests/identity/test_engine_env.py``) fails on a variable of
  the installed ``vllm.envs`` that has no entry here, on an entry vLLM no longer has, and on an
  ``lmcache.*`` option LMCache's connector reads that has no entry.  A vLLM upgrade cannot add a
  KV-changing variable in silence.
* A closing variable closes when it is present in the engine's environment with any value but
  its default (:data:`ENV_DEFAULTS`; one without a listed default closes whenever it is set: a
  miss, never a wrong hit).
* This module imports neither vLLM nor LMCache.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .engine_fields import _KERNEL, _NETWORK, _OBSERVE, ClosesGate, Neutral

_PROCESSES = "process layout, placement, memory sizes and cache folders: where, not what"
_FRONTEND = ("the API front end, request limits and media fetching (the token IDs and the "
             "items' inputs carry what reaches the model)")
_LOGGING = _OBSERVE
_BUILD = "how vLLM was built or installed (the build identity carries the version and platform)"
_USAGE = "usage statistics"
_PP_SPLIT = ("the pipeline stages' layer split: an uneven one is refused, an even one is the "
             "default split")
_WHICH_BLOCKS = ("which KV-cache manager frees blocks, not the KV computed (the store fence "
                 "covers every free)")
_PLATFORM = "the target device: the build identity carries the platform"
_MAMBA = ("the Mamba state layout: hybrid models close the gate (cache_config.mamba_block_size), "
          "and vLLM's CPU platform sets it itself")

#: Variables that close the gate when set (to anything but their default), with what they change.
CLOSING_ENV: dict[str, str] = {
    "VLLM_KV_CACHE_LAYOUT": "another KV-cache layout than the one LMCache registered and kvpersist stored",
    "VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT": "a shuffled KV-cache layout on ROCm",
    "VLLM_MLA_DISABLE": "MLA models computed as plain attention: another KV geometry and content",
    "VLLM_TEST_FORCE_LOAD_FORMAT": "weights not read from the checkpoint the identity digests",
    "VLLM_MODEL_REDIRECT_PATH": "the model loaded from another folder than the one the identity digests",
    "VLLM_USE_MODELSCOPE": "weights from ModelScope's cache, which kvpersist does not digest",
    "VLLM_HUMMING_ONLINE_QUANT_CONFIG": ("weights quantized online (another computation than "
                                         "the checkpoint's)"),
    "VLLM_HUMMING_INPUT_QUANT_CONFIG": "activations quantized online",
    "VLLM_MARLIN_INPUT_DTYPE": "activations quantized to int8 or fp8 in Marlin kernels",
    "VLLM_B12X_MOE_FP4_FORCE_A16": "another activation precision in FP4 MoE kernels",
    "VLLM_CPU_INT4_W4A8": "int4 models on CPU computed with or without 8-bit activations",
    "VLLM_MOE_ROUTING_SIMULATION_STRATEGY": "simulated expert routing instead of the model's",
    "VLLM_FLOAT32_MATMUL_PRECISION": ("float32 matmuls in TF32 or bfloat16: a precision "
                                      "change, not kernel noise"),
    "VLLM_USE_V2_MODEL_RUNNER": ("another model runner, whose KV-cache handling kvpersist has "
                                 "not been checked against"),
}

#: The values (lower case) at which a closing variable changes nothing: its default.
ENV_DEFAULTS: dict[str, tuple[str, ...]] = {
    "VLLM_MLA_DISABLE": ("0", "false"),
    "VLLM_CPU_INT4_W4A8": ("1", "true"),
    "VLLM_FLOAT32_MATMUL_PRECISION": ("highest",),
    "VLLM_USE_V2_MODEL_RUNNER": ("0", "false"),
}

_NEUTRAL_GROUPS: dict[str, tuple[str, ...]] = {
    _KERNEL: (
    "VLLM_ALLREDUCE_USE_FLASHINFER", "VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC",
    "VLLM_ALLREDUCE_USE_SYMM_MEM", "VLLM_BATCH_INVARIANT",
    "VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER", "VLLM_CPU_ATTN_SPLIT_KV", "VLLM_DBO_COMM_SMS",
    "VLLM_DCP_Q_REPLICATE", "VLLM_DEEPEPLL_NVFP4_DISPATCH", "VLLM_DEEPEP_BUFFER_SIZE_MB",
    "VLLM_DEEPEP_HIGH_THROUGHPUT_FORCE_INTRA_NODE", "VLLM_DEEPEP_LOW_LATENCY_USE_MNNVL",
    "VLLM_DEEPEP_V2_ALLOW_HYBRID_MODE", "VLLM_DEEPEP_V2_ALLOW_MULTIPLE_REDUCTION",
    "VLLM_DEEPEP_V2_PREFER_OVERLAP", "VLLM_DEEP_GEMM_WARMUP", "VLLM_DISABLED_KERNELS",
    "VLLM_DISABLE_DSV4_MEGAMOE_SHARED_EXPERT_FUSION", "VLLM_DISABLE_PYNCCL",
    "VLLM_DISABLE_SHARED_EXPERTS_STREAM", "VLLM_DISTRIBUTED_USE_SPLIT_GROUP",
    "VLLM_ENABLE_CUDAGRAPH_GC", "VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE",
    "VLLM_ENABLE_GEMM_RS", "VLLM_ENABLE_HPC_OPS",
    "VLLM_ENABLE_INDUCTOR_COORDINATE_DESCENT_TUNING", "VLLM_ENABLE_INDUCTOR_MAX_AUTOTUNE",
    "VLLM_ENABLE_PREGRAD_PASSES", "VLLM_FASTSAFETENSORS_QUEUE_SIZE",
    "VLLM_FLASHINFER_ALLREDUCE_BACKEND", "VLLM_FLASHINFER_AUTOTUNE_SKIP_OPS",
    "VLLM_FLASHINFER_MOE_A2A_LOW_PRECISION_COMBINE",
    "VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE", "VLLM_FORCE_AOT_LOAD",
    "VLLM_GDN_DECODE_KERNEL", "VLLM_HAS_FLASHINFER_CUBIN", "VLLM_HUMMING_MOE_GEMM_TYPE",
    "VLLM_HUMMING_USE_F16_ACCUM", "VLLM_KIMI_K3_AUX_ATTN_RES_STREAM",
    "VLLM_KIMI_K3_GEMM_AR", "VLLM_KIMI_K3_SHARD_SP_SHARED_EXPERT", "VLLM_LORA_DISABLE_PDL",
    "VLLM_LORA_ENABLE_DUAL_STREAM", "VLLM_MARLIN_USE_ATOMIC_ADD",
    "VLLM_MAX_TOKENS_PER_EXPERT_FP4_MOE", "VLLM_MOE_SKIP_PADDING", "VLLM_MOE_USE_DEEP_GEMM",
    "VLLM_MULTI_STREAM_GEMM_TOKEN_THRESHOLD", "VLLM_MXFP4_EMULATION_DEQUANT_AT_LOAD",
    "VLLM_MXFP8_EMULATION_DEQUANT_AT_LOAD", "VLLM_REPLICATE_EMBED",
    "VLLM_ROCM_AITER_MEGA_MOE_FUSE_SHARED_EXPERTS", "VLLM_ROCM_AITER_MLA_ASM_PADDING",
    "VLLM_ROCM_AITER_MLA_DCP_VERIFY", "VLLM_ROCM_AITER_MOE_DISPATCH_POLICY",
    "VLLM_ROCM_FP8_MFMA_PAGE_ATTN", "VLLM_ROCM_FP8_PADDING", "VLLM_ROCM_MOE_PADDING",
    "VLLM_ROCM_MONO_DECODE", "VLLM_ROCM_QUICK_REDUCE_CAST_BF16_TO_FP16",
    "VLLM_ROCM_QUICK_REDUCE_MAX_SIZE_BYTES_MB", "VLLM_ROCM_QUICK_REDUCE_MIN_SIZE_BYTES_MB",
    "VLLM_ROCM_QUICK_REDUCE_QUANTIZATION",
    "VLLM_ROCM_QUICK_REDUCE_QUANTIZATION_MIN_SIZE_KB", "VLLM_ROCM_SLEEP_MEM_CHUNK_SIZE",
    "VLLM_ROCM_USE_AITER", "VLLM_ROCM_USE_AITER_CUSTOM_AR", "VLLM_ROCM_USE_AITER_FP4BMM",
    "VLLM_ROCM_USE_AITER_FP4_ASM_GEMM", "VLLM_ROCM_USE_AITER_FP8BMM",
    "VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS", "VLLM_ROCM_USE_AITER_LINEAR",
    "VLLM_ROCM_USE_AITER_LINEAR_HIPBMM", "VLLM_ROCM_USE_AITER_MHA",
    "VLLM_ROCM_USE_AITER_MLA", "VLLM_ROCM_USE_AITER_MOE",
    "VLLM_ROCM_USE_AITER_MOE_A4W4_DSV4", "VLLM_ROCM_USE_AITER_MOE_SITUV2",
    "VLLM_ROCM_USE_AITER_RMSNORM", "VLLM_ROCM_USE_AITER_TRITON_GEMM",
    "VLLM_ROCM_USE_AITER_TRITON_ROPE", "VLLM_ROCM_USE_AITER_TRITON_SPARSE_MLA",
    "VLLM_ROCM_USE_AITER_UNIFIED_ATTENTION", "VLLM_ROCM_USE_SKINNY_GEMM",
    "VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD", "VLLM_TPU_USING_PATHWAYS",
    "VLLM_TRITON_FORCE_FIRST_CONFIG", "VLLM_TRITON_JIT_WARMUP_NUM_THREADS",
    "VLLM_TRITON_USE_TD", "VLLM_USE_BREAKABLE_CUDAGRAPH", "VLLM_USE_BYTECODE_HOOK",
    "VLLM_USE_DEEP_GEMM", "VLLM_USE_DEEP_GEMM_E8M0",
    "VLLM_USE_DEEP_GEMM_TMA_ALIGNED_SCALES", "VLLM_USE_DIRECT_DCP_A2A",
    "VLLM_USE_DIRECT_DCP_KV_GATHER", "VLLM_USE_DIRECT_DCP_Q_GATHER",
    "VLLM_USE_FLASHINFER_MOE_INT4", "VLLM_USE_FLASHINFER_SAMPLER",
    "VLLM_USE_FUSED_MOE_GROUPED_TOPK", "VLLM_USE_HW_AGNOSTIC", "VLLM_USE_LAYERNAME",
    "VLLM_USE_MEGA_AOT_ARTIFACT", "VLLM_USE_NCCL_SYMM_MEM", "VLLM_USE_OINK_OPS",
    "VLLM_USE_SPINLOOP_EXT", "VLLM_USE_TRITON_AWQ", "VLLM_XLA_USE_SPMD",
    "VLLM_XPU_FORCE_N_CONTIG_WEIGHT", "VLLM_XPU_INC_WNA16_BACKEND",
    "VLLM_XPU_PP_MICROBATCH", "VLLM_XPU_USE_SAMPLER_KERNEL", "VLLM_ZENTORCH_WEIGHT_PREPACK",
    ),
    _PROCESSES: (
    "CUDA_HOME", "CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH", "LOCAL_RANK",
    "VLLM_ASSETS_CACHE", "VLLM_ASSETS_CACHE_MODEL_CLEAN", "VLLM_CACHE_ROOT",
    "VLLM_COMPILE_CACHE_SAVE_FORMAT", "VLLM_CONFIG_ROOT", "VLLM_CPU_CI_ENV",
    "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_OMP_THREADS_BIND",
    "VLLM_CUDART_SO_PATH", "VLLM_CUDA_COMPATIBILITY_PATH", "VLLM_DISABLE_COMPILE_CACHE",
    "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "VLLM_DP_RANK", "VLLM_DP_RANK_LOCAL",
    "VLLM_DP_SIZE", "VLLM_ELASTIC_EP_DRAIN_REQUESTS", "VLLM_ELASTIC_EP_SCALE_UP_LAUNCH",
    "VLLM_ENABLE_CUDA_COMPATIBILITY", "VLLM_ENABLE_STARTUP_PLAN",
    "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR",
    "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "VLLM_KV_OFFLOAD_MAX_BATCH_DESCRIPTORS",
    "VLLM_MQ_MAX_CHUNK_BYTES_MB", "VLLM_MSGPACK_ZERO_COPY_THRESHOLD", "VLLM_NCCL_SO_PATH",
    "VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME", "VLLM_PROCESS_NAME_PREFIX",
    "VLLM_RANDOMIZE_DP_DUMMY_INPUTS", "VLLM_RAY_BUNDLE_INDICES",
    "VLLM_RAY_DP_PACK_STRATEGY", "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY",
    "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY", "VLLM_RAY_PER_WORKER_GPUS",
    "VLLM_SYSTEM_START_DATE", "VLLM_TUNED_CONFIG_FOLDER", "VLLM_USE_AOT_COMPILE",
    "VLLM_USE_RAY_COMPILED_DAG_CHANNEL_TYPE", "VLLM_USE_RAY_COMPILED_DAG_OVERLAP_COMM",
    "VLLM_USE_RAY_V2_EXECUTOR_BACKEND", "VLLM_USE_RAY_WRAPPED_PP_COMM",
    "VLLM_USE_SIMPLE_KV_OFFLOAD", "VLLM_USE_STANDALONE_COMPILE",
    "VLLM_V1_OUTPUT_PROC_CHUNK_SIZE", "VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY",
    "VLLM_WEIGHT_OFFLOADING_DISABLE_UVA", "VLLM_WORKER_MULTIPROC_METHOD",
    "VLLM_WSL2_ENABLE_PIN_MEMORY", "VLLM_XLA_CACHE_PATH", "VLLM_XLA_CHECK_RECOMPILATION",
    ),
    _NETWORK: (
    "MOONCAKE_PREFERRED_SEGMENT", "MOONCAKE_REQUESTER_LOCAL_HOSTNAME", "S3_ACCESS_KEY_ID",
    "S3_ENDPOINT_URL", "S3_SECRET_ACCESS_KEY", "VLLM_API_KEY", "VLLM_AUDIO_FETCH_TIMEOUT",
    "VLLM_CHAT_TEMPLATE_RENDER_TIMEOUT", "VLLM_DP_MASTER_IP", "VLLM_DP_MASTER_PORT",
    "VLLM_EC_SIDE_CHANNEL_HOST", "VLLM_EC_SIDE_CHANNEL_PORT", "VLLM_ENGINE_READY_TIMEOUT_S",
    "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "VLLM_GPU_NIC_PCIE_MAPPING", "VLLM_HOST_IP",
    "VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "VLLM_IMAGE_FETCH_TIMEOUT",
    "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", "VLLM_LOOPBACK_IP",
    "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT", "VLLM_MOONCAKE_BOOTSTRAP_PORT",
    "VLLM_MOONCAKE_CONNECTOR_TIMEOUT", "VLLM_MOONCAKE_DISK_STAGING_USABLE_RATIO",
    "VLLM_MOONCAKE_LOAD_RECV_THREADS", "VLLM_NIC_SELECTION_VARS",
    "VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT",
    "VLLM_P2P_HANDSHAKE_TIMEOUT_S", "VLLM_P2P_IDLE_TIMEOUT_S", "VLLM_P2P_MAX_PEERS",
    "VLLM_P2P_SIDE_CHANNEL_HOST", "VLLM_P2P_SIDE_CHANNEL_PORT", "VLLM_PORT",
    "VLLM_RAY_DP_PLACEMENT_NODE_IPS", "VLLM_REGEX_COMPILATION_TIMEOUT_S",
    "VLLM_RPC_BASE_PATH", "VLLM_SKIP_P2P_CHECK", "VLLM_TOOL_PARSE_REGEX_TIMEOUT_SECONDS",
    "VLLM_VIDEO_FETCH_TIMEOUT", "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS",
    ),
    _FRONTEND: (
    "VLLM_ALLOW_INSECURE_SERIALIZATION", "VLLM_ALLOW_LONG_MAX_MODEL_LEN",
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ENABLE_COHERE_API",
    "VLLM_ENABLE_RESPONSES_API_STORE", "VLLM_ENFORCE_STRICT_TOOL_CALLING",
    "VLLM_GPT_OSS_HARMONY_SYSTEM_INSTRUCTIONS", "VLLM_GPT_OSS_SYSTEM_TOOL_MCP_LABELS",
    "VLLM_LORA_RESOLVER_CACHE_DIR", "VLLM_LORA_RESOLVER_HF_REPO_LIST",
    "VLLM_MAX_AUDIO_CLIP_FILESIZE_MB", "VLLM_MAX_AUDIO_DECODE_BYTES",
    "VLLM_MAX_AUDIO_DECODE_DURATION_S", "VLLM_MAX_AUDIO_PREPROCESS_WORKERS",
    "VLLM_MAX_BAD_WORDS_TOTAL_TOKENS", "VLLM_MAX_COMPLETION_PROMPTS",
    "VLLM_MAX_EMBED_DECODE_BYTES", "VLLM_MAX_IMAGE_PIXELS",
    "VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB", "VLLM_MAX_NUM_BAD_WORDS", "VLLM_MAX_N_SEQUENCES",
    "VLLM_MAX_STOP_STRINGS", "VLLM_MEDIA_CACHE", "VLLM_MEDIA_CACHE_MAX_SIZE_MB",
    "VLLM_MEDIA_CACHE_TTL_HOURS", "VLLM_MEDIA_CONNECTOR", "VLLM_MEDIA_FETCH_MAX_RETRIES",
    "VLLM_MEDIA_LOADING_THREAD_COUNT", "VLLM_MEDIA_URL_ALLOW_REDIRECTS", "VLLM_PLUGINS",
    "VLLM_RUST_FRONTEND_PATH", "VLLM_SERVER_DEV_MODE", "VLLM_SKIP_MODEL_NAME_VALIDATION",
    "VLLM_TOOL_JSON_ERROR_AUTOMATIC_RETRY", "VLLM_USE_EXPERIMENTAL_PARSER_CONTEXT",
    "VLLM_USE_FASTOKENS", "VLLM_USE_RUST_BENCH", "VLLM_USE_RUST_FRONTEND",
    "VLLM_V1_USE_OUTLINES_CACHE", "VLLM_VIDEO_LOADER_BACKEND", "VLLM_XGRAMMAR_CACHE_MB",
    ),
    _LOGGING: (
    "FORCE_COLOR", "NO_COLOR", "VERBOSE", "VLLM_ADAPTIVE_VERIFICATION_PROFILE_CONTEXT_LEN",
    "VLLM_COMPUTE_NANS_IN_LOGITS", "VLLM_CONFIGURE_LOGGING",
    "VLLM_CUSTOM_SCOPES_FOR_PROFILING", "VLLM_DEBUG_DUMP_PATH",
    "VLLM_DEBUG_LOG_API_SERVER_RESPONSE", "VLLM_DEBUG_MFU_METRICS", "VLLM_DEBUG_WORKSPACE",
    "VLLM_DISABLE_LOG_LOGO", "VLLM_GC_DEBUG", "VLLM_GPU_SYNC_CHECK", "VLLM_LOGGING_COLOR",
    "VLLM_LOGGING_CONFIG_PATH", "VLLM_LOGGING_LEVEL", "VLLM_LOGGING_PREFIX",
    "VLLM_LOGGING_STREAM", "VLLM_LOG_BATCHSIZE_INTERVAL", "VLLM_LOG_MODEL_INSPECTION",
    "VLLM_LOG_STATS_INTERVAL", "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS",
    "VLLM_MOONCAKE_STORE_TIER_LOG", "VLLM_NVTX_SCOPES_FOR_PROFILING",
    "VLLM_PATTERN_MATCH_DEBUG", "VLLM_RAISE_ON_LOGIT_NANS",
    "VLLM_RINGBUFFER_WARNING_INTERVAL", "VLLM_SPARSE_INDEXER_MAX_LOGITS_MB",
    "VLLM_TRACE_FUNCTION",
    ),
    _BUILD: (
    "CMAKE_BUILD_TYPE", "MAX_JOBS", "NVCC_THREADS", "VLLM_BUILD_COMMIT",
    "VLLM_BUILD_PIPELINE", "VLLM_BUILD_URL", "VLLM_DOCKER_BUILD_CONTEXT", "VLLM_IMAGE_TAG",
    "VLLM_MAIN_CUDA_VERSION", "VLLM_NCCL_INCLUDE_PATH",
    "VLLM_SKIP_PRECOMPILED_VERSION_SUFFIX", "VLLM_SKIP_VERSION_SUFFIX",
    "VLLM_USE_PRECOMPILED", "VLLM_USE_PRECOMPILED_RUST",
    ),
    _USAGE: (
    "VLLM_DO_NOT_TRACK", "VLLM_NO_USAGE_STATS", "VLLM_USAGE_SOURCE",
    "VLLM_USAGE_STATS_SERVER",
    ),
    _PP_SPLIT: (
    "VLLM_PP_LAYER_PARTITION",
    ),
    _WHICH_BLOCKS: (
    "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE",
    ),
    _MAMBA: ("VLLM_SSM_CONV_STATE_LAYOUT",),
    _PLATFORM: (
    "VLLM_TARGET_DEVICE",
    ),
}

#: Every neutral variable, with its group's reason.
NEUTRAL_ENV: dict[str, str] = {name: why for why, names in _NEUTRAL_GROUPS.items()
                               for name in names}

#: LMCache's MP-connector options (``kv_connector_extra_config``), classified.
EXTRA_CONFIG: dict[str, Neutral | ClosesGate] = {
    "lmcache.mp.server_urls": Neutral(_NETWORK),
    "lmcache.mp.host": Neutral(_NETWORK),
    "lmcache.mp.port": Neutral(_NETWORK),
    "lmcache.mp.mq_timeout": Neutral(_NETWORK),
    "lmcache.mp.heartbeat_interval": Neutral(_NETWORK),
    "lmcache.mp.mp_transfer_mode": Neutral("how KV travels between vLLM and the server, not "
                                           "what it is"),
    "lmcache.mp.autostart": ClosesGate("LMCache starting its own server, outside kvpersist's "
                                       "launcher and L2", safe=(None, False)),
    "lmcache.mp.autostart.server_args": ClosesGate("LMCache starting its own server",
                                                   safe=(None,)),
    "lmcache.mp.autostart.wait_timeout": Neutral(_NETWORK),
    "lmcache.mp.eager_prefetch": Neutral("when a lookup is sent, not what it finds"),
    "lmcache.mp.nonblocking_lookup_status": Neutral("how the scheduler polls a lookup"),
    "lmcache.mp.isolated_ipc": Neutral("how KV travels between containers, not what it is"),
    "lmcache.mp.use_vmm_api": Neutral("how GPU memory is shared with the server"),
    "lmcache.mp.hash_algorithm": Neutral("the chunk hashes KV events report; the server keys "
                                         "objects with its own algorithm"),
    "lmcache.mp.lazy_offload": Neutral("when a store is sent; the store fence and the "
                                       "dropped-store rule account for it"),
    "lmcache.mp.save_decode_cache": Neutral("also stores chunks whose KV was computed in decode "
                                            "steps: the same tokens' KV up to the kernel noise "
                                            "vLLM's own prefix cache accepts (it reuses decode "
                                            "blocks too)"),
    "lmcache.mp.transfer_intermediate_tensors": ClosesGate(
        "pipeline stages' intermediate tensors through LMCache, which kvpersist does not key",
        safe=(None, False)),
}


def closing_env_reasons(environ: Mapping[str, str]) -> list[str]:
    """Why the engine's environment cannot be cached: each closing variable that is set."""
    return [f"vLLM environment variable {name}={environ[name]!r} ({why})"
            for name, why in CLOSING_ENV.items()
            if name in environ and environ[name].strip().lower() not in ENV_DEFAULTS.get(name, ())]


def closing_extra_config_reasons(extra: Mapping[str, Any]) -> list[str]:
    """Why LMCache's connector options cannot be cached: an unclassified ``lmcache.*`` key, or
    a closing one that holds an unsafe value."""
    reasons = []
    for key, value in extra.items():
        if not key.startswith("lmcache."):
            continue
        decision = EXTRA_CONFIG.get(key)
        if decision is None:
            reasons.append(f"LMCache option {key} is not classified (kvpersist cannot tell what "
                           "it does to the KV)")
        elif isinstance(decision, ClosesGate) and value not in decision.safe:
            reasons.append(f"LMCache option {key}={value!r} ({decision.why})")
    return reasons
