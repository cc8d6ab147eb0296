"""Every field of vLLM's engine configuration, classified once, as data: what it does to KV.

"Any unknown field turns caching off" covers the whole ``VllmConfig``, not only the fields of
:class:`~kvpersist.identity.fields.CacheIdentity`.  Each field (``<sub-config>.<field>``, or a
top-level ``VllmConfig`` field by its own name) is exactly one of:

* :class:`Namespace` -- it changes the KV bytes the engine computes for a token sequence, and
  the namespace fields it names carry it (a change is a new namespace);
* :class:`PerRequest` -- it changes KV per request (a LoRA adapter, multimodal input, prompt
  embeddings); the request's key carries it (:mod:`kvpersist.serving.connector.request_keys`);
* :class:`Neutral` -- it never changes the KV of a token sequence (with the one-line reason);
* :class:`ClosesGate` -- kvpersist cannot key it: caching stays off unless the field holds
  one of its ``safe`` values (the default that keeps KV unchanged).

Invariants
----------
* The table is closed-world: ``kvpersist.serving.lmcache_compat.engine_config.unclassified``
  lists every field of the installed vLLM's configuration that has no entry, and a contract
  test fails on any (a vLLM upgrade cannot add a KV-changing knob in silence).  This module
  imports no vLLM (``kvp-admin`` reads it on hosts without one).
* Floating-point differences of kernels and batch shapes (compilation, CUDA graphs, attention
  backends, scheduling) are *neutral*: they are the noise vLLM's own prefix cache accepts
  between requests of one engine, not a different computation.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Namespace:
    """Carried by these :class:`~kvpersist.identity.fields.CacheIdentity` fields."""

    fields: tuple[str, ...]
    why: str = ""


@dataclass(frozen=True)
class PerRequest:
    """Changes KV per request; the request's key carries it."""

    why: str


@dataclass(frozen=True)
class Neutral:
    """Never changes the KV of a token sequence."""

    why: str


@dataclass(frozen=True)
class ClosesGate:
    """kvpersist cannot key it: caching is off unless the value is one of ``safe``."""

    why: str
    safe: tuple[Any, ...] = (None, False)


Decision = Namespace | PerRequest | Neutral | ClosesGate

# Reasons shared by many fields (one line each, as the table wants).
_RUNTIME = "a run-time or resource knob: where and how fast, not what is computed"
_OBSERVE = "observability only (logs, metrics, traces, profiling)"
_SCHED = "scheduling and batching decide when tokens are computed, not their KV"
_KERNEL = "a kernel or backend choice: the same computation up to floating-point noise"
_NETWORK = "addresses, ports and process layout of the deployment"
_OUTPUT = "acts on sampling or output after the forward pass; the KV is computed before it"
_DERIVED = "derived by vLLM from fields classified elsewhere"
_FRONTEND = "the API front end (tokenizer process, media fetching, request parsing)"
_CONNECTOR = "the KV connector's own configuration (kvpersist itself)"

_DRAFT = ("a draft model's KV layers, stored with the target's in every chunk: digested "
          "as the engine resolves them")
_CKPT = "the checkpoint's config (with hf_overrides) is hashed into model_config_sha256"
_LORA_KEY = "folded into each adapter's key with the adapter's content digest"
_MM_HASH = "a factor of vLLM's multimodal content hash, which the request key carries"
_CP_ONLY = "acts only with context parallelism, whose sizes close the gate"
_NO_DRAFT_MODEL = "a model-free proposer's setting (n-gram, suffix): no draft KV"
_PREFIX_CACHE = "vLLM's own prefix cache (granularity, hashing, retention), not the KV values"
_SUBCONFIG = "a nested configuration: its fields are classified one by one"
_MAMBA_ONLY = "acts only on recurrent-state models, which mamba_block_size closes"

