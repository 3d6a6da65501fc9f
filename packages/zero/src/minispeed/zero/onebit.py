"""1-bit Adam under ZeRO stages 0, 1 and 2: warm up as Adam with ZeRO, then send momentum in 1 bit.

`zero.shard(model, comm.optim.OnebitAdam(...), config)` lands here (DeepSpeed cannot combine
1-bit Adam with ZeRO-1/2: its issue 5046). The rule is `OnebitAdam`'s (module docstring of
`minispeed.comm.optim.onebit_adam`); what changes is who holds what:

1. **WARMUP** (optimizer steps `1 .. freeze_step`): exactly Adam with ZeRO. The inner optimizer
   is a `torch.optim.Adam` over zero's fp32 masters (the same param-group dicts, so schedulers
   see them), the stage's reducer averages the gradients (stage 0 all-reduce, 1-2
   reduce-scatter) and each rank steps its shard. `exp_avg` and `exp_avg_sq` are sharded.
2. **The freeze**, after step `freeze_step`: `v` (`exp_avg_sq`) and its bias correction stop
   changing and stay sharded. The momentum shards are assembled into one full fp32 momentum
   vector `m` on every rank (one all-reduce of 4Ψ bytes, stages 1-2; nothing at stage 0), and
   each master's `exp_avg` becomes a view of its piece of `m`. The stage's gradient reducer is
   replaced by `LocalReducer` (`local_reducer.py`): gradients are no longer reduced.
3. **COMPRESSED** (steps after `freeze_step`): each rank folds its *local* gradient into the
   full momentum, `m <- β1 m + (1-β1)(g_local + wd·p)`, the momenta are averaged in place by
   `OnebitAllReduce` (worker and server error feedback; every rank ends with the same `m`), and
   each rank steps its own shard `p <- p - lr (m / (1-β1^t)) / (sqrt(v / (1-β2^t0)) + eps)`;
   stages 1-2 then all-gather the parameters as usual.

The user's `OnebitAdam` supplies the hyper-parameters (its param-group dicts, shared) and
`freeze_step`; its own `group` is not used: the momentum is averaged over zero's data-parallel
group. The momentum vector holds the parameters that required grad at `shard()` time, group by group
in parameter order (a frozen parameter has `v = 0`, where compression noise would move it by
`lr · noise / eps`). A parameter that got no gradient on a rank counts as a zero gradient there
(as in `OnebitAdam`): every rank's vector has the same layout. One that got none on any rank
this step (or was frozen since `shard()`) is not stepped, as zero skips it under Adam; its
momentum still decays with the rest of the vector.

Costs per rank (Ψ trainable elements, N ranks, Ψ' padded, C = 8 ceil(Ψ / 8N)):

| | warm-up (= Adam with ZeRO) | compressed |
|---|---|---|
| optimizer state | 8Ψ'/N (m, v shards) | 4Ψ (full m) + 4Ψ'/N (v) |
| error-feedback residuals | 0 | 4NC + 4C ≈ 4Ψ (1 + 1/N) |
| gradient buffer | the stage's (stage 2: Ψ'g/N) | Ψg (local, every stage) |
| bytes sent per step | the stage's (fp32 reduce + all-gather) | 2(N-1)(4 + C/8) + stage 1-2's all-gather (N-1)/N · 4Ψ' |

so after the freeze a rank keeps about `12Ψ + 4Ψ'/N` bytes beyond the parameters (4Ψ momentum,
≈4Ψ residuals, 4Ψ gradient) whatever the stage, and sends ~1/32 of the fp32 gradient reduction
(stages 1-2 still all-gather the fp32 parameters: the partition saving is on the optimizer
state, not the traffic). One extra fp32 all-reduce of 4Ψ once, at the freeze.

Clipping (`max_grad_norm`) after the freeze uses each rank's *local* gradient norm, as
DeepSpeed's 1-bit Adam did (the averaged gradient never exists); before it, the global norm as
for Adam. Refused (named on every rank before any collective): stage 3 (parameters are gathered
per layer, the full momentum update and error feedback would be per gathered layer), 1-bit LAMB
(its trust ratio reads whole-tensor norms that shards do not hold, and this path implements
Adam's rule only), fp16/bf16 with weight decay at stages 1-2
(see `check_onebit`), offload, MoE replica groups and model-parallel axes.

fp16/bf16: the momentum, variance, masters and residuals stay fp32; gradients are unscaled and
checked for overflow before they reach the momentum, and an overflowing step (agreed over the
ranks) is skipped whole, so neither the momentum nor the residuals see an inf (Note [a NaN
residual] in comm/compression/error_feedback.py).
"""

