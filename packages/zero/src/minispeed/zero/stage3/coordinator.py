"""Module hooks and the fetch coordinator: which fetch units to gather and release, and when.

For every module that owns a non-persistent parameter (its `FetchUnit`: the parameters it owns, plus
*externals* it was seen reading; one unit per leaf module's whole subtree, see
``set_leaf_module``; built by assemble.py's `build_units`) and for the root, four hooks, in the order they fire:

| hook | calls | what happens |
|---|---|---|
| forward pre-hook | ``coordinator.pre_forward(unit)`` | all-gather (or wait for the prefetch) |
| forward post-hook | ``coordinator.post_forward(unit)`` | release; a gradient hook on the outputs (-> pre-backward) |
| pre-backward | ``coordinator.pre_backward(unit)`` | all-gather again: backward reads the parameters forward released |
| post-backward | ``coordinator.post_backward(unit)`` | release once input gradients exist |

**Pre-backward** is ``torch.autograd.graph.register_multi_grad_hook(outputs, mode="any")``: it
fires once, when the first gradient for any output of the module is computed, i.e. before any of
the module's own backward nodes run.

**Post-backward** is an autograd function (`_PostBackward`) wrapped around the module's
tensor *inputs* in the pre-hook: its backward runs after every gradient w.r.t. those inputs has
been produced, i.e. after the module's backward. A module whose inputs need no gradient (the
embedding reading token ids, the root) has no such point; its parameters are released by the
coordinator's end-of-backward callback instead. (``register_full_backward_hook`` is no
substitute: for such modules it fires *before* their backward, not after.) The root's pre/post
hooks also open and close the forward pass (``begin_forward`` / ``end_forward``).

The `FetchCoordinator` answers each moment: the unit does the transitions (`unshard`, `wait`,
`reshard`, params.py) and counts its users (`hold`, `unhold`); the coordinator decides when.

**Prefetch.** The first forward records the order of module starts and ends (the *trace*,
trace.py); the first backward records the order of module backward starts. Later passes follow
the trace: when M starts, the coordinator also issues async all-gathers for the units that come
next, as `Prefetcher` (prefetch.py) chooses them within the prefetch and live budgets; they are
waited for only when their module starts, so the transfer overlaps M's compute. Parameters with
at most ``stage3_param_persistence_threshold_numel`` elements are *persistent*: gathered once,
never released (the strategy marks them), because fetching many tiny tensors costs more latency
than their memory is worth. A unit needed again soon stays gathered (the prefetcher's `keep`).

**Divergence.** Collectives pair up by issue order, so ranks that run parameter-owning modules in
different orders would hang. The trace (trace.py) checks the order across ranks and raises
`FetchOrderError` on every rank (Note [how divergence is caught]); a rank that leaves a trace it
was following replays the trace's collectives here first, so that nobody waits for it.

Limit: the inputs a parameter-owning module receives are views made by ``_PostBackward``, and
autograd forbids modifying such views in place; a module that writes into its own input
(``x.mul_(...)`` on an argument) must clone it first. Modules without parameters get no hooks.

Costs: a few Python calls per module per pass; no tensors are copied (``_PostBackward`` returns
views of its inputs); the collectives are the units' (params.py) and the checks' (trace.py).
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.hooks import RemovableHandle

from minispeed.core.compiling import eager
from minispeed.core.logging import get_logger
from minispeed.zero.stage3.params import FetchUnit, ShardedParam
from minispeed.zero.stage3.prefetch import Prefetcher
from minispeed.zero.stage3.trace import FetchOrderError, FetchTrace, TraceCheck

__all__ = ["FetchCoordinator", "FetchPhase", "FetchStats", "install_module_hooks"]

_log = get_logger("zero")


# -- the module hooks ------------------------------------------------------------------------------
class _PostBackward(torch.autograd.Function):
    """Identity on the module's inputs whose backward reports "this module's backward is done"."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *tensors: torch.Tensor) -> tuple:
        ctx.callback = callback
        return tensors  # autograd returns them as views; see the module docstring (in-place)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        ctx.callback()
        return (None, *grads)


def _wrap_inputs(args: tuple, kwargs: dict, callback: Callable[[], None]) -> tuple[tuple, dict]:
    """Route the inputs that require grad through one ``_PostBackward`` (identity kept: x, x -> y, y)."""
    plain = not kwargs and all(type(x) is torch.Tensor for x in args)  # the usual call: no pytree
    flat, spec = (list(args), None) if plain else tree_flatten((args, kwargs))
    unique: dict[int, int] = {}  # id(tensor) -> position among the wrapped tensors
    tensors: list[torch.Tensor] = []
    for x in flat:
        if isinstance(x, torch.Tensor) and x.requires_grad and id(x) not in unique:
            unique[id(x)] = len(tensors)
            tensors.append(x)
    if not tensors:
        return args, kwargs
    wrapped = _PostBackward.apply(callback, *tensors)
    flat = [
        wrapped[unique[id(x)]] if isinstance(x, torch.Tensor) and id(x) in unique else x
        for x in flat
    ]
    return (tuple(flat), kwargs) if spec is None else tree_unflatten(flat, spec)


