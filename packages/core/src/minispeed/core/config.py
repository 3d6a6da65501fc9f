"""Config primitives every package's config uses: one error type, one did-you-mean, one key checker.

A DeepSpeed `ds_config.json` is one nested dict whose sections belong to different packages. Each
package turns **its own section** into a frozen dataclass (`ZeroConfig`, `PipelineConfig`, ...);
the engine composes them. What must be the same everywhere is how a bad key is reported:

```python
from minispeed.core.config import ConfigError, check_keys
check_keys({"stgae": 2}, known={"stage", "overlap_comm"}, path="zero_optimization")
# ConfigError: zero_optimization.stgae: unknown key (did you mean 'stage'?); known keys: ...
```

- `ConfigError(ValueError)` carries `path`, the dotted key path as the user wrote it
  (`"scheduler.params.warmup_num_steps"`), so a caller (the engine, a schema tool, a test) can
  tell which key was wrong without parsing text; it survives pickling (a worker's error reaches
  its parent whole).
- `did_you_mean` suggests the nearest known key by edit distance (one edit for short keys, two from
  eight characters on; swapped neighbours cost one).
- `check_keys` refuses unknown keys, and keys DeepSpeed defines that minispeed does not implement
  (`Unsupported`: why, and the one value accepted, DeepSpeed's default, so a config written out
  in full still loads) unless they hold that value.
- `field_error` is the error a config dataclass raises for one of its fields; the section
  reader (`minispeed.core.sections`, the config pattern) renames it after the key the user wrote.
- `DEEPSPEED_TOP_LEVEL` is the one catalogue of DeepSpeed's top-level keys (the engine reads or
  refuses each of them; `check_top_level_spelling` never calls one of them a misspelling).

Cost: one edit-distance computation per (unknown key, known key): O(len²) each, only on error.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "BATCH_KEYS",
    "DEEPSPEED_TOP_LEVEL",
    "ConfigError",
    "ConfigTypeError",
    "Unsupported",
    "batch_triple",
    "check_keys",
    "check_top_level_spelling",
    "did_you_mean",
    "edit_distance",
    "field_error",
    "is_close",
    "join_path",
]


class ConfigError(ValueError):
    """A config value is wrong: `path` names the key (dotted, as the user wrote it: `"fp16.loss_scale"`),
    `reason` says what is wrong and the fix; `str()` is `"<path>: <reason>"`.

    `field` is set when a dataclass's own check raised it (`field_error`): the field whose value
    is wrong, so the section reader can rename the error after the DeepSpeed key the user wrote
    (`minispeed.core.sections`). Pickles with all three (an error raised on a worker process
    reaches its parent whole)."""

    def __init__(self, path: str, reason: str, *, field: str | None = None) -> None:
        self.path = path
        self.reason = reason
        self.field = field
        super().__init__(f"{path}: {reason}" if path else reason)

    def __reduce__(self) -> tuple[Any, ...]:
        # BaseException pickles `self.args` (the one formatted message) as the constructor's
        # arguments, which a two-argument constructor cannot take back.
        return (_rebuild, (type(self), self.path, self.reason, self.field), self.__dict__)


def _rebuild(cls: type, path: str, reason: str, field: str | None) -> ConfigError:
    return cls(path, reason, field=field)


class ConfigTypeError(ConfigError, TypeError):
    """A config value of the wrong type (a `ConfigError` and a `TypeError`)."""


def field_error(owner: Any, field: str, reason: str, *, kind: type = ConfigError) -> ConfigError:
    """The error a config dataclass's `__post_init__` raises for its own `field`:
    `"ZeroConfig.stage: must be 0, 1, 2 or 3, got 5"`. Built from a ds_config, the section
    reader renames it `"zero_optimization.stage: must be ... (ZeroConfig.stage)"`."""
    name = owner.__name__ if isinstance(owner, type) else type(owner).__name__
    return kind(f"{name}.{field}", reason, field=field)


def join_path(path: str, key: Any) -> str:
    """`"a.b"` + `"c"` -> `"a.b.c"`; an empty `path` gives the key alone."""
    return f"{path}.{key}" if path else str(key)


def edit_distance(a: str, b: str) -> int:
    """Optimal-string-alignment distance: insertions, deletions, substitutions and swaps of two
    adjacent characters cost 1 each (`"optimisation"` -> `"optimization"`: 1)."""
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        cur = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cost = 0 if a[i - 1] == b[j - 1] else 1
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        prev2, prev = prev, cur
    return prev[len(b)]


def is_close(key: str, known: str) -> bool:
    """Within the tolerance for misspellings: 1 edit for short keys, 2 from 8 characters on
    (case-insensitive)."""
    limit = 2 if len(known) >= 8 else 1
    return edit_distance(key.lower(), known.lower()) <= limit


def did_you_mean(keys: Iterable[str], known: Iterable[str]) -> str:
    """`" (did you mean 'x'?)"` for the first of `keys` close to one of `known`, else `""`."""
    known = sorted(known)
    for key in keys:
        best = min(known, key=lambda k: edit_distance(str(key).lower(), k.lower()), default=None)
        if best is not None and is_close(str(key), best):
            return f" (did you mean {best!r} for {key!r}?)"
    return ""


class _Refused:
    """`Unsupported.accepted` of a key refused at every value."""

    def __repr__(self) -> str:
        return "REFUSED"


REFUSED: Any = _Refused()


@dataclasses.dataclass(frozen=True)
class Unsupported:
    """A DeepSpeed key a section does not implement, declared once (the section's
    `ds_unsupported`, `minispeed.core.sections`): why, with what to use instead, and the one
    value accepted (DeepSpeed's default, at which the key changes nothing; `REFUSED`: none)."""

    why: str
    """Why minispeed does not implement it, and what to use instead."""
    accepted: Any = REFUSED
    """The one value a config may hold for it, shown as its default; `REFUSED`: no value."""
    also: tuple[Any, ...] = ()
    """Other values accepted, each meaning what minispeed does (`memory_efficient_linear:
    false` asks for torch's linear, which is minispeed's)."""

    @property
    def refused(self) -> bool:
        """Whether no value is accepted."""
        return self.accepted is REFUSED


def check_keys(
    section: Mapping[str, Any],
    known: Iterable[str],
    path: str,
    *,
    unsupported: Mapping[str, Unsupported] | None = None,
    known_as: str = "known keys here",
) -> None:
    """Raise `ConfigError` for the first key of `section` that minispeed does not read.

    - `known`: the keys read (their values are checked by the caller).
    - `unsupported`: DeepSpeed keys minispeed does not implement (`Unsupported`); such a key is
      accepted only when it holds the one value minispeed implements (`accepted`, usually
      DeepSpeed's default), since a key at that value changes nothing; else the error says why
      and what to use instead.
    - anything else is unknown: the error suggests the nearest known key and lists the known
      ones (after `known_as`).
    """
    if not isinstance(section, Mapping):
        raise ConfigError(path, f"must be a JSON object, got {type(section).__name__}")
    known = set(known)
    unsupported = unsupported or {}
    for key in section:
        if key in known:
            continue
        where = join_path(path, key)
        if key in unsupported:
            entry = unsupported[key]
            values = () if entry.refused else (entry.accepted, *entry.also)
            if any(_same(section[key], v) for v in values):
                continue
            shown = " or ".join(json.dumps(v, default=repr) for v in values)  # as JSON writes it
            accepted = (
                "" if entry.refused else f" ({shown} {'are' if entry.also else 'is'} accepted)"
            )
            raise ConfigError(
                where,
                f"DeepSpeed's {key!r} is not supported by minispeed: {entry.why}; remove "
                f"it{accepted}",
            )
        hint = did_you_mean([key], known | set(unsupported))
        raise ConfigError(
            where, f"unknown key{hint}; {known_as}: {', '.join(sorted(known)) or '(none)'}"
        )


def _same(value: Any, default: Any) -> bool:
    """A value equals a default, recursively for objects (a section `{"enabled": false}` equals
    the default section when each of its keys holds the default's value). A section that is off
    by default and off in `value` (`"enabled"` false or absent) equals it whatever its other keys
    hold: DeepSpeed reads none of them then (a `tensorboard` section with its `output_path`
    filled in, switched off)."""
    if isinstance(default, Mapping) and isinstance(value, Mapping):
        if default.get("enabled") is False and value.get("enabled", False) is False:
            return True
        return all(k in default and _same(v, default[k]) for k, v in value.items())
    if isinstance(default, bool) or isinstance(value, bool):
        return value is default
    return value == default


# DeepSpeed's batch triple, in the order `batch_triple` takes and returns it.
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def batch_triple(
    train_batch_size: int | None,
    micro_batch_size: int | None,
    accumulation_steps: int | None,
    data_parallel_size: int,
) -> tuple[int, int, int]:
    """DeepSpeed's rule for (`train_batch_size`, `train_micro_batch_size_per_gpu`,
    `gradient_accumulation_steps`) at data-parallel size N (`DeepSpeedConfig.
    _set_batch_related_parameters` then `_batch_assertion`, DeepSpeed 0.19.8):

    - all three given: used as given;
    - two given: the third derived with floor division (train // micro // N; train // N // acc;
      micro · acc · N);
    - train alone: accumulation 1, micro = train // N; micro alone: accumulation 1,
      train = micro · N; neither train nor micro: an error.

    Then each must be ≥ 1 and train = micro · acc · N, or `ValueError` naming the keys (DeepSpeed
    asserts the same); a `ConfigError` carries the key. The engine and the pipeline package
    both decide the batch here."""
    given = dict(zip(BATCH_KEYS, (train_batch_size, micro_batch_size, accumulation_steps)))
    for key, value in given.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(key, f'must be an int, got {value!r} ("auto" is not supported here)')
    train, micro, acc, n = (
        train_batch_size,
        micro_batch_size,
        accumulation_steps,
        data_parallel_size,
    )
    if train is not None and micro is not None and acc is None:
        acc = train // micro // n if micro > 0 and n > 0 else 0
    elif train is not None and acc is not None and micro is None:
        micro = train // n // acc if acc > 0 and n > 0 else 0
    elif micro is not None and acc is not None and train is None:
        train = micro * acc * n
    elif train is not None and micro is None and acc is None:
        acc, micro = 1, train // n
    elif micro is not None and train is None:
        train, acc = micro * n, 1
    elif train is None and micro is None:
        raise ConfigError(
            "train_batch_size",
            "set train_batch_size or train_micro_batch_size_per_gpu (DeepSpeed needs one of them; "
            "gradient_accumulation_steps alone does not fix the batch)",
        )
    assert train is not None and micro is not None and acc is not None
    for key, value in zip(BATCH_KEYS, (train, micro, acc)):
        if value < 1:
            raise ConfigError(
                key,
                f"{key} comes out as {value} from {_show(given)} at data-parallel size {n}; "
                "it must be >= 1: raise train_batch_size or lower the others",
            )
    if train != micro * acc * n:
        raise ConfigError(
            "train_batch_size",
            f"train_batch_size={train} is not train_micro_batch_size_per_gpu={micro} × "
            f"gradient_accumulation_steps={acc} × data-parallel size {n} (= {micro * acc * n}), "
            f"from {_show(given)}: give two of the three keys, or three that agree",
        )
    return train, micro, acc


def _show(given: dict[str, int | None]) -> str:
    return ", ".join(f"{k}={v}" for k, v in given.items() if v is not None)


# Top-level keys DeepSpeed itself defines (any package's): never reported as misspellings, even
# where one is close to another (`fp16` / `bf16`).
DEEPSPEED_TOP_LEVEL: frozenset[str] = frozenset(
    {
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "optimizer",
        "scheduler",
        "fp16",
        "bf16",
        "bfloat16",
        "amp",
        "torch_autocast",
        "data_types",
        "zero_optimization",
        "gradient_clipping",
        "prescale_gradients",
        "gradient_predivide_factor",
        "communication_data_type",
        "seq_parallel_communication_data_type",
        "sparse_gradients",
        "steps_per_print",
        "wall_clock_breakdown",
        "memory_breakdown",
        "dump_state",
        "flops_profiler",
        "activation_checkpointing",
        "aio",
        "tensorboard",
        "wandb",
        "csv_monitor",
        "comet",
        "comms_logger",
        "elasticity",
        "pipeline",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
        "sparse_attention",
        "curriculum_learning",
        "data_efficiency",
        "compression_training",
        "checkpoint",
        "autotuning",
        "moe",
        "nebula",
        "quantize_training",
        "eigenvalue",
        "progressive_layer_drop",
        "hybrid_engine",
        "weight_quantization",
        "disable_allgather",
        "timers",
        "compile",
        "tensor_parallel",
        "use_data_before_expert_parallelism",
        "graph_harvesting",
        "mics_shard_size",
        "mics_hierarchical_params_gather",
        "load_universal_checkpoint",
        "use_node_local_storage",
        "datastates_ckpt",
        "data_parallel_size",
        "sequence_parallel_size",
        "dataloader_drop_last",
        "disable_python_gc",
        "gradient_allreduce_op",
        "log_level",
        "managed_gradient_accumulation",
        "vocabulary_size",
        "expert_parallel",
    }
)


def check_top_level_spelling(ds_config: dict[str, Any], sections: Iterable[str], who: str) -> None:
    """Raise `ConfigError` for a top-level key of `ds_config` that is a near miss of one of
    `sections` (the keys `who` reads) and not itself a DeepSpeed key.

    A package reading its sections out of a whole ds_config cannot refuse every key it does not
    read (`"optimizer"` belongs to someone else), but it can refuse a key that is *almost* one of
    its own: `"zero_optimisation"` would otherwise train at stage 0, silently."""
    sections = set(sections)
    for key in ds_config:
        if not isinstance(key, str) or key in sections or key in DEEPSPEED_TOP_LEVEL:
            continue
        for known in sorted(sections):
            if is_close(key, known):
                raise ConfigError(
                    key,
                    f"not a DeepSpeed key; did you mean {known!r}? "
                    f"{who} reads {known!r} and would otherwise ignore {key!r} silently: "
                    f"rename it",
                )
