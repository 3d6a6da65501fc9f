"""`minispeed estimate --time`: one training step of a GPT on a described cluster, per ZeRO stage.

```bash
minispeed estimate --time --params 100e9 --cluster dgx2-v100 --nodes 25 --tp 16 \
    --layers 125 --hidden 8192 --seq 1024 --batch 32 --checkpointing
```

Nothing here restates a cost; it composes the packages' own formulas:

- FLOPs: `profiler.formulas.gpt_forward` per micro-batch; backward is 2× the forward and
  activation checkpointing repeats the forward (the convention the published TFLOP/s figures
  use: recomputed FLOPs count), split evenly over the `tp` tensor-parallel ranks.
- The data-parallel step (compute at the cluster's `peak × efficiency`, the optimizer at the HBM
  rate, each stage's collectives on the data-parallel ring): `profiler.perf_model.predict_step`
  on `Cluster.machine`, its links from Note [a ring across nodes] (clusters.py).
- Tensor parallelism inside a node (Megatron's layout: QKV and the first MLP matrix column-split,
  the attention output and second MLP matrix row-split, a vocabulary-split embedding and loss):
  `tensor_parallel.costs`' collectives per block, priced on the node's link; they sit on the
  critical path (no overlap).
- ZeRO++ (`--zeropp`: qwZ int8 weights, hpZ, qgZ int4 gradients):
  `zero.stage3.zeropp_ledger.zeropp_step_bytes` by axis, priced on each axis' link, and the
  bytes that leave a node (`cross_node_bytes`, the ledger's ring model) beside plain stage 3's.
- Model states per GPU: `zero.memory.model_state_bytes` (the ZeRO paper's 2 + 2 + K bytes).

Assumed, and said in the output: fp16 parameters and gradients on the wire, DeepSpeed's 5e8
element buckets, communication not hidden behind compute unless `--overlap` says how much.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, replace

from minispeed.comm import CommRecord, costs
from minispeed.engine.cli.clusters import Cluster, Link, preset_names
from minispeed.profiler import formulas
from minispeed.profiler.perf_model import StepPrediction, predict_step
from minispeed.tensor_parallel import costs as tp_costs
from minispeed.zero.memory import hpz_secondary_bytes, model_state_bytes
from minispeed.zero.stage3.zeropp_ledger import cross_node_bytes, zeropp_step_bytes

__all__ = ["StageTime", "Workload", "add_arguments", "main", "predict_stages", "tp_collectives"]

WIRE_BYTES = 2  # fp16 parameters and gradients on the wire (the papers' mixed precision)
BUCKET_NUMEL = 500_000_000  # DeepSpeed's reduce_bucket_size / allgather_bucket_size default


@dataclass(frozen=True)
class Workload:
    """The model and the batch of one optimizer step (units in the names)."""

    num_params: int
    layers: int
    hidden: int
    vocab: int
    seq: int
    batch: int
    """Sequences per model replica (data-parallel rank) per optimizer step."""
    micro_batch: int
    """Sequences per micro-step; `batch / micro_batch` micro-steps accumulate."""
    tp: int = 1
    checkpointing: bool = False
    heads: int = 1
    """Attention heads: they split the attention's work without changing its FLOPs."""

    def __post_init__(self) -> None:
        for name in ("num_params", "layers", "hidden", "heads", "vocab", "seq", "batch",
                     "micro_batch", "tp"):  # fmt: skip
            value = getattr(self, name)
            if int(value) != value or value < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {value}")
        if self.batch % self.micro_batch:
            raise ValueError(
                f"the batch ({self.batch}) must be a multiple of the micro-batch "
                f"({self.micro_batch})"
            )
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")

    @property
    def micro_steps(self) -> int:
        """Micro-steps per optimizer step (gradient accumulation)."""
        return self.batch // self.micro_batch

    def step_flops(self) -> float:
        """FLOPs of one optimizer step of one replica: forward × (1 + checkpointing) + backward
        (2× forward) over every micro-step (`formulas.gpt_forward`)."""
        fwd = formulas.gpt_forward(
            batch=self.micro_batch, seq=self.seq, n_layer=self.layers, n_embd=self.hidden,
            n_head=self.heads, vocab=self.vocab,
        ).flops  # fmt: skip
        return self.micro_steps * fwd * (3 + int(self.checkpointing))


