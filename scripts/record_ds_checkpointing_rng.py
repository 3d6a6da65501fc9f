"""DeepSpeed's activation checkpointing with Megatron's RNG tracker, kept as a reference:
`deepspeed.checkpointing.configure(mpu, partition_activations=...)` with a Megatron-style mpu
whose tensor-parallel group is every rank, `model_parallel_cuda_manual_seed`, blocks that draw
dropout both from the default generator and inside `get_cuda_rng_tracker().fork()`, run plain
and through `checkpoint`, `CheckpointFunction.apply` and `non_reentrant_checkpoint`; the
tracker's bookkeeping (`add`, `get_states`, `set_states`, `reset`, its errors) and
`model_parallel_reconfigure_tp_seed`. It records the draws each seeded state gives, and per run
the loss, the input's and parameters' gradients and the draws after backward (the streams
continue as without checkpointing). On the CPU the "cuda" tracker holds CPU generator states
(DeepSpeed's CPU accelerator's `get_rng_state` is `torch.get_rng_state`).

Recorded on DeepSpeed 0.19.8 on the CPU, on 2 gloo processes (tensor-parallel size 2) and on 1:

```bash
env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run \
    --nproc_per_node 2 scripts/record_ds_checkpointing_rng.py
env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run \
    --nproc_per_node 1 scripts/record_ds_checkpointing_rng.py
```

which write `tests/engine/fixtures/ds_checkpointing_rng_2.json` and `..._1.json`.
`tests/engine/test_adapters_checkpointing_rng.py` runs this same file with its import line
changed to minispeed's and compares.
"""

from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from torch import nn

FIXTURES = Path(__file__).resolve().parents[1] / "tests/engine/fixtures"
SEED = 1234


class Mpu:
    """Megatron's model-parallel unit with every rank in one tensor-parallel group."""

    def get_tensor_model_parallel_rank(self):
        return dist.get_rank()

    def get_tensor_model_parallel_world_size(self):
        return dist.get_world_size()

    def get_tensor_model_parallel_group(self):
        return dist.group.WORLD

    get_model_parallel_rank = get_tensor_model_parallel_rank
    get_model_parallel_world_size = get_tensor_model_parallel_world_size
    get_model_parallel_group = get_tensor_model_parallel_group

    def get_data_parallel_rank(self):
        return 0

    def get_data_parallel_world_size(self):
        return 1


class ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's row-parallel output: summed over the tensor-parallel group in forward, the
    gradient passed through in backward."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class Block(nn.Module):
    """Dropout from the default generator (the same mask on every rank), then from the tracker's
    model-parallel state (a mask per rank) on the rank's part, summed over the group: the output,
    the next block's input, is the same on every rank, as partition_activations assumes."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = nn.functional.dropout(torch.tanh(self.lin(x)), 0.3)
        with deepspeed.checkpointing.get_cuda_rng_tracker().fork():
            part = nn.functional.dropout(h, 0.5)
        return h + ReduceFromTensorParallel.apply(part)


def draws(n=3):
    """The next `n` draws of the default generator and of the tracker's model-parallel state
    (both advance)."""
    default = torch.rand(n).tolist()
    with deepspeed.checkpointing.get_cuda_rng_tracker().fork():
        tracked = torch.rand(n).tolist()
    return {"default": default, "model_parallel": tracked}


def via_function(block, x):
    outputs = []
    deepspeed.checkpointing.CheckpointFunction.apply(block, outputs, x)
    return outputs[0]


RUNNERS = {
    "plain": lambda block, x: block(x),
    "checkpoint": deepspeed.checkpointing.checkpoint,
    "CheckpointFunction": via_function,
    "non_reentrant_checkpoint": deepspeed.checkpointing.non_reentrant_checkpoint,
}


def run(name):
    """Two blocks run by `RUNNERS[name]` from the same seeds: loss, gradients, draws after."""
    torch.manual_seed(SEED)
    deepspeed.checkpointing.model_parallel_cuda_manual_seed(SEED)
    blocks = nn.ModuleList([Block(), Block()])
    x = torch.randn(4, 8, requires_grad=True)
    h = x
    for block in blocks:
        h = RUNNERS[name](block, h)
    loss = h.square().sum()
    loss.backward()
    return {
        "loss": loss.item(),
        "x_grad": x.grad.flatten().tolist(),
        "weight_grads": [b.lin.weight.grad.flatten().tolist() for b in blocks],
        "after": draws(),
    }


def error(call):
    """The type name of what `call()` raises, or None."""
    try:
        call()
    except Exception as e:  # the type DeepSpeed raises is what is recorded
        return type(e).__name__
    return None


def run_or_error(name):
    """`run(name)`, or the type of the error it raised (DeepSpeed fails some cases on the CPU)."""
    try:
        return run(name)
    except Exception as e:  # recorded, as above
        return {"error": type(e).__name__, "message": str(e)[:200]}


def tracker_record():
    tracker = deepspeed.checkpointing.get_cuda_rng_tracker()
    torch.manual_seed(SEED)
    deepspeed.checkpointing.model_parallel_cuda_manual_seed(SEED)
    record = {
        "names": sorted(tracker.get_states()),
        "seeded": draws(),
        "same_object": tracker is deepspeed.checkpointing.get_cuda_rng_tracker(),
    }
    states = tracker.get_states()
    first = draws()
    tracker.set_states(states)  # back to the states before `first`'s fork
    record["set_states_replays"] = draws()["model_parallel"] == first["model_parallel"]
    record["errors"] = {
        "duplicate_seed": error(lambda: tracker.add("other", SEED + 2718 + dist.get_rank())),
        "duplicate_name": error(lambda: tracker.add("model-parallel-rng", 7)),
        "unknown_name": error(lambda: tracker.fork("nope").__enter__()),
    }
    deepspeed.checkpointing.model_parallel_reconfigure_tp_seed(SEED + 5)
    record["reconfigured"] = draws()
    tracker.reset()
    record["after_reset"] = sorted(tracker.get_states())
    record["fork_after_reset"] = error(lambda: tracker.fork().__enter__())
    return record


def main():
    mpu = Mpu()
    result = {"tracker": None, "runs": {}}
    for partition in (False, True):
        deepspeed.checkpointing.configure(mpu, partition_activations=partition)
        result["runs"][f"partition={partition}"] = {name: run_or_error(name) for name in RUNNERS}
    deepspeed.checkpointing.configure(mpu)
    result["tracker"] = tracker_record()
    return result


if __name__ == "__main__":
    from ds_fixture import record  # scripts/ is on sys.path when run as a script

    deepspeed.init_distributed()
    result = main()
    record(result, FIXTURES / f"ds_checkpointing_rng_{dist.get_world_size()}.json")