#: The table.  Keys: ``<VllmConfig field>.<sub-config field>``, or a top-level field's name.
ENGINE_FIELDS: dict[str, Decision] = {
    # -- model_config
    "model_config.model": Namespace(("model_id",)),
    "model_config.model_weights": Neutral("the original object-storage URI of the same weights"),
    "model_config.runner": ClosesGate(
        "only generation runners are cached", safe=(None, "auto", "generate")
    ),
    "model_config.convert": ClosesGate(
        "a pooling adapter converts the model", safe=(None, "auto", "none")
    ),
    "model_config.tokenizer": Namespace(("tokenizer_id",)),
    "model_config.tokenizer_mode": Neutral("decides token ids and rendering; the key is the ids"),
    "model_config.trust_remote_code": Neutral("a permission; the code is pinned by the revisions"),
    "model_config.dtype": Namespace(("model_dtype",)),
    "model_config.seed": Neutral(_OUTPUT),
    "model_config.hf_config": Namespace(("model_config_sha256",), _CKPT),
    "model_config.hf_text_config": Namespace(("model_config_sha256",), _CKPT),
    "model_config.is_submodel_config": Neutral(_DERIVED),
    "model_config.word_embeddings_untied_by_checkpoint": Neutral(
        "derived from the checkpoint; the LM head acts after the KV"
    ),
    "model_config.hf_config_path": ClosesGate("a config other than the checkpoint's", safe=(None,)),
    "model_config.allowed_local_media_path": Neutral(_FRONTEND),
    "model_config.allowed_media_domains": Neutral(_FRONTEND),
    "model_config.revision": Namespace(("model_revision",)),
    "model_config.code_revision": ClosesGate("model code at another revision", safe=(None,)),
    "model_config.tokenizer_revision": Namespace(("tokenizer_revision",)),
    "model_config.max_model_len": Namespace(("max_model_len",)),
    "model_config.spec_target_max_model_len": Neutral(_DERIVED),
    "model_config.quantization": Namespace(("quantization",)),
    "model_config.quantization_config": ClosesGate(
        "user online-quantization spec (layers, ignore patterns): not keyed", safe=(None,)
    ),
    "model_config.allow_deprecated_quantization": Neutral("a permission only"),
    "model_config.enforce_eager": Neutral(_KERNEL),
    "model_config.return_sampling_mask": Neutral(_OUTPUT),
    "model_config.max_logprobs": Neutral(_OUTPUT),
    "model_config.logprobs_mode": Neutral(_OUTPUT),
    "model_config.use_fp64_gumbel": Neutral(_OUTPUT),
    "model_config.enable_trace_replay": Neutral(_OUTPUT),
    "model_config.disable_sliding_window": ClosesGate(
        "sliding window disabled: not the checkpoint's attention", safe=(None, False)
    ),
    "model_config.disable_cascade_attn": Neutral(_KERNEL),
    "model_config.skip_tokenizer_init": Neutral(_FRONTEND),
    "model_config.enable_prompt_embeds": PerRequest(
        "a request with prompt embeddings bypasses the cache (no content key)"
    ),
    "model_config.served_model_name": Neutral("the API name of the model"),
    "model_config.config_format": Neutral("reads the same checkpoint's config (hf or mistral)"),
    "model_config.hf_token": Neutral("credentials"),
    "model_config.hf_overrides": Namespace(("model_config_sha256",), _CKPT),
    "model_config.model_class_overrides": ClosesGate("another model class", safe=(None, {}, ())),
    "model_config.generation_config": Neutral(_OUTPUT),
    "model_config.override_generation_config": Neutral(_OUTPUT),
    "model_config.enable_sleep_mode": ClosesGate(
        "sleep mode frees and remaps vLLM's KV memory while the LMCache server keeps its "
        "registration of it: a transfer after a wake-up could reach memory that is no longer "
        "the KV cache", safe=(False,)),
    "model_config.sleep_preserve_parameter_names": Neutral(_RUNTIME),
    "model_config.sleep_mode_backend": Neutral(_RUNTIME),
    "model_config.sleep_mode_offload_cudagraph": Neutral(_RUNTIME),
    "model_config.enable_nccl_comm_suspend": Neutral(_RUNTIME),
    "model_config.enable_cumem_allocator": Neutral(_RUNTIME),
    "model_config.model_impl": ClosesGate(
        "an unknown model implementation", safe=(None, "auto", "vllm", "transformers")
    ),
    "model_config.logits_processors": Neutral(_OUTPUT),
    "model_config.io_processor_plugin": Neutral(_FRONTEND),
    "model_config.renderer_num_workers": Neutral(_RUNTIME),
    "model_config.pooler_config": Neutral(_OUTPUT),
    "model_config.multimodal_config": Neutral(_SUBCONFIG),
    # -- model_config.multimodal_config
    "model_config.multimodal_config.language_model_only": Neutral(
        "text-only mode: the language model and its KV are unchanged"
    ),
    "model_config.multimodal_config.limit_per_prompt": Neutral("admission limits and dummy sizes"),
    "model_config.multimodal_config.enable_mm_embeds": PerRequest(
        "embedding inputs are content-hashed into the request key like media"
    ),
    "model_config.multimodal_config.media_io_kwargs": PerRequest(_MM_HASH),
    "model_config.multimodal_config.mm_processor_kwargs": Namespace(
        ("mm_processor_kwargs_sha256",),
        "engine-level processor kwargs are not in vLLM's mm hash, and a model may read them "
        "in its forward pass (Gemma 4's multimodal LoRA)"),
    "model_config.multimodal_config.mm_device_do_normalize": Neutral(_KERNEL),
    "model_config.multimodal_config.mm_processor_cache_gb": Neutral(_RUNTIME),
    "model_config.multimodal_config.mm_processor_cache_type": Neutral(_RUNTIME),
    "model_config.multimodal_config.mm_hasher_algorithm": Neutral(
        "the hash function of media digests: a change only misses"
    ),
    "model_config.multimodal_config.mm_shm_cache_max_object_size_mb": Neutral(_RUNTIME),
    "model_config.multimodal_config.mm_encoder_only": Neutral(
        "an encoder-only engine computes no language-model KV"
    ),
    "model_config.multimodal_config.mm_encoder_tp_mode": Neutral(_KERNEL),
    "model_config.multimodal_config.mm_encoder_attn_backend": Neutral(_KERNEL),
    "model_config.multimodal_config.mm_encoder_attn_dtype": ClosesGate(
        "FP8 encoder attention changes media embeddings", safe=(None,)
    ),
    "model_config.multimodal_config.mm_encoder_fp8_scale_path": ClosesGate(
        "static FP8 encoder scales change media embeddings", safe=(None,)
    ),
    "model_config.multimodal_config.mm_encoder_fp8_scale_save_path": Neutral(
        "writes calibrated scales out; acts only with FP8 encoder attention"
    ),
    "model_config.multimodal_config.mm_encoder_fp8_scale_save_margin": Neutral(
        "applies to saved scales only"
    ),
    "model_config.multimodal_config.interleave_mm_strings": Neutral(_FRONTEND),
    "model_config.multimodal_config.skip_mm_profiling": Neutral(_RUNTIME),
    "model_config.multimodal_config.video_pruning_rate": ClosesGate(
        "video token pruning is not in the content hash", safe=(None, 0, 0.0)
    ),
    "model_config.multimodal_config.video_pruning_method": Neutral(
        "acts only with video_pruning_rate, which closes the gate"
    ),
    "model_config.multimodal_config.mm_tensor_ipc": Neutral(_RUNTIME),
    "model_config.multimodal_config.allow_missing_mm_embeddings": Neutral(_DERIVED),
    "model_config.multimodal_config.mm_ipc_gpu_memory_gb": Neutral(_RUNTIME),
    # -- cache_config
    "cache_config.block_size": Namespace(("block_size",)),
    "cache_config.user_specified_block_size": Neutral(_DERIVED),
    "cache_config.kv_cache_layout": ClosesGate(
        "a physical layout LMCache cannot normalize",
        safe=(None, "LBNHC", "LBHNC", "BLHNC", "BLNHC"),
    ),
    "cache_config.prefix_match_unit": Neutral(_PREFIX_CACHE),
    "cache_config.gpu_memory_utilization": Neutral(_RUNTIME),
    "cache_config.cache_dtype": Namespace(("kv_cache_dtype",)),
    "cache_config.is_attention_free": Neutral(_DERIVED),
    "cache_config.num_gpu_blocks_override": Neutral(_RUNTIME),
    "cache_config.sliding_window": Namespace(("model_config_sha256",), _DERIVED),
    "cache_config.enable_prefix_caching": Neutral(_PREFIX_CACHE),
    "cache_config.prefix_caching_hash_algo": Neutral(_PREFIX_CACHE),
    "cache_config.prefix_cache_retention_interval": Neutral(_PREFIX_CACHE),
    "cache_config.kv_cache_dtype_skip_layers": ClosesGate(
        "mixed KV dtypes across layers (empty list = none)", safe=([], None, ())
    ),
    "cache_config.mamba_page_size_padded": Neutral(_DERIVED),
    "cache_config.skip_page_size_padded": Neutral(_DERIVED),
    "cache_config.mamba_block_size": ClosesGate(
        "a recurrent-state (Mamba/linear-attention) model: its state is not stored (LMCache "
        "0.5.6 keeps it only in vLLM's align mode, where vLLM frees state blocks while the "
        "request runs, outside the store fence; on a CPU engine it sizes each state object "
        "as a whole chunk and writes one block of it)",
        safe=(None,),
    ),
    "cache_config.mamba_cache_dtype": Neutral(_MAMBA_ONLY),
    "cache_config.mamba_ssm_cache_dtype": Neutral(_MAMBA_ONLY),
    "cache_config.mamba_cache_mode": Neutral(_MAMBA_ONLY),
    "cache_config.enable_mamba_shared_prefix_checkpoint": Neutral(_PREFIX_CACHE),
    "cache_config.replayssm_buffer_len": Neutral("acts only with use_replayssm, which closes"),
    "cache_config.use_replayssm": ClosesGate(
        "deferred SSM state write-back: the stored state may lag", safe=(None, False)
    ),
    "cache_config.use_kda_recoverssm": Neutral(_DERIVED),
    "cache_config.num_gpu_blocks": Neutral(_DERIVED),
    "cache_config.num_cpu_blocks": Neutral(_DERIVED),
    "cache_config.effective_attention_block_size": Namespace(("block_size",), _DERIVED),
    "cache_config.kv_cache_size_tokens": Neutral(_DERIVED),
    "cache_config.kv_cache_max_concurrency": Neutral(_DERIVED),
    "cache_config.hash_block_size": Neutral(_PREFIX_CACHE),
    "cache_config.cache_hit_alignment_tokens": Neutral(_PREFIX_CACHE),
    "cache_config.kv_sharing_fast_prefill": Neutral(
        "KV-sharing layers skip prompt tokens; they write no KV of their own"
    ),
    "cache_config.swa_bounded_replay": Neutral("how vLLM rebuilds window KV after a hit"),
    "cache_config.kv_cache_memory_bytes": Neutral(_RUNTIME),
    "cache_config.kv_offloading_size": Neutral(_RUNTIME),
    "cache_config.kv_offloading_backend": Neutral(_RUNTIME),
    "cache_config._block_size_resolved": Neutral(_DERIVED),
    # -- parallel_config
    "parallel_config.pipeline_parallel_size": Namespace(("pipeline_parallel_size",)),
    "parallel_config.tensor_parallel_size": Namespace(("tensor_parallel_size",)),
    "parallel_config.prefill_context_parallel_size": ClosesGate(
        "context parallelism shards KV across ranks", safe=(None, 1)
    ),
    "parallel_config.data_parallel_size": Neutral("each DP rank is an engine with the same KV"),
    "parallel_config.data_parallel_size_local": Neutral(_NETWORK),
    "parallel_config.data_parallel_rank": Neutral(_NETWORK),
    "parallel_config.data_parallel_rank_local": Neutral(_NETWORK),
    "parallel_config.data_parallel_master_ip": Neutral(_NETWORK),
    "parallel_config.data_parallel_rpc_port": Neutral(_NETWORK),
    "parallel_config.dp_sync_interval": Neutral(_SCHED),
    "parallel_config.data_parallel_master_port": Neutral(_NETWORK),
    "parallel_config.data_parallel_backend": Neutral(_NETWORK),
    "parallel_config.data_parallel_external_lb": Neutral(_NETWORK),
    "parallel_config.data_parallel_hybrid_lb": Neutral(_NETWORK),
    "parallel_config.is_moe_model": Neutral(_DERIVED),
    "parallel_config.enable_hc_sp": Neutral(_KERNEL),
    "parallel_config.enable_expert_parallel": Neutral(_KERNEL),
    "parallel_config.enable_batch_sharded_sampling": Neutral(_OUTPUT),
    "parallel_config.enable_ep_weight_filter": Neutral(_RUNTIME),
    "parallel_config.enable_eplb": Neutral(_KERNEL),
    "parallel_config.eplb_config": Neutral(_KERNEL),
    "parallel_config.expert_placement_strategy": Neutral(_KERNEL),
    "parallel_config.all2all_backend": Neutral(_KERNEL),
    "parallel_config.max_parallel_loading_workers": Neutral(_RUNTIME),
    "parallel_config.disable_custom_all_reduce": Neutral(_KERNEL),
    "parallel_config.enable_shm_tensor_arena": Neutral(_RUNTIME),
    "parallel_config.enable_elastic_ep": Neutral(_KERNEL),
    "parallel_config.elastic_ep_max_dp_size": Neutral(_RUNTIME),
    "parallel_config.enable_dbo": Neutral(_SCHED),
    "parallel_config.ubatch_size": Neutral(_SCHED),
    "parallel_config.dbo_decode_token_threshold": Neutral(_SCHED),
    "parallel_config.dbo_prefill_token_threshold": Neutral(_SCHED),
    "parallel_config.disable_nccl_for_dp_synchronization": Neutral(_NETWORK),
    "parallel_config.ray_workers_use_nsight": Neutral(_OBSERVE),
    "parallel_config.ray_runtime_env": Neutral(_RUNTIME),
    "parallel_config.placement_group": Neutral(_NETWORK),
    "parallel_config.distributed_executor_backend": Neutral(_NETWORK),
    "parallel_config.worker_cls": Neutral(_RUNTIME),
    "parallel_config.worker_extension_cls": Neutral(_RUNTIME),
    "parallel_config.master_addr": Neutral(_NETWORK),
    "parallel_config.master_port": Neutral(_NETWORK),
    "parallel_config.node_rank": Neutral(_NETWORK),
    "parallel_config.nnodes": Neutral(_NETWORK),
    "parallel_config.numa_bind": Neutral(_RUNTIME),
    "parallel_config.numa_bind_nodes": Neutral(_RUNTIME),
    "parallel_config.numa_bind_cpus": Neutral(_RUNTIME),
    "parallel_config.assigned_physical_gpu_ids": Neutral(_RUNTIME),
    "parallel_config.distributed_timeout_seconds": Neutral(_RUNTIME),
    "parallel_config.cpu_distributed_timeout_seconds": Neutral(_RUNTIME),
    "parallel_config.world_size": Neutral(_DERIVED),
    "parallel_config.rank": Neutral(_DERIVED),
    "parallel_config._data_parallel_master_port_list": Neutral(_NETWORK),
    "parallel_config._coord_store_port": Neutral(_NETWORK),
    "parallel_config.decode_context_parallel_size": ClosesGate(
        "context parallelism shards KV across ranks", safe=(None, 1)
    ),
    "parallel_config.dcp_kv_cache_interleave_size": Neutral(_CP_ONLY),
    "parallel_config.dcp_comm_backend": Neutral(_CP_ONLY),
    "parallel_config.dcp_q_replicate": Neutral(_CP_ONLY),
    "parallel_config.cp_kv_cache_interleave_size": Neutral(_CP_ONLY),
    "parallel_config._allow_auto_resolve_cp_interleave_size": Neutral(_CP_ONLY),
    "parallel_config.data_parallel_index": Neutral(_DERIVED),
    "parallel_config._api_process_count": Neutral(_FRONTEND),
    "parallel_config._api_process_rank": Neutral(_FRONTEND),
    "parallel_config.enable_fault_tolerance": Neutral(_RUNTIME),
    "parallel_config.fault_tolerance_config": Neutral(_RUNTIME),
    # -- scheduler_config
    "scheduler_config.runner_type": ClosesGate(
        "only generation runners are cached (resolved runner)", safe=(None, "generate")
    ),
    "scheduler_config.max_num_batched_tokens": Neutral(_SCHED),
    "scheduler_config.max_num_scheduled_tokens": Neutral(_SCHED),
    "scheduler_config.max_num_seqs": Neutral(_SCHED),
    "scheduler_config.max_num_active_seqs": Neutral(_SCHED),
    "scheduler_config.long_prefill_token_threshold": Neutral(_SCHED),
    "scheduler_config.long_prefill_token_threshold_adaptive": Neutral(_SCHED),
    "scheduler_config.max_num_queued_reqs": Neutral(_SCHED),
    "scheduler_config.max_num_queued_tokens": Neutral(_SCHED),
    "scheduler_config.enable_chunked_prefill": Neutral(_SCHED),
    "scheduler_config.is_multimodal_model": Neutral(_DERIVED),
    "scheduler_config.max_num_encoder_input_tokens": Neutral(_SCHED),
    "scheduler_config.encoder_cache_size": Neutral(_RUNTIME),
    "scheduler_config.policy": Neutral(_SCHED),
    "scheduler_config.disable_chunked_mm_input": Neutral(_SCHED),
    "scheduler_config.scheduler_cls": Neutral(_SCHED),
    "scheduler_config.disable_hybrid_kv_cache_manager": Neutral(
        "vLLM's page allocation across KV groups; per-token KV is unchanged"
    ),
    "scheduler_config.scheduler_reserve_full_isl": Neutral(_SCHED),
    "scheduler_config.watermark": Neutral(_SCHED),
    "scheduler_config.prefill_schedule_interval": Neutral(_SCHED),
    "scheduler_config.async_scheduling": Neutral(_SCHED),
    "scheduler_config.stream_interval": Neutral(_OUTPUT),
    # -- device_config
    "device_config.device": Neutral(_KERNEL),
    "device_config.device_type": Neutral(_DERIVED),
    # -- load_config
    "load_config.load_format": ClosesGate(
        "weights not read from the checkpoint (dummy, IPC or peer transfer)",
        safe=(
            None, "auto", "hf", "safetensors", "pt", "npcache", "fastsafetensors",
            "instanttensor", "mistral", "runai_streamer", "runai_streamer_sharded",
            "sharded_state", "tensorizer",
        ),
    ),
    "load_config.download_dir": Neutral(_RUNTIME),
    "load_config.safetensors_load_strategy": Neutral(_RUNTIME),
    "load_config.safetensors_prefetch_num_threads": Neutral(_RUNTIME),
    "load_config.safetensors_prefetch_block_size": Neutral(_RUNTIME),
    "load_config.model_loader_extra_config": ClosesGate(
        "loader options can name other weights (e.g. a tensorizer URI)", safe=(None, {}, ())
    ),
    "load_config.device": Neutral(_RUNTIME),
    "load_config.ignore_patterns": Neutral("skips duplicate checkpoint copies when downloading"),
    "load_config.use_tqdm_on_load": Neutral(_OBSERVE),
    "load_config.pt_load_map_location": Neutral(_RUNTIME),
    # -- offload_config
    "offload_config.offload_backend": Neutral(_RUNTIME),
    "offload_config.uva": Neutral(_RUNTIME),
    "offload_config.prefetch": Neutral(_RUNTIME),
    # -- attention_config
    "attention_config.backend": Neutral(_KERNEL),
    "attention_config.minimax_m3_msa_decode_backend": Neutral(_KERNEL),
    "attention_config.backend_per_kind": Neutral(_KERNEL),
    "attention_config.flash_attn_version": Neutral(_KERNEL),
    "attention_config.flash_attn_max_num_splits_for_cuda_graph": Neutral(_KERNEL),
    "attention_config.tokenspeed_mla_min_split_kv": Neutral(_KERNEL),
    "attention_config.tq_max_kv_splits_for_cuda_graph": Neutral(_KERNEL),
    "attention_config.use_trtllm_attention": Neutral(_KERNEL),
    "attention_config.disable_flashinfer_q_quantization": Neutral(_KERNEL),
    "attention_config.mla_prefill_backend": Neutral(_KERNEL),
    "attention_config.use_prefill_query_quantization": ClosesGate(
        "quantized prefill queries: a lossier computation", safe=(None, False)
    ),
    "attention_config.indexer_kv_dtype": ClosesGate(
        "sparse-attention indexer cache dtype is not in the namespace", safe=(None, "auto")
    ),
    "attention_config.indexer_sparse_logits": Neutral(_KERNEL),
    "attention_config.hisparse_config": Neutral("where sparse-MLA KV rows live, not their values"),
    "attention_config.use_non_causal": ClosesGate(
        "bidirectional attention: KV depends on later tokens", safe=(False, None)
    ),
    "attention_config.sparse_mla_force_mqa": Neutral(_KERNEL),
    "attention_config.sparse_mla_prefill_workspace_factor": Neutral(_RUNTIME),
    "attention_config.flex_attn_block_m": Neutral(_KERNEL),
    "attention_config.flex_attn_block_n": Neutral(_KERNEL),
    "attention_config.flex_attn_q_block_size": Neutral(_KERNEL),
    "attention_config.flex_attn_kv_block_size": Neutral(_KERNEL),
    # -- aux_output_config
    "aux_output_config.enable_return_routed_experts": Neutral(_OUTPUT),
    "aux_output_config.max_bytes": Neutral(_OUTPUT),
    # -- engram_config
    "engram_config.cpu_offload": Neutral(_RUNTIME),
    "engram_config.embedding_across_dp": Neutral(_RUNTIME),
    "engram_config.dp_shared_memory": Neutral(_RUNTIME),
    "engram_config.use_thp": Neutral(_RUNTIME),
    # -- mamba_config
    "mamba_config.backend": Neutral(_KERNEL),
    "mamba_config.enable_stochastic_rounding": ClosesGate(
        "random rounding of stored SSM states", safe=(None, False)
    ),
    "mamba_config.stochastic_rounding_philox_rounds": Neutral(
        "acts only with stochastic rounding, which closes the gate"
    ),
    "mamba_config.ssu_algorithm": Neutral(_KERNEL),
    # -- kernel_config
    "kernel_config.ir_op_priority": Neutral(_KERNEL),
    "kernel_config.enable_flashinfer_autotune": Neutral(_KERNEL),
    "kernel_config.enable_rocm_segmented_attn_autotune": Neutral(_KERNEL),
    "kernel_config.enable_cutedsl_warmup": Neutral(_RUNTIME),
    "kernel_config.enable_jit_warmup": Neutral(_RUNTIME),
    "kernel_config.moe_backend": Neutral(_KERNEL),
    "kernel_config.sparse_indexer_topk_backend": Neutral(_KERNEL),
    "kernel_config.linear_backend": Neutral(_KERNEL),
    "kernel_config.linear_backend_per_quant": Neutral(_KERNEL),
    # -- lora_config
    "lora_config.max_lora_rank": Neutral("capacity: lower-rank adapters are zero-padded"),
    "lora_config.max_loras": Neutral(_RUNTIME),
    "lora_config.fully_sharded_loras": Neutral(_KERNEL),
    "lora_config.max_cpu_loras": Neutral(_RUNTIME),
    "lora_config.lora_dtype": PerRequest(_LORA_KEY),
    "lora_config.target_modules": PerRequest(_LORA_KEY),
    "lora_config.default_mm_loras": PerRequest("applied as the request's adapter (keyed)"),
    "lora_config.enable_tower_connector_lora": PerRequest(_LORA_KEY),
    "lora_config.specialize_active_lora": Neutral(_KERNEL),
    "lora_config.enable_mixed_moe_lora_format": Neutral(_KERNEL),
    "lora_config.enable_moe_shared_loras": PerRequest(_LORA_KEY),
    "lora_config.max_lora_cls_labels": Neutral(_OUTPUT),
    # -- speculative_config
    "speculative_config.enforce_eager": Neutral(_KERNEL),
    "speculative_config.num_speculative_tokens": Namespace(("draft_sha256",), _DRAFT),
    "speculative_config.model": Namespace(("draft_sha256",), _DRAFT),
    "speculative_config.method": Namespace(("draft_sha256",), _DRAFT),
    "speculative_config.draft_tensor_parallel_size": Namespace(("draft_sha256",), _DRAFT),
    "speculative_config.tensor_parallel_size": Namespace(("draft_sha256",), _DRAFT),
    "speculative_config.quantization": Namespace(("draft_sha256",), _DRAFT),
    "speculative_config.moe_backend": Neutral(_KERNEL),
    "speculative_config.attention_backend": Neutral(_KERNEL),
    "speculative_config.kv_cache_dtype": Namespace(("draft_sha256",), _DRAFT),
    "speculative_config.max_model_len": Namespace(("draft_sha256",), _DRAFT),
    "speculative_config.revision": Namespace(("draft_sha256",), _DRAFT),
    "speculative_config.code_revision": ClosesGate("draft code at another revision", safe=(None,)),
    "speculative_config.index_share_for_mtp_iteration": Namespace(("draft_sha256",), _DRAFT),
    "speculative_config.disable_padded_drafter_batch": Neutral(_SCHED),
    "speculative_config.disable_eagle_block_drop": Neutral(_PREFIX_CACHE),
    "speculative_config.use_local_argmax_reduction": Neutral(_OUTPUT),
    "speculative_config.use_heterogeneous_vocab": Namespace(("draft_sha256",), _DRAFT),
    "speculative_config.prompt_lookup_max": Neutral(_NO_DRAFT_MODEL),
    "speculative_config.prompt_lookup_min": Neutral(_NO_DRAFT_MODEL),
    "speculative_config.parallel_drafting": Namespace(("draft_sha256",), _DRAFT),
    "speculative_config.target_model_config": Neutral(_DERIVED),
    "speculative_config.target_parallel_config": Neutral(_DERIVED),
    "speculative_config.num_speculative_tokens_per_batch_size": Namespace(("draft_sha256",), _DRAFT),
    "speculative_config.draft_model_config": Namespace(("draft_sha256",), _DRAFT),
    "speculative_config.draft_parallel_config": Namespace(("draft_sha256",), _DRAFT),
    "speculative_config.suffix_decoding_max_tree_depth": Neutral(_NO_DRAFT_MODEL),
    "speculative_config.suffix_decoding_max_cached_requests": Neutral(_NO_DRAFT_MODEL),
    "speculative_config.suffix_decoding_max_spec_factor": Neutral(_NO_DRAFT_MODEL),
    "speculative_config.suffix_decoding_min_token_prob": Neutral(_NO_DRAFT_MODEL),
    "speculative_config.draft_load_config": Neutral("how the draft's weights are read, not which"),
    "speculative_config.rejection_sample_method": Neutral(_OUTPUT),
    "speculative_config.synthetic_acceptance_rates": Neutral(_OUTPUT),
    "speculative_config.synthetic_acceptance_length": Neutral(_OUTPUT),
    "speculative_config.enable_adaptive_verification": Neutral(_OUTPUT),
    "speculative_config.draft_sample_method": Neutral(_OUTPUT),
    "speculative_config.dspark_draft_topk": Neutral(_OUTPUT),
    # -- watermark_config (biases sampling only)
    "watermark_config.key": Neutral(_OUTPUT),
    "watermark_config.algorithm": Neutral(_OUTPUT),
    "watermark_config.alpha": Neutral(_OUTPUT),
    "watermark_config.context_width": Neutral(_OUTPUT),
    "watermark_config.deduplicate_contexts": Neutral(_OUTPUT),
    "watermark_config.deduplicate_contexts_max_history": Neutral(_OUTPUT),
    "watermark_config.prf": Neutral(_OUTPUT),
    "watermark_config.allow_target_only_watermarking": Neutral(_OUTPUT),
    # -- diffusion_config (dLLMs denoise a canvas: not prefix KV)
    "diffusion_config.canvas_length": ClosesGate("a diffusion language model", safe=(None,)),
    "diffusion_config.max_denoising_steps": ClosesGate("a diffusion language model", safe=(None,)),
    # -- structured_outputs_config
    "structured_outputs_config.backend": Neutral(_OUTPUT),
    "structured_outputs_config.disable_any_whitespace": Neutral(_OUTPUT),
    "structured_outputs_config.disable_additional_properties": Neutral(_OUTPUT),
    "structured_outputs_config.reasoning_parser": Neutral(_OUTPUT),
    "structured_outputs_config.reasoning_parser_plugin": Neutral(_OUTPUT),
    "structured_outputs_config.enable_in_reasoning": Neutral(_OUTPUT),
    # -- observability_config
    "observability_config.show_hidden_metrics_for_version": Neutral(_OBSERVE),
    "observability_config.otlp_traces_endpoint": Neutral(_OBSERVE),
    "observability_config.collect_detailed_traces": Neutral(_OBSERVE),
    "observability_config.per_request_spec_decode_metrics": Neutral(_OBSERVE),
    "observability_config.kv_cache_metrics": Neutral(_OBSERVE),
    "observability_config.kv_cache_metrics_sample": Neutral(_OBSERVE),
    "observability_config.custom_histogram_buckets": Neutral(_OBSERVE),
    "observability_config.cudagraph_metrics": Neutral(_OBSERVE),
    "observability_config.enable_layerwise_nvtx_tracing": Neutral(_OBSERVE),
    "observability_config.enable_mfu_metrics": Neutral(_OBSERVE),
    "observability_config.enable_mm_processor_stats": Neutral(_OBSERVE),
    "observability_config.enable_logging_iteration_details": Neutral(_OBSERVE),
    "observability_config.jit_monitor_mode": Neutral(_OBSERVE),
    "observability_config.jit_monitor_verbose": Neutral(_OBSERVE),
    # -- logging_config
    "logging_config.log_level": Neutral(_OBSERVE),
    "logging_config.formatter": Neutral(_OBSERVE),
    "logging_config.configure_logging": Neutral(_OBSERVE),
    "logging_config.pylogging_config_file": Neutral(_OBSERVE),
    # -- compilation_config
    "compilation_config.mode": Neutral(_KERNEL),
    "compilation_config.debug_dump_path": Neutral(_OBSERVE),
    "compilation_config.cache_dir": Neutral(_RUNTIME),
    "compilation_config.compile_cache_save_format": Neutral(_RUNTIME),
    "compilation_config.backend": Neutral(_KERNEL),
    "compilation_config.custom_ops": Neutral(_KERNEL),
    "compilation_config.ir_enable_torch_wrap": Neutral(_KERNEL),
    "compilation_config.splitting_ops": Neutral(_KERNEL),
    "compilation_config.compile_mm_encoder": Neutral(_KERNEL),
    "compilation_config.cudagraph_mm_encoder": Neutral(_KERNEL),
    "compilation_config.encoder_cudagraph_token_budgets": Neutral(_KERNEL),
    "compilation_config.encoder_cudagraph_max_vision_items_per_batch": Neutral(_KERNEL),
    "compilation_config.encoder_cudagraph_max_frames_per_batch": Neutral(_KERNEL),
    "compilation_config.cudagraph_decoder_replay": Neutral(_KERNEL),
    "compilation_config.decoder_replay_cudagraph_capture_sizes": Neutral(_KERNEL),
    "compilation_config.decoder_replay_trim_threshold": Neutral(_KERNEL),
    "compilation_config.compile_sizes": Neutral(_KERNEL),
    "compilation_config.compile_ranges_endpoints": Neutral(_KERNEL),
    "compilation_config.inductor_compile_config": Neutral(_KERNEL),
    "compilation_config.inductor_passes": Neutral(_KERNEL),
    "compilation_config.cudagraph_mode": Neutral(_KERNEL),
    "compilation_config.cudagraph_num_of_warmups": Neutral(_KERNEL),
    "compilation_config.cudagraph_capture_sizes": Neutral(_KERNEL),
    "compilation_config.cudagraph_copy_inputs": Neutral(_KERNEL),
    "compilation_config.cudagraph_specialize_lora": Neutral(_KERNEL),
    "compilation_config.use_inductor_graph_partition": Neutral(_KERNEL),
    "compilation_config.pass_config": Neutral(_KERNEL),
    "compilation_config.max_cudagraph_capture_size": Neutral(_KERNEL),
    "compilation_config.dynamic_shapes_config": Neutral(_KERNEL),
    "compilation_config.local_cache_dir": Neutral(_RUNTIME),
    "compilation_config.fast_moe_cold_start": Neutral(_RUNTIME),
    "compilation_config.enabled_custom_ops": Neutral(_DERIVED),
    "compilation_config.disabled_custom_ops": Neutral(_DERIVED),
    "compilation_config.traced_files": Neutral(_DERIVED),
    "compilation_config.compilation_time": Neutral(_OBSERVE),
    "compilation_config.encoder_compilation_time": Neutral(_OBSERVE),
    "compilation_config.static_forward_context": Neutral(_DERIVED),
    "compilation_config.static_all_moe_layers": Neutral(_DERIVED),
    # -- profiler_config
    "profiler_config.profiler": Neutral(_OBSERVE),
    "profiler_config.torch_profiler_dir": Neutral(_OBSERVE),
    "profiler_config.torch_profiler_activities": Neutral(_OBSERVE),
    "profiler_config.proton_profiler_dir": Neutral(_OBSERVE),
    "profiler_config.proton_context": Neutral(_OBSERVE),
    "profiler_config.proton_data": Neutral(_OBSERVE),
    "profiler_config.proton_backend": Neutral(_OBSERVE),
    "profiler_config.proton_mode": Neutral(_OBSERVE),
    "profiler_config.proton_hook": Neutral(_OBSERVE),
    "profiler_config.proton_output_format": Neutral(_OBSERVE),
    "profiler_config.proton_graph_attribution": Neutral(_OBSERVE),
    "profiler_config.torch_profiler_with_stack": Neutral(_OBSERVE),
    "profiler_config.torch_profiler_with_flops": Neutral(_OBSERVE),
    "profiler_config.torch_profiler_use_gzip": Neutral(_OBSERVE),
    "profiler_config.torch_profiler_dump_cuda_time_total": Neutral(_OBSERVE),
    "profiler_config.torch_profiler_record_shapes": Neutral(_OBSERVE),
    "profiler_config.torch_profiler_with_memory": Neutral(_OBSERVE),
    "profiler_config.capture_torch_profiler": Neutral(_OBSERVE),
    "profiler_config.detailed_trace_annotation": Neutral(_OBSERVE),
    "profiler_config.ignore_frontend": Neutral(_OBSERVE),
    "profiler_config.delay_iterations": Neutral(_OBSERVE),
    "profiler_config.max_iterations": Neutral(_OBSERVE),
    "profiler_config.warmup_iterations": Neutral(_OBSERVE),
    "profiler_config.active_iterations": Neutral(_OBSERVE),
    "profiler_config.wait_iterations": Neutral(_OBSERVE),
    # -- kv_transfer_config
    "kv_transfer_config.kv_connector": Neutral(_CONNECTOR),
    "kv_transfer_config.engine_id": Neutral(_CONNECTOR),
    "kv_transfer_config.kv_buffer_device": Neutral(_CONNECTOR),
    "kv_transfer_config.kv_role": Neutral(_CONNECTOR),
    "kv_transfer_config.kv_port": Neutral(_CONNECTOR),
    "kv_transfer_config.kv_connector_extra_config": Neutral(_CONNECTOR),
    "kv_transfer_config.kv_connector_module_path": Neutral(_CONNECTOR),
    "kv_transfer_config.enable_permute_local_kv": Neutral(_CONNECTOR),
    "kv_transfer_config.kv_load_failure_policy": Neutral(_CONNECTOR),
    # -- kv_events_config
    "kv_events_config.enable_kv_cache_events": Neutral(_OBSERVE),
    "kv_events_config.publisher": Neutral(_OBSERVE),
    "kv_events_config.endpoint": Neutral(_OBSERVE),
    "kv_events_config.replay_endpoint": Neutral(_OBSERVE),
    "kv_events_config.buffer_steps": Neutral(_OBSERVE),
    "kv_events_config.hwm": Neutral(_OBSERVE),
    "kv_events_config.max_queue_size": Neutral(_OBSERVE),
    "kv_events_config.topic": Neutral(_OBSERVE),
    # -- ec_transfer_config (media embeddings computed by another engine)
    "ec_transfer_config.ec_connector": ClosesGate(
        "media embeddings from another engine's encoder", safe=(None,)
    ),
    "ec_transfer_config.engine_id": Neutral(_NETWORK),
    "ec_transfer_config.ec_buffer_device": Neutral(_RUNTIME),
    "ec_transfer_config.ec_buffer_size": Neutral(_RUNTIME),
    "ec_transfer_config.ec_role": ClosesGate(
        "media embeddings from another engine's encoder", safe=(None,)
    ),
    "ec_transfer_config.ec_ip": Neutral(_NETWORK),
    "ec_transfer_config.ec_port": Neutral(_NETWORK),
    "ec_transfer_config.ec_connector_extra_config": Neutral(
        "acts only with an EC connector, which closes the gate"
    ),
    "ec_transfer_config.ec_connector_module_path": ClosesGate(
        "media embeddings from another engine's encoder", safe=(None,)
    ),
    "ec_transfer_config.mm_encoder_output_widths": Neutral(_DERIVED),
    # -- ec_manager_config
    "ec_manager_config.encoder_cache_manager_cls": ClosesGate(
        "a custom encoder cache may supply embeddings from elsewhere", safe=(None,)
    ),
    "ec_manager_config.manager_config": Neutral(
        "acts only with a custom encoder cache manager, which closes the gate"
    ),
    # -- reasoning_config
    "reasoning_config.reasoning_parser": Neutral(_OUTPUT),
    "reasoning_config.reasoning_start_str": Neutral(_OUTPUT),
    "reasoning_config.reasoning_end_str": Neutral(_OUTPUT),
    "reasoning_config._reasoning_start_token_ids": Neutral(_OUTPUT),
    "reasoning_config._reasoning_end_token_ids": Neutral(_OUTPUT),
    "reasoning_config._natural_reasoning_end_token_ids": Neutral(_OUTPUT),
    "reasoning_config._enabled": Neutral(_OUTPUT),
    # -- weight_transfer_config
    "weight_transfer_config.backend": Neutral(_RUNTIME),
    # -- top-level VllmConfig fields
    "quant_config": Namespace(("quantization", "model_config_sha256"), _DERIVED),
    "additional_config": ClosesGate(
        "free-form platform and kernel options: not keyed", safe=(None, {}, ())
    ),
    "instance_id": Neutral(_NETWORK),
    "optimization_level": Neutral(_KERNEL),
    "performance_mode": Neutral(_SCHED),
    "shutdown_timeout": Neutral(_RUNTIME),
}