def install_module_hooks(
    root: nn.Module, units: dict[nn.Module, FetchUnit], coordinator: FetchCoordinator
) -> list[RemovableHandle]:
    """Register the forward pre/post hooks on ``root`` and every module in ``units``."""
    handles: list[RemovableHandle] = []
    for module, unit in units.items():
        is_root = module is root
        handles.append(
            module.register_forward_pre_hook(
                _make_pre(unit, coordinator, is_root), with_kwargs=True
            )
        )
        handles.append(
            module.register_forward_hook(_make_post(unit, coordinator, is_root), with_kwargs=True)
        )
    return handles


def _make_pre(unit: FetchUnit, coordinator: FetchCoordinator, is_root: bool) -> Callable:
    def post_backward() -> None:
        coordinator.post_backward(unit)

    def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if is_root:
            coordinator.begin_forward()
        coordinator.pre_forward(unit)
        if torch.is_grad_enabled():
            return _wrap_inputs(args, kwargs, post_backward)
        return args, kwargs

    return eager(pre_hook)


def _make_post(unit: FetchUnit, coordinator: FetchCoordinator, is_root: bool) -> Callable:
    def pre_backward(_grad: torch.Tensor) -> None:
        coordinator.pre_backward(unit)

    def post_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        coordinator.post_forward(unit)
        if torch.is_grad_enabled():
            # The usual output is one tensor: no pytree to flatten.
            flat = [output] if type(output) is torch.Tensor else tree_flatten(output)[0]
            needs_grad = [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]
            if needs_grad:
                register_multi_grad_hook(needs_grad, pre_backward, mode="any")
        if is_root:
            coordinator.end_forward()

    return eager(post_hook)


# -- the coordinator -------------------------------------------------------------------------------
# Note [recomputation keeps its unit]
# Under activation checkpointing (non-reentrant ``torch.utils.checkpoint``, ``zero.checkpoint``) a
# block's forward runs again inside backward, when the block's backward first needs what it saved;
# the modules' backward follows at once, while the gradients flow through the block. Released at
# the end of its recomputed forward, as a forward releases it, a unit was gathered again by its
# pre-backward moments later: one all-gather more per module per step (25% more backward gather
# bytes in the test, tests/test_stage3_checkpoint_gathers.py), synchronous, unless the prefetch
# had it in flight. So a unit that ends a forward during BACKWARD stays gathered, and goes at its
# post-backward as usual, or at the end of backward (the live set's release) if its backward never
# runs. Cost: the recomputed block's parameters held from its recomputation to each module's
# backward (one block of gathered parameters, as FSDP2 holds), against a gather of each.
# Limit: torch's non-reentrant checkpoint stops a recomputation early by default, inside the
# forward of the module that saves the last tensor needed; that forward never ends here, and the
# next forward's recovery releases its unit (a warning). ``zero.checkpoint`` recomputes whole
# blocks, as ``torch.utils.checkpoint.set_checkpoint_early_stop(False)`` makes torch's do.
class FetchPhase(enum.Enum):
    """Which pass the coordinator is in; changed only by its ``_to_*`` transitions.

    IDLE -> FORWARD (`begin_forward`) -> IDLE (`end_forward`); IDLE -> BACKWARD (first
    `pre_backward`) -> IDLE (`end_backward`); any -> IDLE when a pass raised midway and the next
    one starts (``_recover``). Modules run while IDLE (calls outside the root's forward) or during
    BACKWARD (activation-checkpoint recomputation) fetch but do not step the trace; in BACKWARD
    they keep their parameters for their backward (Note [recomputation keeps its unit]).
    """

    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass
class FetchStats:
    """Counters for tests and the docs' trace: what the coordinator did so far."""

    fetch_calls: int = 0  # synchronous all-gathers issued at a module start (or on demand)
    prefetch_calls: int = 0  # async all-gathers issued ahead of use
    demand_fetches: int = 0  # parameters fetched because a module read them by attribute
    trace_checks: int = 0  # cross-rank checks (24·N-byte all-gathers)
    retraces: int = 0  # times every rank left the trace identically and it was re-recorded
    peak_live_numel: int = 0  # most non-persistent parameter elements gathered at once
    live_budget_stops: int = 0  # prefetches cut short by stage3_max_live_numel
    events: list[str] = field(default_factory=list)  # fetch/release log when ``log_events``


