"""The contenders of `zero_vs_torch.py`: each system built over the same GPT, seed and AdamW,
as a `Trainer` of three phases, and the `zero_optimization` dict minispeed and DeepSpeed share."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))  # examples/gpt.py and data.py

from gpt import GPT, GPTConfig  # noqa: E402

from zerobench.limit import LIMITS, limit_trainer  # noqa: E402

# (ours, its torch counterpart); the order is also the order of the table.
PAIRS = [
    ("ZeRO-0", "torch DDP"),
    ("ZeRO-1", "torch ZeroRedundancyOptimizer"),
    ("ZeRO-2", "torch ZeroRedundancyOptimizer"),
    ("ZeRO-3", "torch FSDP2"),
]
# Against DDP as well at every stage <= 2: the goal "no slower than DDP" at both key sets.
PAIRS_DDP = [("ZeRO-1", "torch DDP"), ("ZeRO-2", "torch DDP")]
PAIRS_DEEPSPEED = [(f"ZeRO-{k}", f"DeepSpeed ZeRO-{k}") for k in range(4)]
CONTENDERS = [
    "torch DDP",
    "ZeRO-0",
    "torch ZeroRedundancyOptimizer",
    "ZeRO-1",
    "ZeRO-2",
    "torch FSDP2",
    "ZeRO-3",
    "floor (no communication)",
    *LIMITS,
]
#: What any data-parallel ZeRO step must at least compute: see `build`. It does not train (its
#: parameters never change), so it is left out of the loss comparison.
FLOOR = "floor (no communication)"
#: Most a contender's mean loss may differ from the first's at any step (fp32; reduction orders
#: differ between systems) before the benchmark refuses to compare their times.
LOSS_TOLERANCE = 1e-3
DEEPSPEED_CONTENDERS = [f"DeepSpeed ZeRO-{k}" for k in range(4)]
#: `--mics-shard-size S` (world a multiple of S): MiCS against FSDP2's HSDP on the same
#: replicate × shard mesh, and against plain ZeRO-3 and FSDP2 over every rank.
MICS_CONTENDERS = ["torch FSDP2", "ZeRO-3", "torch FSDP2 HSDP", "MiCS"]
PAIRS_MICS = [("MiCS", "torch FSDP2 HSDP"), ("MiCS", "ZeRO-3")]

# --size presets: (n_layer, n_head, n_embd, block_size, micro_batch). `tiny` is
# engine_vs_deepspeed.py's small model (30K parameters there, 27.6K over this corpus's 53 symbols).
SIZES = {"tiny": (2, 4, 32, 16, 4), "small": (4, 4, 256, 64, 8), "large": (8, 8, 592, 256, 4)}


def size_args(args: argparse.Namespace) -> argparse.Namespace:
    """`args` (with ``size``) completed as `zero_vs_torch.py`'s defaults complete them: the model
    of that size, seed 0, every ZeRO knob at its default; for the probes beside the benchmark."""
    names = ("n_layer", "n_head", "n_embd", "block_size", "micro_batch")
    for key, value in zip(names, SIZES[args.size]):
        setattr(args, key, value)
    args.seed, args.persistence_threshold, args.reduce_bucket_numel = 0, 0, 0
    args.prefetch_numel, args.overlap_comm, args.mics_shard_size = 0, "default", 0
    return args


def trains(name: str) -> bool:
    """Whether `name` trains the model (its losses are compared): not the floor, whose
    parameters never change, nor what a stage's limit adds to it (`zerobench/limit.py`)."""
    return name != FLOOR and name not in LIMITS


def deepspeed_available() -> bool:
    """Whether `import deepspeed` works here (with its CPU accelerator)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed  # noqa: F401
    except Exception:
        return False
    return True


@dataclass
class Trainer:
    """One contender, as its three phases; `step` runs them and returns the local loss."""

    name: str
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x, y) -> loss
    backward: Callable[[torch.Tensor], None]
    optimizer_step: Callable[[], None]  # the step and clearing the gradients
    keep: Any  # model and optimizer, kept alive while the trainer is

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One training step."""
        loss = self.forward(x, y)
        self.backward(loss)
        self.optimizer_step()
        return loss.item()


def _model(args: argparse.Namespace, vocab: int) -> GPT:
    torch.manual_seed(args.seed)
    model = GPT(
        GPTConfig(
            vocab_size=vocab,
            block_size=args.block_size,
            n_layer=args.n_layer,
            n_head=args.n_head,
            n_embd=args.n_embd,
        )
    )
    if getattr(args, "checkpoint", False):
        for block in model.blocks:
            _checkpoint_block(block)
    return model


