"""What a released stage-3 parameter answers when user code reads it: the truth, or an error.

A released parameter's ``.data`` is an empty tensor (Note [why .data is swapped] in params.py).
Read naively, it gives plausible wrong numbers: ``p.norm()`` is 0.0, ``p.shape`` is ``(0,)``,
``p.detach().cpu().numpy()`` is empty, and logging or export code carries on. So every stage-3
parameter's class is switched, while stage 3 owns it, to a subclass of its own class whose
``__torch_function__`` looks at each use (Note [a released parameter answers or raises]):

| use of a released parameter | answer |
|---|---|
| ``shape``, ``size()``, ``numel()``, ``nelement()``, ``dim()``, ``ndim``, ``len()``, ``nbytes`` | the full parameter's (as FSDP2's sharded parameters do) |
| ``dtype``, ``device``, ``requires_grad``, ``grad``, ``is_leaf``, hooks, ``requires_grad_()`` ... | the parameter's own (they do not depend on its values) |
| ``data``, ``untyped_storage()``, ``data_ptr()`` | this rank's storage, empty while released: what memory accounting needs |
| ``repr(p)`` / ``str(p)`` | a description naming the parameter, its full shape, and that it is released |
| ``detach()`` | a placeholder on the meta device, of the full shape and dtype, holding no bytes; its views and pointers answer, its values raise (Note [a released parameter in a state_dict]) |
| any other op: ``norm()``, ``sum()``, ``item()``, ``p[0]``, ``cpu()``, ``tolist()``, ``torch.add(p, 1)``, pickling, in-place writes ... | inside a forward run by the stage-3 hooks: fetched first (a demand fetch, as an attribute read is); elsewhere `ParameterNotGatheredError` naming the parameter and `GatheredParameters` |

Inside ``GatheredParameters`` (or a module's forward and backward) every use passes through
unchanged. ``p.data`` stays the low-level escape: it is the storage stage 3 swaps, empty while
released, and is what the package itself reads and assigns.

Cost: one Python ``__torch_function__`` call per torch op or attribute read that takes a stage-3
parameter (a weak-dict lookup and an enum comparison when it is gathered). Autograd's backward
runs in C++ and never calls it; measured below 1 % of a step at 33.9M parameters
(benchmarks/zero_released_access.py, docs/benchmarks.md).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from minispeed.core.compiling import is_compiling
from minispeed.zero.stage3.access import not_gathered_error, unhooked_forward_caller
from minispeed.zero.stage3.params import ParamState, ShardedParam

__all__ = [
    "guard_param",
    "is_guarded",
    "needs_values",
    "register_param_attribute",
    "released_among",
    "unguard_param",
]

# Note [a released parameter answers or raises]
# We cannot replace the nn.Parameter objects (the user's optimizer, autograd's AccumulateGrad
# nodes and the module hold them), and patching nn.Parameter or torch functions globally would
# tax every tensor of the program. A per-object class switch reaches exactly the stage-3
# parameters: ``param.__class__`` becomes a subclass of its own class (made once per class) whose
# ``__torch_function__`` sees every torch function, method and attribute getter called on it.
# Its shape answers are exact without a collective (ShardedParam keeps the full shape). Values are
# not: gathering them would be a collective, and a read made on one rank only (logging on rank 0)
# would then hang the others, so a read outside forward raises instead. Nothing is set on the
# parameter; `unguard_param` (Stage3Strategy.close) restores its class. The subclass's results are
# plain tensors (torch functions run with subclass dispatch disabled, as nn.Parameter does).

# Note [a released parameter in a state_dict]
# ``module.state_dict()`` stores ``param.detach()`` for each parameter. Outside GatheredParameters
# a released parameter's detach() returns a `ReleasedValue`: a tensor on the meta device with the
# parameter's full shape and dtype and no bytes, so the state dict has every key, with
# placeholders whose layout answers exactly (shape, dtype, views, pointers: the meta device's)
# and which raise on any use of their values (``torch.save`` pickles them: it raises;
# safetensors and ``load_state_dict`` fail on them). Code that only needs the keys, shapes or
# layout of a model built under ``zero.Init`` works: Hugging Face's ``from_pretrained`` asks for
# ``model.state_dict().keys()``, and ``save_pretrained`` on a rank that will not write still
# compares the entries' pointers to find tied weights (it keys meta tensors by the parameter
# itself, so the tie is found as on rank 0). Code that would save or compare the values fails
# loudly instead of reading an empty tensor. The placeholder is not the parameter: a write into
# it (a view of it) reaches nothing, as a write into a detached copy would not reach the values.

# Note [a compiled forward reads gathered parameters]
# Under ``torch.compile`` (``engine.compile()``) dynamo traces a module's forward between the
# stage-3 hooks, which run eagerly (`minispeed.core.compiling.eager`): every parameter the
# forward reads by attribute was gathered by its module's pre-hook or, for another module's
# parameter, by the demand fetch of the attribute guard (access.py, also eager), before the
# graph that uses it is traced or run. So while dynamo traces, a guarded parameter is a plain
# parameter: the checks above (a weak-dict lookup per op, which dynamo refuses to trace and would
# break the graph at every op on a parameter) are skipped, and the graph holds the op itself.
# Limit: a released parameter reached by a reference kept from outside the forward (not an
# attribute read) is traced as the empty tensor its ``.data`` is: dynamo's shape check fails
# where eager mode would have fetched it.

#: Getters and methods whose answer does not depend on the parameter's values, or that stage 3
#: and autograd need on a released parameter: they run as for any parameter.
_METADATA = frozenset(
    {
        "data",
        "grad",
        "requires_grad",
        "dtype",
        "device",
        "is_leaf",
        "grad_fn",
        "layout",
        "is_cuda",
        "is_cpu",
        "is_meta",
        "is_sparse",
        "is_quantized",
        "is_nested",
        "_backward_hooks",
        "_post_accumulate_grad_hooks",
        "_version",
        "requires_grad_",
        "retain_grad",
        "register_hook",
        "register_post_accumulate_grad_hook",
        "element_size",
        "is_floating_point",
        "is_complex",
        "get_device",
        "itemsize",
        # storage-level queries describe what this rank holds (0 bytes), not the values
        "untyped_storage",
        "data_ptr",
        "storage_offset",
        "is_contiguous",
        "is_pinned",
        "is_shared",
    }
)
_DESCRIBE = frozenset({"__repr__", "__str__", "__format__"})


def _func_name(func: Any) -> str:
    """``norm`` for ``Tensor.norm``, ``shape`` for the getter ``Tensor.shape.__get__``."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        owner = getattr(func, "__self__", None)
        return name if owner is None else f"{getattr(owner, '__name__', '')}{name[:-2]}"
    return name