def tp_collectives(w: Workload) -> list[tp_costs.Collective]:
    """One micro-step's tensor-parallel collectives (Megatron's layout, module docstring), with
    the forward ones repeated under activation checkpointing; fp16 activations, fp32 loss terms."""
    m, h, n, e = w.micro_batch * w.seq, w.hidden, w.tp, WIRE_BYTES
    block = [
        *tp_costs.column_collectives(m, h, 3 * h, n, e),  # QKV
        *tp_costs.row_collectives(m, h, h, n, e),  # attention output
        *tp_costs.column_collectives(m, h, 4 * h, n, e),  # MLP up
        *tp_costs.row_collectives(m, 4 * h, h, n, e),  # MLP down
    ]
    calls = block * w.layers
    calls += tp_costs.embedding_collectives(m, h, n, e) + tp_costs.cross_entropy_collectives(m, n)
    forward = [c for c in calls if c.phase == "forward"]
    return calls + forward * int(w.checkpointing)


@dataclass(frozen=True)
class StageTime:
    """One row of `--time`: a stage's predicted step on the cluster."""

    label: str
    stage: int
    state_bytes_per_gpu: int
    """Model states per GPU (ZeRO paper's formula; with hpZ's secondary partition for ZeRO++)."""
    prediction: StepPrediction
    """The data-parallel step (`profiler.predict_step`); its `comm_s` is the data-parallel ring's."""
    tp_comm_s: float
    flops_per_gpu: float
    cross_node_bytes_per_node: float | None
    """Bytes one node sends to other nodes per optimizer step (stage 3 and ZeRO++ rows)."""

    @property
    def step_s(self) -> float:
        """The profiler's step plus the tensor-parallel collectives (not overlapped)."""
        return self.prediction.step_s + self.tp_comm_s

    @property
    def compute_s(self) -> float:
        """Arithmetic at peak × efficiency, plus the optimizer step."""
        return self.prediction.compute_s + self.prediction.optimizer_s

    @property
    def comm_exposed_s(self) -> float:
        """Communication the step waits for: data-parallel (1 - overlap) plus tensor-parallel."""
        return (1 - self.prediction.overlap) * self.prediction.comm_s + self.tp_comm_s

    @property
    def comm_share(self) -> float:
        """Exposed communication over the step."""
        return self.comm_exposed_s / self.step_s

    @property
    def tflops_per_gpu(self) -> float:
        """FLOPs per GPU over the predicted step, TFLOP/s (recomputed FLOPs counted)."""
        return self.flops_per_gpu / self.step_s / 1e12


def _layout(cluster: Cluster, nodes: int, tp: int) -> tuple[int, int]:
    """(data-parallel ranks, of them per node) for `nodes` nodes and `tp`-way TP in a node."""
    g = cluster.gpus_per_node
    if tp > g or g % tp:
        raise ValueError(
            f"--tp {tp} must divide the {g} GPUs of a node (tensor parallelism stays in a node)"
        )
    return nodes * g // tp, g // tp


