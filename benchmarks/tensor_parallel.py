"""Tensor parallelism: minispeed.tensor_parallel against torch.distributed.tensor.parallel (DTensor).

```bash
.venv/bin/python benchmarks/tensor_parallel.py                                   # small: C=128, 4 blocks
.venv/bin/python benchmarks/tensor_parallel.py --width 512 --layers 8 --vocab 16384   # 33.6M params
```

Two gloo processes (CPU), one tensor-parallel group of 2. The model is minispeed's GPT
(examples/gpt.py), built from one seed on each rank and copied for each contender. The plan is
the same for both: every block's `qkv` and `mlp.fc` column-parallel, `attn.proj` and `mlp.proj`
row-parallel, the head count halved; embeddings, norms and the tied head replicated (DTensor's
`RowwiseParallel` embedding cannot feed the model's own `F.linear(x, wte.weight)` head). DTensor's
`ColwiseParallel` cuts the fused `qkv` weight in contiguous rows, so its copy has the rows put in
rank-major order first (rank r's q, k and v slices adjacent): both contenders then hold the same
slices and compute the same loss. `--sequence-parallel` adds Megatron-SP to both (DTensor:
`SequenceParallel` norms, `Shard(1)` layouts; ours: `SequenceShard` norms and sequence-parallel
column / row layers, with the residual stream scattered at the first block and gathered after
`ln_f`).

Per step (SGD, forward + backward + update), both contenders take turns for `--rounds` rounds;
reported: median and best step time (max over ranks), the median CPU time of a step (the
process's own seconds, max over ranks: less sensitive than wall time to other programs on a
shared machine, though it counts gloo's polling), peak bytes of tensors saved for backward
(parameters excluded, counted through `torch.autograd.graph.saved_tensors_hooks`; DTensors by
their local shard), and the losses of every step, which must agree to 1e-5 before anything is
printed. Benchmarks may use torch.distributed directly for the torch baseline; minispeed's
contender goes through minispeed.comm.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]


def gpt_module():
    spec = importlib.util.spec_from_file_location("minispeed_example_gpt", REPO / "examples/gpt.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["minispeed_example_gpt"] = module
    spec.loader.exec_module(module)
    return module


class SavedBytes:
    """Peak bytes of live tensors saved for backward (parameters excluded; DTensors by shard)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.skip = {self._storage(p)[0] for p in params}
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    @staticmethod
    def _storage(t: torch.Tensor) -> tuple[int, int]:
        t = getattr(t, "_local_tensor", t)
        s = t.untyped_storage()
        return s.data_ptr(), s.nbytes()

    @contextlib.contextmanager
    def hooks(self):
        def pack(t: torch.Tensor) -> Any:
            key, nbytes = self._storage(t)
            if key in self.skip:
                return t
            if key not in self.live:
                self.live[key] = 0
                self.now += nbytes
                self.peak = max(self.peak, self.now)
            self.live[key] += 1
            return (t, key, nbytes)

        def unpack(packed: Any) -> torch.Tensor:
            if not isinstance(packed, tuple):
                return packed
            t, key, nbytes = packed
            if key in self.live:
                self.live[key] -= 1
                if self.live[key] == 0:
                    del self.live[key]
                    self.now -= nbytes
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield


def ours(model: nn.Module, sp: bool) -> nn.Module:
    import minispeed.tensor_parallel as tp

    styles = {
        "blocks.*.attn": tp.Heads(("n_head",)),
        "blocks.*.attn.qkv": tp.Column(parts=3, sequence_parallel=sp),
        "blocks.*.attn.proj": tp.Row(sequence_parallel=sp),
        "blocks.*.mlp.fc": tp.Column(sequence_parallel=sp),
        "blocks.*.mlp.proj": tp.Row(sequence_parallel=sp),
    }
    tg = tp.TensorGroup.of(None)
    if sp:
        styles |= {"blocks.*.ln1": tp.SequenceShard(), "blocks.*.ln2": tp.SequenceShard()}
        styles |= {"ln_f": tp.SequenceShard()}
        model.blocks[0].register_forward_pre_hook(
            lambda _m, args: (tp.scatter_to_sequence(args[0], tg),)
        )
        # the head is replicated: every rank's gradient of the gathered output is already whole,
        # so backward keeps this rank's slice (not gather_from_sequence's reduce-scatter)
        model.ln_f.register_forward_hook(lambda _m, _i, out: tp.gather_from_parallel(out, tg, -2))
    return tp.parallelize(model, tp.Plan(styles), tg)


def theirs(model: nn.Module, sp: bool, n: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (n,))
    plan: dict[str, Any] = {}
    for i, block in enumerate(model.blocks):
        block.attn.n_head //= n
        with torch.no_grad():  # rank-major q/k/v rows, so Shard(0) gives each rank whole heads
            for t in (block.attn.qkv.weight, block.attn.qkv.bias):
                parts = [p.chunk(n, 0) for p in t.chunk(3, 0)]
                t.copy_(torch.cat([parts[q][r] for r in range(n) for q in range(3)]))
        col = {"input_layouts": Shard(1)} if sp else {}
        row = {"output_layouts": Shard(1)} if sp else {}
        plan |= {
            f"blocks.{i}.attn.qkv": ColwiseParallel(**col),
            f"blocks.{i}.attn.proj": RowwiseParallel(**row),
            f"blocks.{i}.mlp.fc": ColwiseParallel(**col),
            f"blocks.{i}.mlp.proj": RowwiseParallel(**row),
        }
        if sp:
            plan |= {f"blocks.{i}.ln1": SequenceParallel(), f"blocks.{i}.ln2": SequenceParallel()}
    if sp:
        plan |= {
            "blocks.0": PrepareModuleInput(
                input_layouts=(Replicate(),),
                desired_input_layouts=(Shard(1),),
                use_local_output=True,
            ),
            "ln_f": SequenceParallel(),
        }
        parallelize_module(model, mesh, plan)
        parallelize_module(
            model.ln_f, mesh,
            PrepareModuleOutput(output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),)),
        )  # fmt: skip
        return model
    return parallelize_module(model, mesh, plan)