def _released_in(args: tuple, kwargs: dict | None) -> Any:
    """The ShardedParam of the first released stage-3 parameter among the arguments (and inside
    list or tuple arguments, ``torch.cat([p, q])``), or None."""
    for a in args:
        kind = type(a)
        if kind is list or kind is tuple:
            for b in a:
                sp = _SHARDED.get(id(b)) if type(b) in _GUARDED_TYPES else None
                if sp is not None and sp.state is not _GATHERED:
                    return sp
        elif kind in _GUARDED_TYPES:
            sp = _SHARDED.get(id(a))
            if sp is not None and sp.state is not _GATHERED:
                return sp
    if kwargs:
        return _released_in(tuple(kwargs.values()), None)
    return None


def released_among(args: tuple, kwargs: dict | None) -> list[ShardedParam]:
    """Every released stage-3 parameter among the arguments (and inside list/tuple arguments)."""
    found: list[ShardedParam] = []
    for a in (*args, *(kwargs or {}).values()):
        for b in a if type(a) is list or type(a) is tuple else (a,):
            sp = _SHARDED.get(id(b)) if type(b) in _GUARDED_TYPES else None
            if sp is not None and sp.state is not _GATHERED and sp not in found:
                found.append(sp)
    return found


_SHAPE_QUERIES = frozenset(
    {
        "shape__get",
        "size",
        "numel",
        "nelement",
        "dim",
        "ndimension",
        "ndim__get",
        "nbytes__get",
        "__len__",
    }
)


def needs_values(func: Any) -> bool:
    """Whether ``func`` on a released parameter needs its values (not a shape or metadata query,
    not a setter). ``.data`` counts as a value read: ``p.data.normal_()`` writes the values."""
    name = _func_name(func)
    if name.endswith("__set") or name in _SHAPE_QUERIES or name in _DESCRIBE:
        return False
    if name == "data__get":
        return True
    return name not in _METADATA and name.removesuffix("__get") not in _METADATA


def _shape_answer(name: str, sp: Any, args: tuple, kwargs: dict | None) -> tuple[bool, Any]:
    """``(True, answer)`` for a shape query about the released ``args[0]``, else ``(False, None)``."""
    if not args or type(args[0]) not in _GUARDED_TYPES or _SHARDED.get(id(args[0])) is not sp:
        return False, None
    shape = sp.shape
    if name == "shape__get":
        return True, shape
    if name == "size":
        dim = args[1] if len(args) > 1 else (kwargs or {}).get("dim")
        return True, shape if dim is None else shape[dim]
    if name in ("numel", "nelement"):
        return True, sp.numel
    if name == "nbytes__get":
        return True, sp.numel * sp.shard.element_size()
    if name in ("dim", "ndimension", "ndim__get"):
        return True, len(shape)
    if name == "__len__":
        if not shape:
            raise TypeError("len() of a 0-d tensor")
        return True, shape[0]
    return False, None