from __future__ import annotations

from typing import Any

import torch

import minispeed.comm as comm
from minispeed.comm.compression import OnebitAllReduce
from minispeed.comm.optim import (
    CompressedMomentumOptimizer,
    OnebitAdam,
    OnebitPhase,
    OnebitSchedule,
    OnebitScheduled,
)
from minispeed.comm.optim.onebit_adam import adam_update_, fold_gradient_
from minispeed.zero.config import ZeroConfig
from minispeed.zero.contract import StrategyWrapper
from minispeed.zero.optimizer import ZeroOptimizer
from minispeed.zero.precision import MixedPrecision

__all__ = ["OnebitStrategy", "OnebitZeroOptimizer", "check_onebit", "warmup_adam"]


def check_onebit(
    optimizer: CompressedMomentumOptimizer,
    config: ZeroConfig,
    precision: MixedPrecision,
    *,
    model_parallel: Any = None,
    replica_groups: Any = None,
) -> None:
    """Refuse what the 1-bit path does not implement, naming why and what to use instead.

    Local (every rank checks the same arguments, before any collective).
    """
    kind = type(optimizer).__name__
    if not isinstance(optimizer, OnebitAdam):
        raise TypeError(
            f"{kind} with zero.shard is not supported: only 1-bit Adam is. 1-bit LAMB scales each "
            f"tensor's update by a trust ratio ||p|| / ||update|| of the whole tensor, which a "
            f"rank holding a shard (stages 1-2) cannot compute without per-tensor all-reduces, "
            f"and zero's 1-bit path (stage 0 included) implements Adam's rule only, not LAMB's "
            f"frozen ratio and per-tensor scaling; use {kind} on the plain model "
            f"(loss.backward(); opt.step() on every rank), or OneBitAdam / Adam with zero"
        )
    if config.stage == 3:
        raise ValueError(
            f"{kind} with ZeRO stage 3 is not supported: stage 3 gathers parameters layer by "
            f"layer and never holds the full model, while 1-bit Adam's compressed phase updates "
            f"and all-reduces one full momentum vector; use stage 0, 1 or 2"
        )
    decays = any(pg.get("weight_decay", 0.0) for pg in optimizer.param_groups)
    if precision.param_dtype != torch.float32 and config.stage != 0 and decays:
        raise ValueError(
            f"{kind} with ZeRO stage {config.stage}, {precision.param_dtype} parameters and "
            f"weight_decay > 0 is not supported: the compressed phase adds weight_decay · p to "
            f"every rank's full momentum, and at stages 1-2 a rank holds the fp32 masters of its "
            f"shard only (the rest as 16-bit copies, so stages would disagree); use stage 0, "
            f"fp32, or weight_decay 0"
        )
    if config.offload_optimizer is not None or config.offload_param is not None:
        raise ValueError(
            f"{kind} cannot be offloaded (DeepSpeed could not either): its momentum is "
            f"communicated every step; remove offload_optimizer / offload_param or use Adam"
        )
    if replica_groups is not None or model_parallel is not None:
        raise ValueError(
            f"{kind} with MoE expert groups or pipeline/tensor axes is not supported: its "
            f"momentum all-reduce covers one data-parallel group; use Adam there"
        )


def warmup_adam(optimizer: OnebitAdam) -> torch.optim.Adam:
    """The warm-up's inner optimizer: `torch.optim.Adam` over `optimizer`'s own param-group
    dicts (shared, so a scheduler on either changes the rates actually used)."""
    d = optimizer.defaults
    return torch.optim.Adam(
        optimizer.param_groups,
        lr=d["lr"],
        betas=d["betas"],
        eps=d["eps"],
        weight_decay=d["weight_decay"],
    )


class OnebitStrategy(StrategyWrapper):
    """A stage 0-2 strategy whose gradients become local after the freeze (`go_local`).

    Before: the stage's own (reduced gradients, sharded at stages 1-2). After: `master_grads`
    is every parameter's full *local* gradient (parameter-shaped) and `partitions_grads` is
    False, so `ZeroOptimizer` unscales, checks and clips the local gradient without a sum.
    """

    def __init__(self, strategy: Any, group: Any) -> None:
        super().__init__(strategy)
        self._group = group
        self._local = False

    @property
    def partitions_grads(self) -> bool:  # type: ignore[override]
        """The stage's value before the freeze; False after (local gradients, local norm)."""
        return self._inner.partitions_grads and not self._local

    @property
    def stage_partitions(self) -> bool:
        """Whether the stage partitions its masters and gradients (stages 1-2), freeze or not."""
        return self._inner.partitions_grads

    def master_grads(self) -> list[list[torch.Tensor]]:
        """The stage's reduced gradients (warm-up), or the local ones (parameter-shaped)."""
        if not self._local:
            return self._inner.master_grads()
        return self._inner.reducer.local_grads()

    def go_local(self) -> None:
        """The stage keeps local gradients from now on (its `go_local`: between steps, once)."""
        self._inner.go_local(self._group)  # backward_done, zero_grad and close reach the new one
        self._local = True

    @property
    def is_local(self) -> bool:
        """Whether `go_local` ran."""
        return self._local