def _checkpoint_block(block: torch.nn.Module) -> None:
    """`--checkpoint`: `block`'s forward runs under `torch.utils.checkpoint` (non-reentrant), for
    every contender alike: the block keeps only its input for backward and runs its forward again
    there. Set on the instance before any system wraps the model, so FSDP2's `fully_shard` hooks and
    ours fire around the checkpointed call, and the recomputation runs inside the block. Early
    stopping is off: the whole block is recomputed (as `zero.checkpoint` does); torch's default
    stops the recomputation inside a module's forward once the tensors asked for exist, and that
    module's forward hooks never see it end (ZeRO-3 then warns, recovers and gathers again)."""
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    inner = block.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        with set_checkpoint_early_stop(False):
            return checkpoint(inner, x, use_reentrant=False)

    block.forward = forward


def _adamw(params) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


#: The gradient of every element AdamW steps without a model behind it (the floor; stage 0's
#: limit). Any normal nonzero value: AdamW's time depends on the values after all. With zero
#: gradients ``exp_avg_sq`` stays 0, and ``sqrt`` of zeros took 3.0 ms per 700K elements on this
#: machine against 0.22 ms for real values: the floor's step was ~75 ms too slow at 33.9M
#: parameters (docs/benchmarks.md, "Stage 3's page faults").
STAND_IN_GRAD = 1e-3


def stepped_leaves(numels: list[int]) -> list[torch.Tensor]:
    """One fp32 leaf per size (sizes of 0 left out), each with a gradient of `STAND_IN_GRAD`s:
    what AdamW steps in place of a ZeRO stage's shards."""
    leaves = [torch.zeros(n, requires_grad=True) for n in numels if n]
    for leaf in leaves:
        leaf.grad = torch.full_like(leaf, STAND_IN_GRAD)
    return leaves


#: torch DDP's default bucket (`bucket_cap_mb=25`) in fp32 elements: what stages 0 and 1 are
#: compared against (ZeroRedundancyOptimizer reduces gradients through DDP's buckets too).
DDP_BUCKET_NUMEL = 25 * 2**20 // 4


def _bucket_numel(args: argparse.Namespace, stage: int) -> int:
    """`--reduce-bucket-numel`, or by default the granularity of the stage's torch counterpart:
    DDP's 25 MiB buckets for stages 0-1; 500,000 elements for stages 2-3, whose staging buckets
    are transient memory (FSDP2 reduces one ~790,000-element block at a time here)."""
    if args.reduce_bucket_numel:
        return args.reduce_bucket_numel
    return DDP_BUCKET_NUMEL if stage <= 1 else 500_000


def zero_section(args: argparse.Namespace, stage: int, block_numel: int) -> dict[str, Any]:
    """The DeepSpeed `zero_optimization` dict that minispeed and DeepSpeed are both given.

    `--keys tuned`: the granularity of each stage's torch counterpart (see `_bucket_numel`),
    stage 3 prefetching one transformer block as FSDP2 does; `deepspeed`: only the stage, so every
    size is DeepSpeed's default (5e8-element buckets, 5e7 prefetch, 1e5 persistence threshold);
    `ddp`: DDP's 25 MiB buckets for reduce and all-gather.
    """
    section: dict[str, Any] = {"stage": stage}
    if args.keys == "tuned":
        section["reduce_bucket_size"] = _bucket_numel(args, stage)
        section["stage3_param_persistence_threshold"] = args.persistence_threshold
        section["stage3_prefetch_bucket_size"] = args.prefetch_numel or block_numel
    elif args.keys == "ddp":
        section["reduce_bucket_size"] = DDP_BUCKET_NUMEL
        section["allgather_bucket_size"] = DDP_BUCKET_NUMEL
    elif args.reduce_bucket_numel:
        section["reduce_bucket_size"] = args.reduce_bucket_numel
    if args.overlap_comm != "default":  # otherwise each system's own default for the stage
        section["overlap_comm"] = args.overlap_comm == "true"
    return section