def _describe(sp: Any) -> str:
    return (
        f"Parameter(released stage-3 parameter {sp.name or '?'!r}, shape={tuple(sp.shape)}, "
        f"dtype={sp.shard.dtype}: only this rank's shard is present; read its values inside "
        f"zero.GatheredParameters)"
    )


def _torch_function(cls: type, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
    """Every torch function, method and getter called on a guarded parameter passes here."""
    plain = cls._stage3_plain_class
    if is_compiling():  # Note [a compiled forward reads gathered parameters]
        if plain is nn.Parameter:  # its __torch_function__, in a form dynamo traces
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        sp = None
    else:
        sp = _released_in(args, kwargs)
    if sp is not None:
        name = _func_name(func)
        if name.endswith("__set") or name in _METADATA or name.removesuffix("__get") in _METADATA:
            pass
        elif name in _DESCRIBE:
            return _describe(sp)
        elif name == "detach" and args and _SHARDED.get(id(args[0])) is sp:
            # Note [a released parameter in a state_dict]: a placeholder without bytes.
            return ReleasedValue.of(sp)
        else:
            answered, answer = _shape_answer(name, sp, args, kwargs)
            if answered:
                return answer
            coordinator = sp.coordinator
            if coordinator is None or not coordinator.in_forward:
                forward_of = unhooked_forward_caller()
                raise not_gathered_error(
                    sp.name or "?",
                    f"by {name.removesuffix('__get')}() "
                    + (
                        f"inside {forward_of}.forward, which ran without the stage-3 hooks"
                        if forward_of is not None
                        else "outside a forward pass and GatheredParameters"
                    ),
                )
            for other in released_among(args, kwargs):  # torch.cat([p, q]): fetch both
                coordinator.demand_fetch(other, other.name or "?")
    if plain is not nn.Parameter:  # a user's subclass may check ``types``
        types = tuple(plain if t is cls else t for t in types)
    return plain.__torch_function__(func, types, args, kwargs or {})


_GATHERED = ParamState.GATHERED
_GUARDED_CLASSES: dict[type, type] = {}  # plain class -> its guarded subclass
# id(guarded parameter) -> its ShardedParam, with the finalizer that drops the entry when the
# parameter dies. A plain dict: REGISTRY's weak lookup costs ~1 us per call, this one ~50 ns,
# and the guard runs on every op that takes a parameter.
_SHARDED: dict[int, ShardedParam] = {}
_FINALIZERS: dict[int, weakref.finalize] = {}
_GUARDED_TYPES: set[type] = set()  # the guarded subclasses, for a fast ``type(a) in`` test


_SAVE_FIX = (
    "To save a model, use `sd = zero.full_state_dict(model)` (full tensors of your own, on "
    "every rank; rank0_only=True keeps them on rank 0 only), or call state_dict() inside `with "
    "zero.GatheredParameters(model.parameters()):` (it returns copies there); "
    "zero.save_checkpoint saves the shards without gathering"
)

#: What a `ReleasedValue` answers besides a parameter's metadata (`needs_values`): its strides
#: and its views, meta tensors too, for code that inspects a state dict's layout.
_LAYOUT = frozenset(
    {"stride", "view", "reshape", "flatten", "__getitem__", "narrow", "select", "t",
     "transpose", "permute", "detach", "as_strided"}
)  # fmt: skip


def _items(arg: Any) -> tuple:
    """An argument, or the items of a list or tuple argument (``torch.cat([p, q])``)."""
    return tuple(arg) if type(arg) is list or type(arg) is tuple else (arg,)


class ReleasedValue(torch.Tensor):
    """A released stage-3 parameter's value where a state dict holds it (Note [a released
    parameter in a state_dict]): a tensor on the meta device, of the parameter's full shape and
    dtype, holding no bytes. Its layout answers (keys, shapes, dtypes, views and pointers, what
    Hugging Face's `save_pretrained` inspects to find tied weights on every rank); saving it,
    copying it, or any use of values raises `ParameterNotGatheredError` naming the parameter."""

    _stage3_name: str

    @staticmethod
    def of(sp: ShardedParam) -> ReleasedValue:
        value = torch.empty(sp.shape, dtype=sp.shard.dtype, device="meta").as_subclass(
            ReleasedValue
        )
        value._stage3_name = sp.name or "?"
        return value

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        name = _func_name(func)
        if name not in _DESCRIBE and (
            name in _LAYOUT or name == "data__get" or not needs_values(func)
        ):
            with torch._C.DisableTorchFunctionSubclass():  # a meta tensor's answer: no bytes
                return func(*args, **(kwargs or {}))
        within = (b for a in (*args, *(kwargs or {}).values()) for b in _items(a))
        param = next((b._stage3_name for b in within if isinstance(b, ReleasedValue)), "?")
        if name in _DESCRIBE:
            return f"ReleasedValue(placeholder of released stage-3 parameter {param!r})"
        raise not_gathered_error(
            param,
            f"by {name.removesuffix('__get')}() of its entry in a state_dict taken outside "
            "GatheredParameters (a placeholder: shape and dtype only)",
            fix=_SAVE_FIX,
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise not_gathered_error(
            self._stage3_name,
            "by pickling (torch.save of a state_dict taken outside GatheredParameters holds "
            "placeholders)",
            fix=_SAVE_FIX,
        )

    def __deepcopy__(self, memo: Any) -> Any:
        raise not_gathered_error(
            self._stage3_name, "by deepcopy() of a state_dict placeholder", fix=_SAVE_FIX
        )


def _copy_guard(method: str) -> Any:
    """``__deepcopy__`` / ``__reduce_ex__`` that refuse a released parameter: nn.Parameter's own
    copy ``.data``, which would give an empty parameter silently."""

    def guarded(self: Any, arg: Any) -> Any:
        sp = _SHARDED.get(id(self))
        if sp is not None and sp.state is not _GATHERED:
            raise not_gathered_error(
                sp.name or "?",
                f"by {method}() (a copy or pickle of a released parameter)",
                fix=_SAVE_FIX,
            )
        return getattr(type(self)._stage3_plain_class, method)(self, arg)

    guarded.__name__ = method
    return guarded


# Note [attributes a stage-3 parameter answers]
# Code written for another ZeRO-3 reads the partitioning state off the parameter itself
# (DeepSpeed's clients: `p.ds_status`, `p.ds_numel`). Nothing is set on a parameter here (Note [a
# released parameter answers or raises]); instead a name registered with
# `register_param_attribute` is a read-only property of every guarded class, answered from the
# parameter's ShardedParam while stage 3 owns it and gone once `unguard_param` restores its class.
# The engine registers DeepSpeed's names; this package names none.
_ATTRIBUTES: dict[str, property] = {}


def register_param_attribute(name: str, answer: Callable[[ShardedParam], Any]) -> None:
    """Make `name` a read-only attribute of every stage-3 parameter, `answer(its ShardedParam)`
    (Note [attributes a stage-3 parameter answers]). A name a tensor already has is refused.
    Cost: one dict lookup per read."""
    if hasattr(nn.Parameter, name):
        raise ValueError(f"{name!r} is an attribute of every tensor; choose another name")
    attribute = property(lambda param: answer(_SHARDED[id(param)]), doc=answer.__doc__)
    _ATTRIBUTES[name] = attribute
    for guarded in _GUARDED_CLASSES.values():
        setattr(guarded, name, attribute)


def _guarded_class(plain: type) -> type:
    """The subclass of ``plain`` (nn.Parameter or a subclass of it) that stage 3 switches to."""
    guarded = _GUARDED_CLASSES.get(plain)
    if guarded is None:
        guarded = type(
            plain.__name__,  # repr, isinstance and type names stay the user's
            (plain,),
            {
                "__torch_function__": classmethod(_torch_function),
                "__deepcopy__": _copy_guard("__deepcopy__"),
                "__reduce_ex__": _copy_guard("__reduce_ex__"),
                "_stage3_plain_class": plain,
                "__module__": plain.__module__,
                "__qualname__": plain.__qualname__,
                **_ATTRIBUTES,
            },
        )
        _GUARDED_CLASSES[plain] = guarded
        _GUARDED_TYPES.add(guarded)
    return guarded


def is_guarded(param: torch.Tensor) -> bool:
    """Whether ``param``'s class is the stage-3 guard of its own class."""
    return type(param) in _GUARDED_TYPES


def guard_param(param: nn.Parameter, sp: ShardedParam) -> None:
    """Switch ``param``'s class to its guarded subclass (idempotent); ``sp`` partitions it."""
    key = id(param)
    _SHARDED[key] = sp
    if key not in _FINALIZERS:
        _FINALIZERS[key] = weakref.finalize(param, _forget, key)
    if not is_guarded(param):
        param.__class__ = _guarded_class(type(param))


def unguard_param(param: nn.Parameter) -> None:
    """Restore ``param``'s own class (Stage3Strategy.close, after it holds its full value)."""
    key = id(param)
    finalizer = _FINALIZERS.pop(key, None)
    if finalizer is not None:
        finalizer.detach()
    _SHARDED.pop(key, None)
    if is_guarded(param):
        param.__class__ = type(param)._stage3_plain_class


def _forget(key: int) -> None:
    _SHARDED.pop(key, None)
    _FINALIZERS.pop(key, None)
