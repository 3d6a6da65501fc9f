"""Pipeline schedules: minispeed.pipeline against torch.distributed.pipelining, same model, same split.

```bash
.venv/bin/python benchmarks/pipeline_vs_torch.py                        # small: d=128, 4 blocks
.venv/bin/python benchmarks/pipeline_vs_torch.py --width 512 --layers 8 --vocab 8192   # 33.6M params
```

One run, P processes (gloo, CPU). The model is a list of layer specs (embedding, `--layers`
pre-norm transformer blocks, linear head), cut by `pipeline.partition(method="type:Block")`; the
torch contender wraps the SAME chunks (built from the same seeds) in `PipelineStage`s, so both
run identical weights split identically. For each schedule both libraries have (GPipe, 1F1B,
Interleaved1F1B with V = 2) it reports, per library: median step time (max over ranks),
measured bubble, peak bytes of saved activations per stage, and the losses of every step
(they must agree).

Definitions, the same for both: bubble = 1 − Σ_stages busy / (P · step time), busy = seconds in
forward and backward compute of the stage (ours: the executor's timeline; torch's: forward hooks
on the chunk and two autograd marks around its backward). Activation bytes = bytes of tensors
saved for backward and still alive (parameters excluded), counted through
`torch.autograd.graph.saved_tensors_hooks`, peak over the step.

Benchmarks may use torch.distributed directly for the torch baseline; minispeed's contender goes
through minispeed.comm.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SHARED = ("gpipe", "1f1b", "interleaved_1f1b")
TORCH_NAMES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
}


class Block(nn.Module):
    """Pre-norm transformer block (no mask: a benchmark, not a language model). (B,T,C)->(B,T,C)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


def layers(args: argparse.Namespace) -> list:
    from minispeed.pipeline import LayerSpec

    return [
        LayerSpec(nn.Embedding, (args.vocab, args.width)),
        *[LayerSpec(Block, (args.width, args.heads)) for _ in range(args.layers)],
        LayerSpec(nn.Linear, (args.width, args.vocab)),
    ]


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


class SavedBytes:
    """Peak bytes of live tensors saved for backward (parameters excluded)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.skip = {p.data_ptr() for p in params}
        self.live: dict[int, list[int]] = {}
        self.now = self.peak = 0

    def _release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[ptr]

    def pack(self, t: torch.Tensor) -> Any:
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.skip or t.device.type == "meta":
            return t
        entry = self.live.setdefault(ptr, [t.untyped_storage().nbytes(), 0])
        if entry[1] == 0:
            self.now += entry[0]
            self.peak = max(self.peak, self.now)
        entry[1] += 1
        return _Held(t.detach(), self, ptr)  # detached: holding t itself would make a cycle
        # (t -> its grad_fn -> this object -> t) that a retained graph never breaks

    @staticmethod
    def unpack(h: Any) -> torch.Tensor:
        return h.t if isinstance(h, _Held) else h

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Held:
    def __init__(self, t: torch.Tensor, owner: SavedBytes, ptr: int) -> None:
        self.t, self.owner, self.ptr = t, owner, ptr

    def __del__(self) -> None:
        self.owner._release(self.ptr)


class _Mark(torch.autograd.Function):
    """Identity whose backward records the time: marks the start and end of a chunk's backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, box: list, key: str) -> torch.Tensor:
        ctx.box, ctx.key = box, key
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        ctx.box.append((ctx.key, time.perf_counter()))
        return g, None, None