class OnebitZeroOptimizer(OnebitScheduled, ZeroOptimizer):
    """`ZeroOptimizer` driving 1-bit Adam's phases (module docstring). Built by `zero.shard`.

    `schedule` (the `OnebitSchedule` owning `phase`, with `freeze_step`), `momentum` (the full
    fp32 momentum vector after the freeze, else None) and `momentum_allreduce` (its
    `OnebitAllReduce`, holding the residuals) are the 1-bit state; `global_step` counts the optimizer steps taken (skipped fp16 steps
    excluded), as `OnebitAdam.steps_taken` does.
    """

    def __init__(self, *args: Any, freeze_step: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.schedule = OnebitSchedule(freeze_step)
        self.momentum: torch.Tensor | None = None
        self.momentum_allreduce = OnebitAllReduce(group=self.comm_group)
        # Offset in `momentum` of every parameter trainable at shard() time, by (group, index).
        self._offset: dict[tuple[int, int], int] = {}
        self._index: dict[tuple[int, int], int] = {}
        numel, k = 0, 0
        for g, pg in enumerate(self.optimizer.param_groups):
            for i in range(len(pg["params"])):
                self._index[(g, i)] = k
                if self._trainable_at_shard[k]:
                    self._offset[(g, i)] = numel
                    numel += self._params[k].numel()
                k += 1
        self._momentum_numel = numel

    # -- the phases (owned by `schedule`) -------------------------------------------------------
    def _boundary_step(self) -> bool:
        stepped = super()._boundary_step()
        if stepped and self.schedule.ends_warmup(self.global_step):
            self._freeze()
        return stepped

    def _freeze(self) -> None:
        """The freeze (collective at stages 1-2): assemble `m`, stop reducing gradients."""
        self._assemble_momentum()
        self.strategy.go_local()
        self.schedule.to_compressed()

    def _pieces(self) -> list[tuple[int, int, torch.Tensor, slice]]:
        """(group, index, master, its elements' slice of `momentum`) for every non-empty
        trainable fragment this rank holds."""
        masters = self.strategy.master_params()
        out = []
        for f in self._fragments:
            off = self._offset.get((f.group, f.master_index))
            if off is not None and f.numel > 0:
                master = masters[f.group][f.master_index]
                where = slice(off + f.start, off + f.start + f.numel)
                out.append((f.group, f.master_index, master, where))
        return out

    @torch.no_grad()
    def _assemble_momentum(self) -> None:
        """Build the full `m` from every rank's `exp_avg` pieces; make those views of it."""
        device = self._grad_device
        m = torch.zeros(self._momentum_numel, dtype=torch.float32, device=device)
        pieces = self._pieces()
        for _, _, master, where in pieces:
            state = self.optimizer.state.get(master)
            if state and "exp_avg" in state:
                m[where].copy_(state["exp_avg"].reshape(-1))
        if self._inner_partitions():  # disjoint pieces: their sum over ranks is the whole
            travel = m.to(comm.tensor_device(self.comm_group))
            comm.all_reduce(travel, group=self.comm_group)
            m = travel.to(device)
        for _, _, master, where in pieces:
            state = self.optimizer.state[master]  # a master no rank ever used: empty so far
            state.setdefault("step", torch.tensor(float(self.global_step)))
            state.setdefault("exp_avg_sq", torch.zeros_like(master))
            state["exp_avg"] = m[where].view_as(master)
        self.momentum = m

    def _full_value(self, g: int, i: int) -> torch.Tensor:
        """Parameter i of group g, whole and in fp32: stage 0's master, or (stages 1-2, fp32 only:
        `check_onebit`) the model parameter, which the all-gather made equal to the masters."""
        if not self._inner_partitions():
            return self.strategy.master_params()[g][i]
        param = self._params[self._index[(g, i)]].detach()
        if param.dtype != torch.float32:
            raise RuntimeError(
                f"weight_decay became > 0 in param group {g} after zero.shard with "
                f"{param.dtype} parameters at stage {self.config.stage}: the compressed phase "
                f"needs the fp32 parameter on every rank (check_onebit); keep weight_decay 0"
            )
        return param

    def _inner_partitions(self) -> bool:
        return bool(self.strategy.stage_partitions)

    def _inner_step(
        self,
        masters: list[list[torch.Tensor]],
        grads: list[list[torch.Tensor]],
        skip: set[tuple[int, int]],
    ) -> None:
        if self.phase is OnebitPhase.WARMUP:
            super()._inner_step(masters, grads, skip)
            return
        self._compressed_step(grads, skip)

    @torch.no_grad()
    def _compressed_step(self, grads: list[list[torch.Tensor]], skip: set[tuple[int, int]]) -> None:
        """Fold local gradients into `m`, average it in 1 bit, step this rank's shard with the
        frozen `v`: `OnebitAdam`'s compressed update (`fold_gradient_`, `adam_update_`) over the
        full momentum and this rank's fp32 masters."""
        m = self.momentum
        assert m is not None
        groups = self.optimizer.param_groups
        for (g, i), off in self._offset.items():
            grad = grads[g][i]
            piece = m[off : off + grad.numel()].view_as(grad)
            fold_gradient_(piece, grad, groups[g], lambda g=g, i=i: self._full_value(g, i))
        self.momentum_allreduce(m)
        t = self.global_step + 1
        for g, i, master, _ in self._pieces():
            if (g, i) in skip:  # no rank's gradient (or frozen since shard()): not stepped
                continue
            state = self.optimizer.state[master]
            adam_update_(
                master, state["exp_avg"], state["exp_avg_sq"], groups[g], t, self.freeze_step
            )
            state["step"] += 1

    # -- checkpoints ---------------------------------------------------------------------------
    def rank_extra_state(self) -> dict[str, Any] | None:
        """This rank's error-feedback residuals (host copies; None before the freeze): what a
        checkpoint keeps beyond the per-element state (`m` and `v` are saved as `exp_avg` and
        `exp_avg_sq` pieces)."""
        if self.phase is OnebitPhase.WARMUP:
            return None
        return {"onebit_residuals": self.momentum_allreduce.state_dict()}

    def after_load(self, extra: dict[str, Any] | None, *, states_loaded: bool = True) -> None:
        """After a checkpoint's state was loaded (collective): re-enter the phase the restored
        `global_step` implies, rebuild `m` from the restored `exp_avg` pieces, and restore the
        residuals when this rank saved them at this world size (else they restart at zero:
        bounded corrections, Note [why error feedback bounds the accumulated error]).
        Past the freeze the optimizer states must have been loaded: without the frozen `v`
        every update would be `m / eps`."""
        compressed = self.global_step >= self.freeze_step
        if compressed and not states_loaded:
            raise ValueError(
                f"this 1-bit Adam checkpoint is at step {self.global_step}, past freeze_step "
                f"{self.freeze_step}: its frozen variance and momentum are optimizer state; load "
                f"it with load_optimizer_states=True"
            )
        if self.phase is OnebitPhase.COMPRESSED and not compressed:
            raise RuntimeError(
                f"this optimizer is past its freeze step ({self.freeze_step}) and the checkpoint "
                f"is from warm-up step {self.global_step}: the gradient reduction cannot be "
                f"switched back on; load it into a freshly built engine or optimizer"
            )
        self.momentum_allreduce.reset()
        if not compressed:
            return
        if self.phase is OnebitPhase.WARMUP:
            self._freeze()
        else:
            self._assemble_momentum()
        saved = (extra or {}).get("onebit_residuals")
        if saved is not None and saved.get("numel") == self._momentum_numel:
            self.momentum_allreduce.load_state_dict(saved, self._grad_device)

    def state_dict(self) -> dict[str, Any]:
        """`ZeroOptimizer.state_dict` plus this rank's residuals (`rank_extra_state`)."""
        state = super().state_dict()
        state["onebit"] = self.rank_extra_state()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """`ZeroOptimizer.load_state_dict`, then `after_load` (collective)."""
        state_dict = dict(state_dict)
        extra = state_dict.pop("onebit", None)
        super().load_state_dict(state_dict)
        self.after_load(extra)

    def __repr__(self) -> str:
        return (
            f"OnebitZeroOptimizer(stage={self.config.stage}, phase={self.phase.value}, "
            f"freeze_step={self.freeze_step}, global_step={self.global_step})"
        )