def _zeropp_comm(
    cluster: Cluster, w: Workload, nodes: int, dp: int, per_node: int, zeropp: bool
) -> tuple[float, float]:
    """(seconds, bytes leaving one node) of stage 3's collectives per optimizer step from the
    ZeRO++ ledger, with its three techniques on (`zeropp`) or off (plain stage 3)."""
    psi = w.num_params // w.tp
    step = zeropp_step_bytes(
        [psi], dp, per_node, persistence_threshold_numel=0, param_bytes=WIRE_BYTES,
        grad_bytes=WIRE_BYTES, bucket_columns=[-(-psi // dp)], quantized_weights=zeropp,
        hpz=zeropp, quantized_gradients=zeropp, gradient_bits=4,
    ).total()  # fmt: skip
    groups = {
        "world": [tuple(range(dp))],
        "intra": [tuple(range(n * per_node, (n + 1) * per_node)) for n in range(nodes)],
        "inter": [tuple(range(j, dp, per_node)) for j in range(per_node)],
    }
    links = {
        "world": cluster.link(dp, per_node),
        "intra": cluster.link(per_node, per_node),
    }
    if nodes > 1:
        links["inter"] = cluster.link(nodes, 1)
    seconds = crossed = 0.0
    for (op, axis), msg in step.items():
        link: Link = links[axis]
        seconds += link.time_s(op, msg)
        for ranks in groups[axis]:
            record = CommRecord(
                op=op, numel=msg, dtype="torch.uint8", msg_bytes=msg, group_size=len(ranks),
                latency_s=0.0, algbw=0.0, busbw=0.0,
                wire_bytes=costs.wire_bytes(op, msg, len(ranks)), ranks=ranks,
            )  # fmt: skip
            # node 0's ranks: the layout is node-major, so every node sends the same
            crossed += sum(cross_node_bytes(record, r, per_node) for r in ranks if r < per_node)
    return w.micro_steps * seconds, w.micro_steps * crossed


def predict_stages(
    cluster: Cluster,
    w: Workload,
    nodes: int,
    *,
    stages: tuple[int, ...] = (0, 1, 2, 3),
    zeropp: bool = False,
    overlap: float = 0.0,
) -> list[StageTime]:
    """A `StageTime` per stage (and `3 + ZeRO++` with `zeropp`) for `w` on `nodes` nodes."""
    if nodes < 1 or int(nodes) != nodes:
        raise ValueError(f"--nodes must be a whole number >= 1, got {nodes}")
    dp, per_node = _layout(cluster, nodes, w.tp)
    psi = w.num_params // w.tp
    dp_link = cluster.link(dp, per_node)
    machine = cluster.machine(dp_link)
    flops = w.step_flops() / w.tp
    tp_link = cluster.link(w.tp, w.tp)
    tp_s = w.micro_steps * sum(tp_link.time_s(c.op, c.msg_bytes) for c in tp_collectives(w))

    def step(stage: int) -> StepPrediction:
        return predict_step(
            machine, flops_per_step=flops, num_params=psi, stage=stage, world_size=dp,
            grad_bytes=WIRE_BYTES, param_bytes=WIRE_BYTES, micro_steps=w.micro_steps,
            bucket_numel=BUCKET_NUMEL, overlap=overlap,
        )  # fmt: skip

    rows = []
    for stage in stages:
        pred = step(stage)
        crossed = None
        if stage == 3 and nodes > 1:
            crossed = _zeropp_comm(cluster, w, nodes, dp, per_node, zeropp=False)[1]
        state = model_state_bytes(psi, dp, stage).total
        rows.append(StageTime(f"{stage}", stage, state, pred, tp_s, flops, crossed))
    if zeropp:
        if nodes < 2:
            raise ValueError("--zeropp prices ZeRO++'s cross-node savings: give --nodes >= 2")
        base = rows[-1].prediction if rows and rows[-1].stage == 3 else step(3)
        seconds, crossed = _zeropp_comm(cluster, w, nodes, dp, per_node, zeropp=True)
        state = model_state_bytes(psi, dp, 3).total + hpz_secondary_bytes(
            [psi], dp, per_node, param_bytes=WIRE_BYTES, persistence_threshold_numel=0
        )
        pred = replace(base, comm_s=seconds)
        rows.append(StageTime("3 + ZeRO++", 3, state, pred, tp_s, flops, crossed))
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`--time`'s flags: the cluster (a preset or file, any field overridden), the model's shape
    and the batch."""
    g = p.add_argument_group("--time: one training step on a described cluster")
    g.add_argument("--time", action="store_true", help="predict step time and comm share per stage")
    g.add_argument("--cluster", help=f"a preset ({', '.join(preset_names())}) or a JSON file")
    for flag, what in (
        ("--peak-tflops", "one GPU's peak TFLOP/s"),
        ("--efficiency", "fraction of the peak the model's FLOPs reach (0-1]"),
        ("--intra-gbps", "GB/s each GPU sends inside a node"),
        ("--intra-latency-us", "µs per hop inside a node"),
        ("--inter-gbps", "GB/s one node sends to the others (all NICs)"),
        ("--inter-latency-us", "µs per hop between nodes"),
        ("--hbm-gbps", "GPU memory GB/s (prices the optimizer step)"),
    ):
        g.add_argument(flag, type=float, help=what)
    g.add_argument("--layers", type=int, help="transformer blocks")
    g.add_argument("--hidden", type=int, help="hidden size")
    g.add_argument("--vocab", type=int, default=50257, help="vocabulary (default 50257)")
    g.add_argument("--seq", type=int, default=1024, help="tokens per sequence (default 1024)")
    g.add_argument("--batch", type=int, help="sequences per model replica per optimizer step")
    g.add_argument("--micro-batch", type=int, help="sequences per micro-step (default: --batch)")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel degree inside a node")
    g.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    g.add_argument(
        "--overlap", type=float, default=0.0, help="fraction of data-parallel comm hidden (0-1)"
    )
    g.add_argument("--stages", default="0,1,2,3", help="ZeRO stages to price (default 0,1,2,3)")
    g.add_argument("--zeropp", action="store_true", help="add a ZeRO++ row (qwZ, hpZ, qgZ int4)")


def _cluster(args: argparse.Namespace) -> Cluster:
    """The cluster of `--cluster` with the flags' overrides (every field from flags without it)."""
    values = {
        "gpus_per_node": args.gpus, "peak_tflops": args.peak_tflops,
        "efficiency": args.efficiency, "intra_gbps": args.intra_gbps,
        "intra_latency_us": args.intra_latency_us, "inter_gbps": args.inter_gbps,
        "inter_latency_us": args.inter_latency_us, "hbm_gbps": args.hbm_gbps,
        "gpu_mem_gib": args.gpu_mem,
    }  # fmt: skip
    if args.cluster is not None:
        return Cluster.load(args.cluster).with_values(**values)
    missing = [k for k, v in values.items() if v is None and k not in ("hbm_gbps", "gpu_mem_gib")]
    if missing:
        flags = ", ".join("--gpus" if k == "gpus_per_node" else "--" + k.replace("_", "-")
                          for k in missing)  # fmt: skip
        raise ValueError(
            f"--time needs a cluster: --cluster {' | '.join(preset_names())} | file.json, or "
            f"every field as flags (missing {flags})"
        )
    return Cluster(name="flags", **values)


def main(args: argparse.Namespace, num_params: int) -> int:
    """Print the `--time` table (or JSON); exit code 0 (2 on bad input, via UsageError)."""
    from minispeed.engine.cli.launcher import UsageError

    try:
        if args.layers is None or args.hidden is None or args.batch is None:
            raise ValueError(
                "--time needs the model's shape and batch: --layers, --hidden, --batch"
            )
        if not 0.0 <= args.overlap <= 1.0:
            raise ValueError(f"--overlap is a fraction in [0, 1], got {args.overlap}")
        stages = tuple(int(s) for s in args.stages.split(","))
        if not stages or any(s not in (0, 1, 2, 3) for s in stages):
            raise ValueError(f"--stages takes ZeRO stages 0-3, got {args.stages!r}")
        cluster = _cluster(args)
        w = Workload(
            num_params=num_params, layers=args.layers, hidden=args.hidden, vocab=args.vocab,
            seq=args.seq, batch=args.batch,
            micro_batch=args.batch if args.micro_batch is None else args.micro_batch,
            tp=args.tp, checkpointing=args.checkpointing,
        )  # fmt: skip
        rows = predict_stages(
            cluster, w, args.nodes, stages=stages, zeropp=args.zeropp, overlap=args.overlap
        )
    except ValueError as e:
        raise UsageError(str(e)) from None
    gpu_cap = None if cluster.gpu_mem_gib is None else cluster.gpu_mem_gib * 2**30
    if args.json:
        print(json.dumps({"cluster": {"name": cluster.name, **cluster.to_json()},
                          "nodes": args.nodes, "workload": asdict(w),
                          "rows": [_row_json(r, gpu_cap) for r in rows]}, indent=1))  # fmt: skip
        return 0
    _print(cluster, w, args, rows, gpu_cap)
    return 0


def _row_json(r: StageTime, gpu_cap: float | None) -> dict:
    return {
        "stage": r.label, "state_bytes_per_gpu": r.state_bytes_per_gpu,
        "fits": None if gpu_cap is None else r.state_bytes_per_gpu <= gpu_cap,
        "compute_s": r.compute_s, "dp_comm_s": r.prediction.comm_s, "tp_comm_s": r.tp_comm_s,
        "step_s": r.step_s, "comm_share": r.comm_share, "tflops_per_gpu": r.tflops_per_gpu,
        "cross_node_bytes_per_node": r.cross_node_bytes_per_node,
    }  # fmt: skip


def _print(
    cluster: Cluster, w: Workload, args: argparse.Namespace, rows: list[StageTime], gpu_cap
) -> None:
    from rich.console import Console
    from rich.table import Table

    dp = args.nodes * cluster.gpus_per_node // w.tp
    table = Table(
        title=(
            f"{cluster.name}: {args.nodes} node(s) x {cluster.gpus_per_node} GPUs, "
            f"{cluster.peak_tflops:g} TFLOP/s x {cluster.efficiency:g}, NVLink "
            f"{cluster.intra_gbps:g} GB/s, inter-node {cluster.inter_gbps:g} GB/s per node; "
            f"Ψ = {w.num_params:,}, TP {w.tp} x DP {dp}, {w.batch} x {w.seq} tokens per replica"
            f" in {w.micro_steps} micro-step(s)" + (", checkpointing" if w.checkpointing else "")
        ),
        caption=(
            f"model states: the ZeRO paper's (2+2+K)Ψ; comm share: exposed communication over "
            f"the step (overlap {args.overlap:g}); TFLOP/s per GPU counts recomputed FLOPs"
        ),
    )
    for col in ("stage", "states/GPU", "fits", "compute s", "DP comm s", "TP comm s", "step s",
                "comm share", "TFLOP/s/GPU", "cross-node GB/node"):  # fmt: skip
        table.add_column(col, justify="left" if col == "stage" else "right")
    for r in rows:
        fits = None if gpu_cap is None else r.state_bytes_per_gpu <= gpu_cap
        table.add_row(
            r.label, f"{r.state_bytes_per_gpu / 1e9:,.1f} GB",
            "-" if fits is None else ("[green]yes[/]" if fits else "[red]no[/]"),
            f"{r.compute_s:,.2f}", f"{r.prediction.comm_s:,.2f}", f"{r.tp_comm_s:,.2f}",
            f"{r.step_s:,.2f}", f"{r.comm_share:.0%}", f"{r.tflops_per_gpu:,.1f}",
            "-" if r.cross_node_bytes_per_node is None
            else f"{r.cross_node_bytes_per_node / 1e9:,.1f}",
        )  # fmt: skip
    Console(width=max(Console().width, 150)).print(table)