class TorchChunk(nn.Module):
    """One of our chunks as a torch PipelineStage submodule, with compute timing."""

    def __init__(self, module: Any, chunk: int, clock: list) -> None:
        super().__init__()
        # register only this chunk's layers: torch scales the gradients of a stage's own
        # parameters by 1/M, and a chunk that registered the whole rank would scale them twice
        self.layers = module.chunks[chunk]
        self._module, self.chunk, self.clock = [module], chunk, clock

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        it = iter(self._module[0].chunk_layers(self.chunk))
        if x.is_floating_point():
            x = _Mark.apply(x, self.clock, "bend")
        else:
            first, _ = next(it)
            x = _Mark.apply(first(x), self.clock, "bend")
        for layer, _ in it:
            x = layer(x)
        out = _Mark.apply(x, self.clock, "bstart")
        self.clock.append(("fwd", time.perf_counter() - t0))
        return out


def _busy_from_marks(clock: list) -> float:
    busy = sum(v for k, v in clock if k == "fwd")
    starts = [v for k, v in clock if k == "bstart"]
    ends = [v for k, v in clock if k == "bend"]
    return busy + sum(e - s for s, e in zip(starts, ends))


class Ours:
    """minispeed's contender: `step(x, y)` returns (loss, busy seconds)."""

    def __init__(self, args: argparse.Namespace, name: str, v: int) -> None:
        import minispeed.pipeline as pp

        module = pp.partition(layers(args), stages=args.stages, loss_fn=lm_loss,
                              method="type:Block", virtual_stages=v)  # fmt: skip
        self.ex = pp.PipelineExecutor(module, torch.optim.SGD(module.parameters(), lr=args.lr),
                                      micro_batches=args.micro_batches, schedule=name)  # fmt: skip
        self.saved = SavedBytes(list(module.parameters()))

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        with self.saved.hooks():
            loss = self.ex.train_batch(x, y)
        return loss, self.ex.timeline.busy_s()


class Theirs:
    """torch.distributed.pipelining on the same chunks: `step(x, y)` returns (loss, busy s)."""

    def __init__(self, args: argparse.Namespace, name: str, v: int) -> None:
        from torch.distributed import pipelining

        import minispeed.pipeline as pp

        module = pp.partition(layers(args), stages=args.stages, loss_fn=lm_loss,
                              method="type:Block", virtual_stages=v)  # fmt: skip
        self.p, self.s = args.stages, module.stage
        self.clock: list = []
        stages = [
            pipelining.PipelineStage(
                TorchChunk(module, c, self.clock),
                c * self.p + self.s,
                self.p * v,
                torch.device("cpu"),
            )
            for c in range(v)
        ]
        cls = getattr(pipelining, TORCH_NAMES[name])
        self.sched = cls(stages if v > 1 else stages[0], args.micro_batches, loss_fn=lm_loss)
        self.opt = torch.optim.SGD(module.parameters(), lr=args.lr)
        self.saved = SavedBytes(list(module.parameters()))

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        import torch.distributed as dist

        self.clock.clear()
        mb_losses: list = []
        first, last = self.s == 0, self.s == self.p - 1
        with self.saved.hooks():
            if first and last:
                self.sched.step(x, target=y, losses=mb_losses)
            elif first:
                self.sched.step(x)
            elif last:
                self.sched.step(target=y, losses=mb_losses)
            else:
                self.sched.step()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        loss = torch.tensor([float(torch.stack(mb_losses).detach().mean()) if mb_losses else 0.0])
        dist.broadcast(loss, src=self.p - 1)  # as ours: the loss on every rank
        return float(loss), _busy_from_marks(self.clock)