#: Fields of vLLM releases newer than the tested one, classified by reading that release's
#: source (``kvp-admin compat --vllm <wheel>`` lists them), with the release that added each.
#: They are part of :data:`ENGINE_FIELDS`; an older vLLM lacks them, which is not staleness
#: (:func:`expected_absent`).
ADDED_AFTER_TESTED: dict[str, tuple[str, Decision]] = {
    "cache_config.simple_cpu_offload_num_blocks": ("0.33.0", Neutral(
        "vLLM's own CPU-offload connector's block count, set by vLLM (init=False)")),
    "attention_config.trtllm_ragged_backend": ("0.33.0", Neutral(
        _KERNEL + "; FP8 queries come from use_prefill_query_quantization, which closes")),
    "attention_config.indexer_tp_shard_min_rows": ("0.33.0", Neutral(
        "splits the sparse indexer's scoring work over TP ranks; the same rows are scored")),
    "attention_config.minimax_m3_indexer_cp": ("0.33.0", Neutral(
        "shards the indexer's decode work, not the KV; vLLM selects the same blocks")),
    "kernel_config.monokernel": ("0.33.0", Neutral(_KERNEL + " (a fused decode-layer kernel)")),
    "speculative_config.disable_lookahead_block_hashes": ("0.33.0", Neutral(_PREFIX_CACHE)),
    "speculative_config.draft_lm_head_quantization": ("0.33.0", Neutral(
        "the drafter's copy of the head; the target verifies with its own (acceptance only)")),
    "speculative_config.xpress_topc": ("0.33.0", Neutral(
        "narrows an XPress drafter's candidates; the target's KV is unchanged")),
    "speculative_config.fly_window_size": ("0.33.0", Neutral(_OUTPUT + " (FLy acceptance)")),
    "speculative_config.fly_entropy_threshold": ("0.33.0", Neutral(
        _OUTPUT + " (FLy acceptance)")),
    "speculative_config.fly_entropy_top_k": ("0.33.0", Neutral(_OUTPUT + " (FLy acceptance)")),
    "watchdog_config.timeout": ("0.33.0", Neutral(_OBSERVE + ": a stack-dump watchdog")),
    "watchdog_config.check_interval": ("0.33.0", Neutral(_OBSERVE + ": a stack-dump watchdog")),
    "watchdog_config.dump_dir": ("0.33.0", Neutral(_OBSERVE + ": a stack-dump watchdog")),
}
ENGINE_FIELDS.update({name: decision for name, (_, decision) in ADDED_AFTER_TESTED.items()})


