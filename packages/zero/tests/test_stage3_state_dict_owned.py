"""Stage-3 state dicts hold tensors of their own: reading them later never touches freed storage.

A released stage-3 parameter's full buffer has 0 bytes of storage (Note [why storage is resized,
not replaced]). A ``state_dict()`` taken inside ``GatheredParameters`` used to return views of
those buffers, and reading them after the block killed the process (SIGSEGV). One distributed
run (2 ranks) checks:

- the tensors of a ``state_dict()`` taken inside ``GatheredParameters`` still hold the gathered
  values after the block (the crash scenario, verbatim);
- ``state_dict()`` outside the block has every key, with the released parameters as placeholders
  (full shapes) that refuse to be saved (``torch.save`` raises ``ParameterNotGatheredError``);
  ``load_state_dict()`` outside the block raises ``ParameterNotGatheredError``,
  and the code the message names (``zero.full_state_dict``, the block with ``modifier_rank``)
  works: the same values as the block, on every rank or on rank 0 only.
"""

from __future__ import annotations

import io

import torch
from zero_testlib import make_batches, make_model, rank_slice

import minispeed.zero as zero
from minispeed.core.testing import run_distributed
from minispeed.zero.stage3 import GatheredParameters


def _error_of(fn) -> str:
    try:
        fn()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return ""


def _body(rank: int, world_size: int) -> dict:
    model = make_model()
    cfg = zero.ZeroConfig(stage=3, stage3_param_persistence_threshold_numel=0)
    opt = zero.shard(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=cfg)
    for batch in make_batches(2, 8):
        opt.backward(model(*rank_slice(batch, rank, world_size)))
        opt.step()

    with GatheredParameters(list(model.parameters())):
        sd = model.state_dict()
        gathered = {k: v.clone() for k, v in sd.items()}
    # The parameters are released now; the state dict's tensors must still be readable.
    after_exit = all(torch.equal(sd[k], gathered[k]) for k in gathered)

    placeholders = model.state_dict()
    shapes = {k: tuple(v.shape) for k, v in placeholders.items()}
    # their layout answers, as Hugging Face's save_pretrained inspects it on every rank
    first = next(iter(placeholders.values()))
    layout = (first.device.type, type(first.view(-1)[-1].data_ptr()), first.dtype == torch.float32)
    cat_error = _error_of(lambda: torch.cat([first, first]))  # a placeholder inside a list
    outside = _error_of(lambda: torch.save(placeholders, io.BytesIO()))
    load_outside = _error_of(lambda: model.load_state_dict(gathered))
    full = zero.full_state_dict(model)
    rank0 = zero.full_state_dict(model, rank0_only=True)
    still_full = zero.full_state_dict(model)  # full_state_dict's tensors survive its releases
    with GatheredParameters(list(model.parameters()), modifier_rank=0):
        model.load_state_dict({k: v * 2 for k, v in gathered.items()})
    doubled = zero.full_state_dict(model)
    # A state dict holding part of a module's parameters (transformers loads a checkpoint group
    # by group) needs only that part gathered; a key whose parameter is released is refused.
    name, lin = next(
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and m.bias is not None
    )
    weight = gathered[f"{name}.weight"]
    with GatheredParameters([lin.weight], modifier_rank=0):
        lin.load_state_dict({"weight": -weight}, strict=False)
    after_partial = zero.full_state_dict(model)
    with GatheredParameters([lin.weight], modifier_rank=0):
        bias_released = _error_of(
            lambda: lin.load_state_dict(
                {"bias": torch.zeros_like(gathered[f"{name}.bias"])}, strict=False
            )
        )
    return dict(
        partial_loaded=torch.equal(after_partial[f"{name}.weight"], -weight),
        partial_kept_bias=torch.equal(after_partial[f"{name}.bias"], doubled[f"{name}.bias"]),
        bias_released=bias_released,
        after_exit=after_exit,
        outside=outside,
        load_outside=load_outside,
        full_keys=list(full),
        keys=list(gathered),
        placeholder_keys=list(placeholders),
        layout=layout,
        cat_error=cat_error,
        shapes_equal=shapes == {k: tuple(v.shape) for k, v in gathered.items()},
        full_equal=all(torch.equal(full[k], gathered[k]) for k in gathered),
        still_equal=all(torch.equal(still_full[k], full[k]) for k in full),
        rank0_keys=len(rank0),
        doubled=all(torch.equal(doubled[k], 2 * gathered[k]) for k in gathered),
        released=all(p.data.numel() == 0 for p in model.parameters()),
    )


def test_state_dict_tensors_outlive_gathered_parameters() -> None:
    results = run_distributed(_body, world_size=2, timeout_s=120)
    names = list(make_model().state_dict())
    for rank, res in enumerate(results):
        assert res["after_exit"], rank
        assert res["outside"].startswith("ParameterNotGatheredError"), res["outside"]
        assert "zero.full_state_dict(model)" in res["outside"], res["outside"]
        assert res["load_outside"].startswith("ParameterNotGatheredError"), res["load_outside"]
        assert "modifier_rank=0" in res["load_outside"], res["load_outside"]
        assert res["keys"] == names and res["full_keys"] == names
        assert res["placeholder_keys"] == names and res["shapes_equal"]
        assert res["layout"] == ("meta", int, True)
        assert res["cat_error"].startswith("ParameterNotGatheredError"), res["cat_error"]
        assert res["full_equal"] and res["still_equal"] and res["doubled"] and res["released"]
        assert res["rank0_keys"] == (len(names) if rank == 0 else 0)
        assert res["partial_loaded"] and res["partial_kept_bias"]
        assert res["bias_released"].startswith("ParameterNotGatheredError"), res["bias_released"]