def run_pair(args: argparse.Namespace, name: str, v: int, batches: list) -> dict:
    """Both contenders, steps alternated (ours, theirs, ours, ...) so load spikes hit both."""
    import minispeed.comm as comm

    contenders = {"minispeed": Ours(args, name, v), "torch": Theirs(args, name, v)}
    out = {lib: {"times": [], "busy": [], "losses": []} for lib in contenders}
    for i, (x, y) in enumerate(batches):
        for lib, c in contenders.items():
            comm.barrier()
            t0 = time.perf_counter()
            loss, busy = c.step(x, y)
            dt = time.perf_counter() - t0
            out[lib]["losses"].append(loss)
            if i >= args.warmup:
                out[lib]["times"].append(dt)
                out[lib]["busy"].append(busy)
    for lib, c in contenders.items():
        out[lib]["saved_peak"] = c.saved.peak
    return out


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    os.environ.setdefault("MINISPEED_ACCELERATOR", "cpu")
    torch.set_num_threads(args.threads)
    import minispeed.comm as comm

    comm.init_distributed(backend="gloo")
    g = torch.Generator().manual_seed(args.seed)
    batches = []
    for _ in range(args.warmup + args.steps):
        tok = torch.randint(
            0, args.vocab, (args.micro_batches * args.mb_size, args.seq + 1), generator=g
        )
        batches.append((tok[:, :-1], tok[:, 1:]))
    out: dict[str, Any] = {}
    for name in args.schedules:
        v = 2 if name == "interleaved_1f1b" else 1
        for lib, res in run_pair(args, name, v, batches).items():
            out[f"{name}/{lib}"] = res
    queue.put((rank, out))
    comm.barrier()
    comm.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def report(results: dict[int, dict], args: argparse.Namespace) -> dict[str, Any]:
    from rich.console import Console
    from rich.table import Table

    import minispeed.pipeline as pp

    p = args.stages
    summary: dict[str, Any] = {"args": vars(args), "rows": []}
    table = Table(
        title=f"P={p}, M={args.micro_batches}, {args.params:,} parameters (loaded 2-core CPU)"
    )
    for col in ("schedule", "library", "step ms median (min)", "ours/torch median (min)", "bubble", "theory",
                "act MiB per stage", "losses equal"):  # fmt: skip
        table.add_column(col, justify="right")
    for name in args.schedules:
        v = 2 if name == "interleaved_1f1b" else 1
        theory = pp.bubble_fraction(p, args.micro_batches, v)
        step = {}
        for lib in ("minispeed", "torch"):
            runs = [results[r][f"{name}/{lib}"] for r in range(p)]
            per_step = [max(r["times"][i] for r in runs) for i in range(args.steps)]
            step[lib] = statistics.median(per_step)
            step[lib + "/min"] = min(per_step)
            bubbles = [
                1 - sum(r["busy"][i] for r in runs) / (p * per_step[i]) for i in range(args.steps)
            ]
            row = {
                "schedule": name, "library": lib, "step_s": step[lib], "min_step_s": step[lib + "/min"],
                "bubble": statistics.median(bubbles), "theory": theory,
                "saved_peak_bytes": [r["saved_peak"] for r in runs], "losses": runs[-1]["losses"],
            }  # fmt: skip
            summary["rows"].append(row)
        ours, theirs = summary["rows"][-2], summary["rows"][-1]
        equal = all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(ours["losses"], theirs["losses"]))
        for row in (ours, theirs):
            row["losses_equal"] = equal
            table.add_row(
                name, row["library"], f"{row['step_s'] * 1e3:.0f} ({row['min_step_s'] * 1e3:.0f})",
                f"{step['minispeed'] / step['torch']:.2f} "
                f"({step['minispeed/min'] / step['torch/min']:.2f})" if row is ours else "",
                f"{row['bubble']:.1%}", f"{theory:.1%}",
                " / ".join(f"{b / 2**20:.1f}" for b in row["saved_peak_bytes"]), str(equal),
            )  # fmt: skip
    Console(width=160).print(table)
    return summary


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--mb-size", type=int, default=2, help="sequences per micro-batch")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--schedules", nargs="*", default=list(SHARED), choices=SHARED)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import minispeed.pipeline as pp

    args.params = sum(p.numel() for p in pp.build_unsplit(layers(args)).parameters())
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, args.stages, port, args, queue))
        for r in range(args.stages)
    ]
    for proc in procs:
        proc.start()
    results = dict(queue.get() for _ in procs)
    for proc in procs:
        proc.join()
    summary = report(results, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return summary


if __name__ == "__main__":
    main()