def _step(model: nn.Module, opt: torch.optim.Optimizer, saved: SavedBytes, x, y) -> float:
    opt.zero_grad(set_to_none=True)
    with saved.hooks():
        logits, _ = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
    opt.step()
    return loss.item()


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    os.environ.setdefault("MINISPEED_ACCELERATOR", "cpu")
    torch.set_num_threads(args.threads)
    import minispeed.comm as comm

    comm.init_distributed(backend="gloo")
    gpt = gpt_module()
    torch.manual_seed(args.seed)
    cfg = gpt.GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers,
                        n_head=args.heads, n_embd=args.width)  # fmt: skip
    base = gpt.GPT(cfg)
    params = base.num_params()
    models = {
        "minispeed": ours(copy.deepcopy(base), args.sequence_parallel),
        "torch": theirs(copy.deepcopy(base), args.sequence_parallel, world),
    }
    del base
    state = {}
    for lib, m in models.items():
        opt = torch.optim.SGD(m.parameters(), lr=args.lr)
        state[lib] = (m, opt, SavedBytes(list(m.parameters())))
    g = torch.Generator().manual_seed(args.seed + 1)
    steps = args.rounds + 1  # one warm-up round
    batches = [
        torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g) for _ in range(steps)
    ]
    losses: dict[str, list[float]] = {lib: [] for lib in models}
    times: dict[str, list[float]] = {lib: [] for lib in models}
    cpu: dict[str, list[float]] = {lib: [] for lib in models}
    for i, tok in enumerate(batches):
        for lib in models:  # taking turns: a burst of load hits both alike
            m, opt, saved = state[lib]
            comm.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            losses[lib].append(_step(m, opt, saved, tok[:, :-1], tok[:, 1:]))
            if i > 0:
                times[lib].append(time.perf_counter() - start)
                cpu[lib].append(time.process_time() - start_cpu)
    out = {
        lib: {
            "times": times[lib],
            "cpu": cpu[lib],
            "losses": losses[lib],
            "saved_peak": state[lib][2].peak,
        }
        for lib in models
    }
    out["params"] = params
    out["param_bytes_per_rank"] = {
        lib: sum(getattr(p, "_local_tensor", p).numel() * 4 for p in m.parameters())
        for lib, m in models.items()
    }
    queue.put((rank, out))
    comm.barrier()
    comm.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def report(results: dict[int, dict], args: argparse.Namespace) -> dict[str, Any]:
    ranks = [results[r] for r in sorted(results)]
    summary: dict[str, Any] = {"args": vars(args), "params": ranks[0]["params"], "rows": {}}
    for lib in ("minispeed", "torch"):
        a, b = ranks[0][lib]["losses"], ranks[0]["minispeed"]["losses"]
        if any(abs(x - y) > 1e-5 * max(1.0, abs(y)) for x, y in zip(a, b)):
            raise SystemExit(f"losses differ: {lib} {a} vs minispeed {b}")
        per_step = [
            max(r[lib]["times"][i] for r in ranks) for i in range(len(ranks[0][lib]["times"]))
        ]
        cpu_step = [max(r[lib]["cpu"][i] for r in ranks) for i in range(len(per_step))]
        summary["rows"][lib] = {
            "cpu_ms_median": 1e3 * statistics.median(cpu_step),
            "step_ms_median": 1e3 * statistics.median(per_step),
            "step_ms_best": 1e3 * min(per_step),
            "saved_peak_MiB": [r[lib]["saved_peak"] / 2**20 for r in ranks],
            "param_MiB": [r["param_bytes_per_rank"][lib] / 2**20 for r in ranks],
            "losses": a,
        }
    load = os.getloadavg()[0]
    sp = "TP+SP" if args.sequence_parallel else "TP"
    print(f"{sp} over 2 gloo ranks, {summary['params']:,} parameters, B={args.batch}, "
          f"T={args.seq}, {args.rounds} rounds, load {load:.1f}")  # fmt: skip
    print(
        f"{'library':10} {'step ms median (best)':>22} {'CPU ms median':>14} "
        f"{'saved MiB per rank':>20} {'params MiB per rank':>20}"
    )
    for lib, row in summary["rows"].items():
        print(f"{lib:10} {row['step_ms_median']:>13.1f} ({row['step_ms_best']:.1f}) "
              f"{row['cpu_ms_median']:>14.1f} "
              f"{' / '.join(f'{v:.2f}' for v in row['saved_peak_MiB']):>20} "
              f"{' / '.join(f'{v:.1f}' for v in row['param_MiB']):>20}")  # fmt: skip
    r = summary["rows"]
    print(f"minispeed / torch median step: {r['minispeed']['step_ms_median'] / r['torch']['step_ms_median']:.2f}; "
          f"losses equal over {len(r['torch']['losses'])} steps: {r['torch']['losses'][-1]:.6f}")  # fmt: skip
    summary["load"] = load
    return summary


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sequence-parallel", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    while len(results) < len(procs):
        try:
            rank, out = queue.get(timeout=5)
            results[rank] = out
        except Exception:  # queue.Empty: is a worker dead?
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise SystemExit(
                    f"a worker failed (exit codes {[p.exitcode for p in procs]})"
                ) from None
    for p in procs:
        p.join()
    summary = report(results, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return summary


if __name__ == "__main__":
    main()
