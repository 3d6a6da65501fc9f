"""Our config's keys against DeepSpeed 0.19.8's, checked from outside: every key DeepSpeed reads
(`tests/engine/fixtures/ds_config_keys.json`, recorded from DeepSpeed itself by
`scripts/record_ds_config_keys.py`) is one our schema lists (read, or refused by name), or is
listed below with the reason we leave it out; every key we read is DeepSpeed's or listed as our
own; and where both read a key, both apply the same default unless listed. A key DeepSpeed adds,
or one we add, fails here until it is read or listed: the differences stay written down.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from minispeed.core.sections import is_alias, is_unsupported
from minispeed.engine.config.schema import config_schema

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "ds_config_keys.json"
RECORDED = json.loads(FIXTURE.read_text())
DS: dict[str, dict[str, Any]] = RECORDED["keys"]
SCHEMA = config_schema()

_NO_ALL_REDUCE_FETCH = "stage-3 parameters are fetched by all-gather only"
_FP32_MASTERS = "our masters (and the optimizer states) stay fp32 under fp16 and bf16"

# DeepSpeed 0.19.8 keys that we neither read nor refuse by name (an unknown key to us: refused
# with the keys the section accepts), a key or a whole section, and why.
NOT_OURS: dict[str, str] = {
    "bf16.bf16_master_weights_and_grads": _FP32_MASTERS,
    "bf16.bf16_optimizer_states": _FP32_MASTERS,
    "bf16.check_grad_overflow": "bf16 has no loss scale here, so no overflow check",
    "bf16.immediate_grad_update": "gradients are accumulated into the reduce buckets, one path",
    "fp16.fp16_master_weights_and_grads": _FP32_MASTERS,
    "fp16.auto_cast": "the model's inputs are the script's: no automatic cast to fp16",
    "checkpoint.checkpoint_serialization": "one checkpoint format (torch.save, written atomically)",
    "checkpoint.writer": "DeepSpeed's fast checkpoint writers; ours: torch.save, atomically",
    "datastates_ckpt": "DataStates-LLM's asynchronous checkpoint engine",
    "data_parallel_size": "read by deepspeed.initialize for its device mesh; ours is the grid's",
    "sequence_parallel_size": "no Ulysses sequence parallelism",
    "data_types.param_dtype": "the dtypes come from fp16 / bf16; data_types sets the gradients'",
    "data_types.buffer_dtype": "the dtypes come from fp16 / bf16; data_types sets the gradients'",
    "data_types.keep_in_fp32_modules": "no per-module fp32 exceptions",
    "dataloader_drop_last": "no deepspeed_io data loader: the script builds its own",
    "disable_python_gc": "the engine never drives Python's garbage collector",
    "gradient_allreduce_op": "gradients are averaged over the data-parallel ranks (its default)",
    "log_level": "the engine logs through the minispeed logger; set its level there",
    "managed_gradient_accumulation": "the engine always owns the accumulation boundary",
    "vocabulary_size": "only read by DeepSpeed for a tensor-core alignment warning",
    "expert_parallel": "DeepSpeed's AutoEP (experts found in a model by pattern); ours: moe.MoE",
    "pipeline.use_reentrant": "the pipeline's activation checkpointing uses torch's non-reentrant",
    "tensor_parallel.dtype": "AutoTP's inference keys: we read autotp_size for training",
    "tensor_parallel.injection_policy_tuple": "AutoTP's inference keys: we read autotp_size",
    "tensor_parallel.keep_module_on_host": "AutoTP's inference keys: we read autotp_size",
    "tensor_parallel.kernel_inject": "AutoTP's inference keys: we read autotp_size",
    "tensor_parallel.replace_with_kernel_inject": "AutoTP's inference keys: we read autotp_size",
    "tensor_parallel.preset_model": "our tensor-parallel plan is found from the model",
    "tensor_parallel.partition_config": "our tensor-parallel plan is found from the model",
    "tensor_parallel.tensor_parallel": "AutoTP's nested inference section",
    "tensor_parallel.tp": "AutoTP's nested inference section",
    "tensor_parallel.tp_overlap_comm": "the tensor-parallel all-reduces are not overlapped",
    "tensor_parallel.vocab_parallel_ce_backend": "no vocabulary-parallel cross-entropy",
    "tensor_parallel.vocab_parallel_lm_head": "no vocabulary-parallel cross-entropy",
    "zero_optimization.allgather_sequential": _NO_ALL_REDUCE_FETCH,
    "zero_optimization.stage3_allgather_sequential": _NO_ALL_REDUCE_FETCH,
    "zero_optimization.use_all_reduce_for_fetch_params": _NO_ALL_REDUCE_FETCH,
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": _NO_ALL_REDUCE_FETCH,
    "zero_optimization.model_persistence_threshold": "one persistence rule, per parameter",
    "zero_optimization.stage3_model_persistence_threshold": "one persistence rule, per parameter",
    "zero_optimization.module_granularity_threshold": "fetch units are modules, not merged",
    "zero_optimization.stage3_module_granularity_threshold": "fetch units are modules",
    "zero_optimization.leaf_module": "leaf modules are set in code (zero.set_leaf_module)",
    "zero_optimization.cpu_offload": "deprecated by DeepSpeed for offload_optimizer",
    "zero_optimization.cpu_offload_param": "deprecated by DeepSpeed for offload_param",
    "zero_optimization.cpu_offload_use_pin_memory": "deprecated by DeepSpeed for pin_memory",
    "zero_optimization.legacy_stage1": "DeepSpeed's old stage-1 code path",
    "zero_optimization.elastic_checkpoint": "ignored by DeepSpeed's ZeRO itself",
    "zero_optimization.load_from_fp32_weights": "a checkpoint always loads its fp32 masters",
    "zero_optimization.compute_grad_norm": "the norm is computed when clipping or asked for",
    "zero_optimization.enable_sanity_checks": "the checks that matter always run",
    "zero_optimization.log_trace_cache_warnings": "a changed module order is an error or re-traced",
    "zero_optimization.override_module_apply": "zero.Init always gathers for module.apply",
    "zero_optimization.parameter_alignment": "partitions are cut at elements, no alignment pad",
    "zero_optimization.pipeline_loading_checkpoint": "no ZeRO-3 pipeline-module loading path",
    "zero_optimization.memory_efficient_linear": "no replacement of torch's linear",
    "zero_optimization.save_muon_momentum_buffer_in_memory": "no Muon optimizer",
    "zero_optimization.use_multi_rank_bucket_allreduce": "one reduce path per stage",
    "zero_optimization.zero_quantized_nontrainable_weights": "frozen weights stay unquantized",
    "zero_optimization.zenflow": "DeepSpeed's ZenFlow (stale-gradient CPU updates)",
    "zero_optimization.offload_optimizer.super_offload": "DeepSpeed's SuperOffload (GH200)",
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": "SuperOffload's core share",
}

# Keys we read that DeepSpeed 0.19.8 does not, and why.
OURS_ONLY: dict[str, str] = {
    "aio.thread_count": "DeepSpeed's pre-0.14 spelling of aio.intra_op_parallelism",
    "checkpoint.async_save": "save_checkpoint writes in the background (our own)",
    "fp16.raise_error_at_min_scale": "DeepSpeed 0.19.8 no longer reads it (it always raises)",
    "pipeline.partition_method": "PipelineModule's partition_method, readable from the config",
    "pipeline.schedule": "our choice of pipeline schedule (1F1B, GPipe, interleaved)",
    "pipeline.virtual_stages": "the interleaved schedule's model chunks per rank",
    "zero_optimization.offload_optimizer.pipeline": "DeepSpeed reads pipeline_read and "
    "pipeline_write; ours also takes the pair's older single switch",
}

# Features DeepSpeed 0.19.8 removed (it refuses their keys with its own message) that we keep.
KEPT_REMOVED: dict[str, str] = {
    "zero_optimization.mics_shard_size": "MiCS is ours (issue 35)",
    "zero_optimization.mics_hierarchical_params_gather": "MiCS is ours (issue 35)",
}

# Keys both read whose default differs, and why.
DEFAULTS_DIFFER: dict[str, str] = {
    "zero_optimization.offload_optimizer.pin_memory": "page-locked only when asked (mlock on a "
    "CPU-only host needs the privilege)",
    "zero_optimization.offload_param.pin_memory": "as offload_optimizer.pin_memory",
    "zero_optimization.offload_param.max_in_cpu": "null: every shard to NVMe unless a count is "
    "given (DeepSpeed keeps the first 1e9 elements in host memory)",
    "pipeline.seed_layers": "ours seeds layer i with i by default; DeepSpeed leaves torch's RNG",
    "pipeline.pipe_partitioned": "no tensor parallelism inside the pipeline: only false accepted",
    "pipeline.grad_partitioned": "no tensor parallelism inside the pipeline: only false accepted",
}


def _ours(path: str) -> str | None:
    """How our schema takes `path`: "read", "refused" (named as DeepSpeed's and refused, or
    accepted at its default only), or None (unknown to it). Alias sections resolve to the key
    they are another name of; a key under an open object (`optimizer.params`) is read."""
    props, node = SCHEMA["properties"], None
    for key in path.split("."):
        if node is not None and "properties" not in node:
            return "read" if node.get("type") == "object" else None  # an open object
        if key not in props:
            return None
        node = props[key]
        if is_alias(node):
            node = props[re.search(r"`([^`]+)`", node["description"]).group(1)]
        if is_unsupported(node):
            return "refused"
        props = node.get("properties", {})
    return "read"


def _canonical(path: str) -> str:
    """`path` with each alias section replaced by the key it is another name of
    (`bfloat16.x` -> `bf16.x`)."""
    props, out = SCHEMA["properties"], []
    for key in path.split("."):
        node = props.get(key, {})
        if is_alias(node):
            key = re.search(r"`([^`]+)`", node["description"]).group(1)
            node = props[key]
        out.append(key)
        props = node.get("properties", {})
    return ".".join(out)


def _listed(path: str, listing: dict[str, str]) -> bool:
    path = _canonical(path)
    return any(path == k or path.startswith(f"{k}.") for k in listing)


def _schema_keys(prop: dict[str, Any], path: str = "") -> list[str]:
    out = []
    for key, sub in prop.get("properties", {}).items():
        where = f"{path}.{key}" if path else key
        if is_alias(sub) or is_unsupported(sub):
            continue
        out.append(where)
        out += _schema_keys(sub, where)
    return out


def test_every_deepspeed_key_is_read_refused_by_name_or_listed_as_not_ours() -> None:
    unlisted = [p for p in DS if _ours(p) is None and not _listed(p, NOT_OURS)]
    assert unlisted == [], f"DeepSpeed 0.19.8 keys we neither read nor list in NOT_OURS: {unlisted}"


def test_every_key_we_read_is_deepspeeds_or_listed_as_ours() -> None:
    ours = [p for p in _schema_keys(SCHEMA) if p not in DS and not _listed(p, KEPT_REMOVED)]
    assert sorted(ours) == sorted(OURS_ONLY), "keys we read that DeepSpeed 0.19.8 does not"


def test_the_listed_differences_are_still_differences() -> None:
    """A list entry that stopped being a difference (we read the key now, DeepSpeed dropped it)
    fails here, so the lists stay exact."""
    for path in NOT_OURS:
        assert path in DS, f"NOT_OURS: {path} is no DeepSpeed 0.19.8 key"
        assert _ours(path) is None, f"NOT_OURS: we take {path} now ({_ours(path)})"
    for path in DEFAULTS_DIFFER:
        assert path in DS and _ours(path) == "read", path


def test_features_deepspeed_removed_are_refused_by_name_unless_kept() -> None:
    removed = RECORDED["removed"]
    assert set(KEPT_REMOVED) <= set(removed)
    for path in removed:
        want = "read" if path in KEPT_REMOVED else "refused"
        if path == "zero_optimization.zeropp_loco_param":  # a ZeRO++ knob never ours: unknown
            want = None
        assert _ours(path) == want, (path, _ours(path), removed[path])


def _defaults(prop: dict[str, Any], path: str = "") -> dict[str, Any]:
    out = {}
    for key, sub in prop.get("properties", {}).items():
        where = f"{path}.{key}" if path else key
        if is_alias(sub) or is_unsupported(sub):
            continue
        if sub.get("properties"):
            out |= _defaults(sub, where)
        elif "default" in sub:
            out[where] = sub["default"]
    return out


def test_where_both_read_a_key_the_defaults_are_deepspeeds_unless_listed() -> None:
    """steps_per_print (null: never print), zero_force_ds_cpu_optimizer (true),
    gradient_clipping (1.0) among them."""
    shared = {p: v for p, v in _defaults(SCHEMA).items() if p in DS and DS[p]["kind"] == "key"}
    differ = {p: (v, DS[p]["default"]) for p, v in shared.items() if v != DS[p]["default"]}
    assert sorted(differ) == sorted(DEFAULTS_DIFFER), differ
    assert shared["steps_per_print"] is None and DS["steps_per_print"]["default"] is None
    assert shared["zero_force_ds_cpu_optimizer"] is True
    assert shared["gradient_clipping"] == DS["gradient_clipping"]["default"] == 1.0


def test_the_stage3_keys_are_read_under_deepspeeds_field_names_too() -> None:
    """DeepSpeed's ZeRO model takes `max_live_parameters` for `stage3_max_live_parameters` (its
    field name and its alias): both set the same field here, and both at once must agree."""
    from minispeed.core.config import ConfigError
    from minispeed.zero import ZeroConfig

    pairs = {
        "prefetch_bucket_size": ("stage3_prefetch_bucket_size", 1234),
        "param_persistence_threshold": ("stage3_param_persistence_threshold", 1234),
        "max_live_parameters": ("stage3_max_live_parameters", 1234),
        "max_reuse_distance": ("stage3_max_reuse_distance", 1234),
        "gather_16bit_weights_on_model_save": ("stage3_gather_16bit_weights_on_model_save", True),
    }
    for field_name, (stage3_name, value) in pairs.items():
        assert DS[f"zero_optimization.{field_name}"]["reader"].endswith(f".{field_name}")
        by_field = ZeroConfig.from_section({"stage": 3, field_name: value})
        assert by_field == ZeroConfig.from_section({"stage": 3, stage3_name: value}), field_name
        assert by_field != ZeroConfig.from_section({"stage": 3}), field_name
        with pytest.raises(ConfigError, match="another name of"):
            ZeroConfig.from_section({"stage": 3, field_name: value, stage3_name: not value})