def _release(version: str) -> tuple[int, ...]:
    """``"0.33.0rc1"`` -> ``(0, 33, 0)``: the leading numeric release segments."""
    parts = []
    for piece in version.split("."):
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        if not digits:
            break
        parts.append(int(digits))
        if digits != piece:
            break
    return tuple(parts)


def expected_absent(name: str, vllm_version: str | None) -> bool:
    """Whether a vLLM of ``vllm_version`` lacks entry ``name`` because a later release added
    it (so its absence there is not a stale entry).  A source tree of unknown version may be
    any release, so it may lack them too."""
    added = ADDED_AFTER_TESTED.get(name)
    return added is not None and (vllm_version is None
                                  or _release(vllm_version) < _release(added[0]))


_MISSING = object()


def _value(vllm_config: Any, name: str) -> Any:
    obj = vllm_config
    for part in name.split("."):
        if obj is None:
            return None
        obj = getattr(obj, part, _MISSING)
        if obj is _MISSING:
            return _MISSING
    return obj


def _is_safe(value: Any, safe: tuple[Any, ...]) -> bool:
    if value is _MISSING:
        return True  # the field does not exist in this vLLM: nothing set it
    for candidate in safe:
        if value is candidate:
            return True
        try:
            if value == candidate:
                return True
        except Exception:  # an object whose == fails is not one of the safe values
            continue
    # empty containers count as "not set"
    return value is not None and hasattr(value, "__len__") and len(value) == 0 and () in safe


#: Speculative proposers that draft from the tokens alone (prompt-lookup n-grams, suffix
#: trees): no draft model, no draft KV layers; the target's prefill KV, all a chunk holds, is
#: what it would be without them.
DRAFT_FREE_METHODS = ("ngram", "ngram_gpu", "suffix")


def closing_reasons(vllm_config: Any) -> list[str]:
    """Why this engine's configuration cannot be cached: each :class:`ClosesGate` field that
    holds an unsafe value.  (Unclassified fields are the contract test's business; at run time
    the installed vLLM is the tested one or the pins check has already said so.)  The
    ``speculative_config`` of a draft-free proposer (:data:`DRAFT_FREE_METHODS`) closes
    nothing."""
    draft_free = _value(vllm_config, "speculative_config.method") in DRAFT_FREE_METHODS
    reasons = []
    for name, decision in ENGINE_FIELDS.items():
        if not isinstance(decision, ClosesGate):
            continue
        if draft_free and name.startswith("speculative_config."):
            continue
        value = _value(vllm_config, name)
        if not _is_safe(value, decision.safe):
            reasons.append(f"vLLM setting {name}={_short(value)} ({decision.why})")
    return reasons


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