class FetchCoordinator:
    """Gathers and releases FetchUnits as modules run, following the trace to prefetch."""

    def __init__(
        self,
        group: Any,
        units: list[FetchUnit],
        *,
        prefetch_numel: int,
        max_live_numel: int,
        check: TraceCheck,
        reuse_numel: int = 0,
    ) -> None:
        self.units = units
        self.stats = FetchStats()
        self.trace = FetchTrace(group, units, check, self.stats)
        self.prefetcher = Prefetcher(prefetch_numel, max_live_numel, reuse_numel, self.stats)
        self.log_events = False
        self._phase = FetchPhase.IDLE
        self.stack: list[FetchUnit] = []  # units of the modules running forward, innermost last
        self._bwd_held: Counter[FetchUnit] = Counter()

    # -- the phase --------------------------------------------------------------------------------
    @property
    def phase(self) -> FetchPhase:
        """The pass in progress (read-only: see `FetchPhase` for the transitions)."""
        return self._phase

    def _to_pass(self, phase: FetchPhase) -> None:
        assert self._phase is FetchPhase.IDLE, f"stage 3: {phase.value} starts during {self.phase}"
        self._phase = phase

    def _to_idle(self, ending: FetchPhase | None) -> None:
        """The pass ``ending`` ends; ``None``: a pass that raised midway, from any phase."""
        assert ending in (None, self._phase), f"stage 3: {ending} ends during {self._phase}"
        self._phase = FetchPhase.IDLE

    # -- forward ----------------------------------------------------------------------------------
    @property
    def in_forward(self) -> bool:
        """Whether a module run by our hooks is executing (demand fetches are allowed)."""
        return bool(self.stack)

    def begin_forward(self) -> None:
        """The root module starts: follow the trace if there is one, else record it."""
        if self._phase is not FetchPhase.IDLE or self.stack:
            self._recover()
        self._to_pass(FetchPhase.FORWARD)
        self.trace.begin_forward()

    def pre_forward(self, unit: FetchUnit) -> None:
        """Module ``unit`` starts its forward: its parameters must be gathered on return."""
        if self._phase is FetchPhase.FORWARD:
            self._step("pre", unit, f"module {unit.label} starts its forward")
        elif self._phase is FetchPhase.IDLE:
            self.trace.check_call(unit)
        self._acquire(unit)
        self.stack.append(unit)
        if self._phase is FetchPhase.FORWARD:
            self._prefetch(self.trace.upcoming_forward(), unit)

    def post_forward(self, unit: FetchUnit) -> None:
        """Module ``unit`` finished its forward: release what nobody else holds."""
        if self._phase is FetchPhase.FORWARD:
            self._step("post", unit, f"module {unit.label} ends its forward", cross_check=False)
        if self.stack and self.stack[-1] is unit:
            self.stack.pop()
        elif unit in self.stack:
            del self.stack[len(self.stack) - 1 - self.stack[::-1].index(unit)]
        # A forward inside backward is a recomputation (Note [recomputation keeps its unit]).
        keep = set(unit.params) if self._phase is FetchPhase.BACKWARD else None
        self._release(unit, keep or self.prefetcher.keep(unit, self.trace.upcoming_forward()))

    def end_forward(self) -> None:
        """The root module returned: verify the pass, release prefetched leftovers."""
        if self._phase is not FetchPhase.FORWARD:
            return
        if not self.trace.forward_complete():
            self._diverge(0, "reaches the end of its forward")
            self.trace.finish_forward()
        else:
            self.trace.end_forward()
        self._release_unclaimed()
        self._to_idle(FetchPhase.FORWARD)

    def demand_fetch(self, sp: ShardedParam, what: str) -> None:
        """A running module read a released parameter by attribute: fetch it, make it an external.

        It is charged to the innermost running module, which holds it until it ends and fetches
        it with its own parameters from the next pass on (so steady-state passes have no demand
        fetches; one there means control flow changed, and is treated as a divergence).
        """
        unit = self.stack[-1]
        if self._phase is FetchPhase.FORWARD:
            what = f"reads {what} inside {unit.label}"
            if self.trace.following:
                self._diverge(unit.fingerprint("get"), what)
            self.trace.check_demand(what)
        self.stats.demand_fetches += 1
        external = FetchUnit(-1, unit.name, unit.kind, [sp])
        self._fetch(external, unit)
        external.hold()  # released with ``unit``, which lists it from now on
        unit.params.append(sp)

    # -- backward ---------------------------------------------------------------------------------
    def pre_backward(self, unit: FetchUnit) -> None:
        """Gradients reached ``unit``'s outputs: gather it again before its backward runs."""
        if self._phase is not FetchPhase.BACKWARD:
            self._begin_backward()
        self.trace.step_backward(unit)
        self._acquire(unit)
        self._bwd_held[unit] += 1
        self._prefetch(self.trace.upcoming_backward(), unit)

    def post_backward(self, unit: FetchUnit) -> None:
        """Gradients for ``unit``'s inputs are computed: its parameters may go."""
        if self._bwd_held[unit] <= 0:
            return
        self._bwd_held[unit] -= 1
        self._release(unit, self.prefetcher.keep(unit, self.trace.upcoming_backward()))

    def end_backward(self) -> None:
        """Autograd finished (queued callback): release everything fetched for backward."""
        if self._phase is not FetchPhase.BACKWARD:
            return
        self._release_backward_holds()
        self._release_unclaimed()
        self.trace.end_backward()
        self._to_idle(FetchPhase.BACKWARD)

    def _begin_backward(self) -> None:
        if self._phase is FetchPhase.FORWARD:  # the forward raised midway; start clean
            self._recover()
        self._to_pass(FetchPhase.BACKWARD)
        self.trace.begin_backward()
        Variable._execution_engine.queue_callback(self.end_backward)

    # -- gathering and releasing ------------------------------------------------------------------
    def _fetch(self, unit: FetchUnit, running: FetchUnit | None) -> None:
        """Gather ``unit`` synchronously (waiting for members already in flight)."""
        if unit.missing():
            self.stats.fetch_calls += 1
            self._note("fetch", unit.missing(), running)
            self.prefetcher.track(unit.unshard())
        unit.wait()

    def _acquire(self, unit: FetchUnit) -> None:
        self._fetch(unit, unit)
        unit.hold()

    def _release(self, unit: FetchUnit, keep: set[ShardedParam]) -> None:
        unit.unhold()
        self._note("release", unit.reshard(keep), unit)

    def _release_backward_holds(self) -> None:
        for unit, count in self._bwd_held.items():
            for _ in range(count):
                self._release(unit, set())
        self._bwd_held.clear()

    def _prefetch(self, upcoming: Iterable[FetchUnit], current: FetchUnit) -> None:
        """Issue the prefetcher's chunks as async all-gathers (prefetch.py)."""
        for chunk in self.prefetcher.chunks(upcoming):
            self.stats.prefetch_calls += 1
            self._note("prefetch", chunk, current)
            self.prefetcher.track(FetchUnit(-1, "prefetch", "", chunk).unshard(async_op=True))

    def _release_unclaimed(self) -> None:
        """Release prefetched or kept parameters nobody claimed (the pass ended before their
        module ran again)."""
        self._note("release", FetchUnit(-1, "", "", self.prefetcher.live()).reshard(), None)
        self.prefetcher.live_numel()

    def _note(self, what: str, sps: list[ShardedParam], unit: FetchUnit | None) -> None:
        """With ``log_events``: one line per fetch/prefetch/release, with gathered bytes."""
        if self.log_events and sps:
            nbytes = sum(sp.padded_numel * sp.shard.element_size() for sp in sps)
            where = unit.label if unit is not None else "(end of pass)"
            self.stats.events.append(
                f"{self._phase.value:8} {where:32} {what:8} {nbytes:7d} B  "
                + " ".join(sp.name for sp in sps)
            )

    # -- leaving the trace ------------------------------------------------------------------------
    def _step(self, kind: str, unit: FetchUnit, what: str, cross_check: bool = True) -> None:
        """Advance the forward trace; if this rank left it, handle the divergence, then record."""
        if not self.trace.step_forward(kind, unit, what, cross_check):
            self._diverge(unit.fingerprint(kind), what)
            self.trace.step_forward(kind, unit, what, cross_check)

    def _diverge(self, fingerprint: int, what: str) -> None:
        """This rank left the forward trace. See Note [how divergence is caught] (trace.py)."""
        pos = self.trace.diverged(what)  # raises in ``off`` mode
        replaying = self.trace.check is TraceCheck.FIRST
        if replaying:  # issue the collectives of the rest of the trace, as the others do
            for kind, unit in self.trace.replay():
                if kind == "pre":
                    self._acquire(unit)
                    self._prefetch(self.trace.upcoming_forward(), unit)
                else:
                    self._release(unit, self.prefetcher.keep(unit, self.trace.upcoming_forward()))
            self._release_unclaimed()
        try:
            self.trace.resync(pos, fingerprint, what)  # raises unless every rank diverged alike
        except FetchOrderError:
            if replaying:  # the replay released what the running modules held
                self.stack.clear()
            raise
        if replaying:
            for running in self.stack:
                self._acquire(running)

    def _recover(self) -> None:
        """A previous pass raised midway: drop what it held so the next pass starts clean."""
        _log.warning(
            "stage 3: the previous forward/backward did not finish; releasing its parameters"
        )
        for unit in self.stack:
            self._release(unit, set())
        self.stack.clear()
        self._release_backward_holds()
        self._release_unclaimed()
        self._to_idle(None)
