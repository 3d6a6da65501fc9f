"""Inside ``zero.Init``: code that touches a parameter after it was partitioned gets its full value.

Models initialise weights after building them: ``self.apply(self._init_weights)`` at the end of
a root ``__init__`` (nanoGPT), Hugging Face's ``post_init()`` (``GPT2LMHeadModel(config)``,
``LlamaForCausalLM(config)``), ``nn.init.zeros_(emb.weight[pad])``. By then ``zero.Init`` has
partitioned the modules (Note [when Init partitions a module]), so those writes would go to
empty tensors. `InitAccess`, the torch-function mode active only inside the context, sees every
op; when one needs the values of released stage-3 parameters (anything but a shape or metadata
query, ``.data`` included) it hands them to `WriteBack`, which gathers them and keeps them
gathered while the code goes on touching the same module, then writes them back (Note [writing
back what Init's initialisers change]).

Costs: per module touched, one all-gather (``Σ N·s·p`` bytes message) and one broadcast
(``Σ n·p`` bytes); held: ``Ψ/N`` plus the gathered module, so a post-construction initialiser
keeps zero.Init's bound (``Ψ/N`` + the largest module).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.overrides import TorchFunctionMode

from minispeed.comm.validation import group_ranks
from minispeed.zero.stage3.params import ShardedParam
from minispeed.zero.stage3.released import needs_values, released_among

__all__ = ["InitAccess", "WriteBack"]

# Note [writing back what Init's initialisers change]
# Every rank runs the same construction code (Init's contract), so every rank touches the same
# released parameters in the same order, and gathering them there is a collective every rank
# joins. DeepSpeed wraps nn.Module.apply for this (so only initialisers run through apply are
# seen: transformers 5's post_init walks the modules itself); we look at the ops instead, which
# catches any initialiser. The gathered parameters stay gathered while the code touches the same
# module (an initialiser writes a Linear's weight, then its bias, then rescales the weight); the
# first touch of another module writes them back: the group's first rank's values are broadcast
# and re-partitioned (GatheredParameters with that modifier), as partition_param takes the first
# rank's values. What is left is written back when the context exits. So the values equal a
# build without Init from the same seed on the first rank, and at most one module is gathered at
# a time. A view taken of a gathered parameter (``w = lin.weight[0]``) is valid only until the
# next module is touched.


class WriteBack:
    """The released parameters Init's code is touching now, gathered; `flush` writes them back."""

    def __init__(self, gathered: Callable[..., Any]) -> None:
        self._gathered = gathered  # init.GatheredParameters (init.py imports this module)
        self._open: list[Any] = []  # GatheredParameters contexts, entered, in touch order
        self._owners: set[int] = set()  # id() of the modules whose parameters are open
        self.owner_of: dict[ShardedParam, int] = {}  # -> id() of the module that created it

    def touch(self, sps: list[ShardedParam]) -> None:
        """Gather ``sps`` (released); first write back what belongs to other modules."""
        owners = {self.owner_of.get(sp, id(sp)) for sp in sps}
        if self._open and not owners <= self._owners:
            self.flush()
        first = group_ranks(sps[0].data_group)[0]  # every holder takes its values (MiCS: replicas)
        ctx = self._gathered([sp.param for sp in sps], modifier_rank=first)
        ctx.__enter__()
        self._open.append(ctx)
        self._owners |= owners

    def flush(self, exc_type: Any = None) -> None:
        """Write every gathered parameter back (first rank's values) and release it."""
        open_, self._open, self._owners = self._open, [], set()
        for ctx in open_:
            ctx.__exit__(exc_type, None, None)


class InitAccess(TorchFunctionMode):
    """The torch-function mode of ``zero.Init``: factories and touches of released parameters.

    ``before_factory`` runs before each tensor factory (``torch.empty``...): Init partitions the
    modules finished so far before the next parameter's memory is allocated. ``touch`` gets the
    released stage-3 parameters an op needs the values of (`WriteBack.touch`). Cost while Init is
    active: one scan of each op's arguments.
    """

    _FACTORIES = frozenset({"empty", "zeros", "ones", "full", "rand", "randn", "tensor"})

    def __init__(
        self,
        before_factory: Callable[[], None],
        touch: Callable[[list[ShardedParam]], None],
    ) -> None:
        super().__init__()
        self.before_factory = before_factory
        self.touch = touch

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        if getattr(func, "__name__", "") in self._FACTORIES:
            self.before_factory()
        released = released_among(args, kwargs)
        if released and needs_values(func):
            self.touch(released)
        return func(*args, **(kwargs or {}))