def _zero(
    stage: int, args: argparse.Namespace, model: GPT, block_numel: int, mics: bool = False
) -> tuple[Any, Any]:
    """(minispeed's ZeRO-`stage` optimizer over `model`, its ZeroConfig); `mics`: stage 3 sharded
    inside groups of `args.mics_shard_size`."""
    import minispeed.zero as zero

    section = zero_section(args, stage, block_numel)
    if mics:
        section["mics_shard_size"] = args.mics_shard_size
    cfg = zero.ZeroConfig.from_section(section)
    return zero.shard(model, _adamw(model.parameters()), config=cfg), cfg


def build(name: str, args: argparse.Namespace, vocab: int) -> Trainer:
    """A fresh contender `name` over a model built from `args.seed`."""
    model = _model(args, vocab)
    if name == "torch DDP" or name == "torch ZeroRedundancyOptimizer":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model)
        if name == "torch DDP":
            opt = _adamw(ddp.parameters())
        else:
            opt = ZeroRedundancyOptimizer(
                ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3, weight_decay=0.01
            )

        def ddp_step() -> None:
            opt.step()
            opt.zero_grad(set_to_none=True)

        return Trainer(name, lambda x, y: ddp(x, y)[1], torch.Tensor.backward, ddp_step, (ddp, opt))
    if name in ("torch FSDP2", "torch FSDP2 HSDP"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = None  # FSDP2 over every rank; HSDP: a (world/S) x S replicate × shard mesh
        if name == "torch FSDP2 HSDP":
            world, s = dist.get_world_size(), args.mics_shard_size
            mesh = init_device_mesh("cpu", (world // s, s), mesh_dim_names=("replicate", "shard"))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = _adamw(model.parameters())

        def fsdp_step() -> None:
            opt.step()
            opt.zero_grad(set_to_none=True)

        return Trainer(
            name, lambda x, y: model(x, y)[1], torch.Tensor.backward, fsdp_step, (model, opt)
        )
    if name == FLOOR:
        # The compute every rank of a ZeRO step must do, with no communication and no
        # bookkeeping: forward and backward on this rank's micro-batch, then AdamW over this
        # rank's 1/N of every parameter (one tensor per parameter, as ZeRO's masters are: one
        # flat tensor would make torch's AdamW allocate model-sized temporaries, which cost
        # fresh pages every step; gradients are stand-ins: `stepped_leaves`). No data-parallel
        # system that keeps the same model, batch and optimizer can beat it on this machine, so
        # it bounds every ratio.
        world = dist.get_world_size()
        shards = stepped_leaves([-(-p.numel() // world) for p in model.parameters()])
        floor_opt = _adamw(shards)

        def floor_step() -> None:
            floor_opt.step()
            model.zero_grad(set_to_none=True)

        return Trainer(
            name,
            lambda x, y: model(x, y)[1],
            torch.Tensor.backward,
            floor_step,
            (model, shards, floor_opt),
        )
    block_numel = sum(p.numel() for p in model.blocks[0].parameters())
    if name in LIMITS:
        stage = LIMITS.index(name)

        def build_zero() -> tuple[GPT, Any, Any]:
            fresh = _model(args, vocab)
            return fresh, *_zero(stage, args, fresh, block_numel)

        return limit_trainer(stage, args, build_zero, vocab)
    if name.startswith("ZeRO-") or name == "MiCS":
        stage = 3 if name == "MiCS" else int(name.removeprefix("ZeRO-"))
        zopt, _ = _zero(stage, args, model, block_numel, mics=name == "MiCS")
        # zopt.step() also clears the gradients, as zero_grad(set_to_none=True) does for torch.
        return Trainer(name, lambda x, y: model(x, y)[1], zopt.backward, zopt.step, (model, zopt))
    if name.startswith("DeepSpeed ZeRO-"):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        stage = int(name.removeprefix("DeepSpeed ZeRO-"))
        ds_config = {
            "train_micro_batch_size_per_gpu": args.micro_batch,
            "gradient_accumulation_steps": 1,
            # DeepSpeed 0.19.8 clips at 1.0 when the key is left out (GRADIENT_CLIPPING_DEFAULT);
            # DDP, FSDP2 and our stages do not clip here, so DeepSpeed must not either, or it
            # trains something else (it ended 1.48 in loss away at 33.9M parameters).
            "gradient_clipping": 0.0,
            "zero_optimization": zero_section(args, stage, block_numel),
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
        }
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=_adamw(model.parameters()), config=ds_config
        )
        # engine.step() steps and clears the gradients.
        return Trainer(
            name, lambda x, y: engine(x, y)[1], engine.backward, engine.step, (engine, model)
        )
    raise ValueError(f"unknown contender {name!r}; choose from {CONTENDERS}")
