"""A described GPU cluster, and what a collective costs on it: `minispeed estimate --time` prices
a training step on a machine it cannot run on (docs/cli/estimate.md).

A `Cluster` is a node type: its GPUs' peak rate and the fraction of it a model's arithmetic
reaches (`efficiency`, a stated input, never fitted to the result it predicts), the GPUs per
node, the bandwidth and latency inside a node (NVLink / NVSwitch) and between nodes (the node's
InfiniBand NICs together), and the memories (GPU, CPU, NVMe) the estimator's `fits` reads.
Named presets live in `clusters.json` beside this file (`dgx2-v100`, `dgx-a100`, values from the
vendors' data sheets and the papers, docs/cli/estimate.md); `Cluster.load` takes a preset name or
a JSON file of one cluster with the same keys; flags override single fields.

Note [a ring across nodes]
A ring collective over a group of n ranks, r of them on each node, sends `wire_bytes` per rank
to its successor (`minispeed.comm.costs`). Inside one node every hop is an NVLink hop: bus
bandwidth `intra`. Across nodes a ring leaves each node once, so the node's NICs carry one
rank's `wire_bytes` per group (split over the NICs by the library's parallel rings); when c
groups of the same kind run at once on a node (every GPU of a node is in one data-parallel group,
so c = GPUs per node / r), they share the NICs:

    busbw = intra                       one node
    busbw = min(intra, inter / c)       across nodes; hop latency = the inter-node latency
    t     = ring_steps(op, n) · latency + wire_bytes(op, S, n) / busbw

So a data-parallel ring spanning whole nodes (c = 1) runs at the node's NIC rate, and sixteen
data-parallel groups of one rank per node (tensor parallelism 16 inside the node) each get a
sixteenth of it. This is the bandwidth-optimal bound with no congestion or protocol overhead:
give `inter_gbps` as the rate the NICs sustain (e.g. nccl-tests' bus bandwidth) for a measured
cluster. Cost: arithmetic only.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path

from minispeed.comm import costs
from minispeed.profiler.perf_model import LinkCost, Machine

__all__ = ["PRESETS_FILE", "Cluster", "Link", "preset_names"]

PRESETS_FILE = Path(__file__).with_name("clusters.json")


@dataclass(frozen=True)
class Link:
    """One group's collectives on a cluster (Note [a ring across nodes])."""

    ranks: int
    hop_latency_s: float
    busbw_bytes_per_s: float

    def time_s(self, op: str, msg_bytes: float) -> float:
        """Seconds of one `op` call with message `msg_bytes` (comm.costs' convention)."""
        return costs.ring_time_s(
            op, int(msg_bytes), self.ranks, self.hop_latency_s, 1.0 / self.busbw_bytes_per_s
        )

    def profiler_links(self) -> dict[str, LinkCost]:
        """The same link as the profiler's per-call cost of each collective it prices."""
        return {
            op: LinkCost(costs.ring_steps(op, self.ranks) * self.hop_latency_s,
                         self.busbw_bytes_per_s)
            for op in ("all_reduce", "all_gather", "reduce_scatter")
        }  # fmt: skip


@dataclass(frozen=True)
class Cluster:
    """A node type and its network (module docstring); units in the field names."""

    name: str
    gpus_per_node: int
    """GPUs in one node."""
    peak_tflops: float
    """One GPU's peak rate for the training's matrix products (e.g. fp16 tensor cores)."""
    efficiency: float
    """Fraction of the peak a model's FLOPs run at, communication aside (stated, with its source)."""
    intra_gbps: float
    """GB/s (1e9 bytes) each GPU sends inside a node (NVLink / NVSwitch, one direction)."""
    intra_latency_us: float
    """Latency of one hop inside a node, µs."""
    inter_gbps: float
    """GB/s one node sends to other nodes, all its NICs together (one direction)."""
    inter_latency_us: float
    """Latency of one hop between nodes, µs."""
    gpu_mem_gib: float | None = None
    """GiB per GPU (the `fits` column)."""
    hbm_gbps: float | None = None
    """GPU memory bandwidth, GB/s: prices the optimizer step (profiler's memory-rate term)."""
    cpu_mem_gib: float | None = None
    """CPU memory per node, GiB."""
    nvme_gb: float | None = None
    """NVMe per node, GB (1e9 bytes, as drives are sold)."""
    description: str = ""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("name", "description") or value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"cluster {self.name!r}: {f.name} must be a number, got {value!r}")
            low_ok = f.name.endswith("latency_us") and value == 0
            if not math.isfinite(value) or (value <= 0 and not low_ok):
                floor = ">= 0" if f.name.endswith("latency_us") else "> 0"
                raise ValueError(
                    f"cluster {self.name!r}: {f.name} must be a finite number {floor}, got {value}"
                )
        if self.efficiency > 1:
            raise ValueError(
                f"cluster {self.name!r}: efficiency is a fraction of the peak in (0, 1], got "
                f"{self.efficiency} (0.30 for 30%)"
            )
        if int(self.gpus_per_node) != self.gpus_per_node:
            raise ValueError(
                f"cluster {self.name!r}: gpus_per_node must be a whole number, got "
                f"{self.gpus_per_node}"
            )

    @property
    def flops_per_s(self) -> float:
        """The rate the model's FLOPs run at: peak × efficiency."""
        return self.peak_tflops * 1e12 * self.efficiency

    def link(self, ranks: int, ranks_per_node: int) -> Link:
        """A group of `ranks` ranks, `ranks_per_node` of them on each node (all on one node when
        `ranks == ranks_per_node`), with every GPU of a node in one such group at once (Note [a
        ring across nodes])."""
        if not 1 <= ranks_per_node <= min(ranks, self.gpus_per_node):
            raise ValueError(
                f"a group of {ranks} ranks cannot have {ranks_per_node} on each "
                f"{self.gpus_per_node}-GPU node"
            )
        intra = self.intra_gbps * 1e9
        if ranks == ranks_per_node:
            return Link(ranks, self.intra_latency_us * 1e-6, intra)
        concurrent = self.gpus_per_node // ranks_per_node
        busbw = min(intra, self.inter_gbps * 1e9 / concurrent)
        return Link(ranks, self.inter_latency_us * 1e-6, busbw)

    def machine(self, dp_link: Link) -> Machine:
        """The profiler's `Machine` for one GPU of this cluster in a data-parallel group on
        `dp_link`: every FLOP at `flops_per_s`, the optimizer at the HBM rate."""
        return Machine(
            matmul_flops_per_s={1: self.flops_per_s},
            links=dp_link.profiler_links(),
            world_size=dp_link.ranks,
            stream_bytes_per_s=None if self.hbm_gbps is None else self.hbm_gbps * 1e9,
        )

    def with_values(self, **values: float | None) -> Cluster:
        """A copy with the given fields replaced (None: keep), validated again."""
        return replace(self, **{k: v for k, v in values.items() if v is not None})

    def to_json(self) -> dict:
        """Plain data, the keys of `clusters.json`."""
        return {k: v for k, v in asdict(self).items() if k != "name"}

    @classmethod
    def from_json(cls, name: str, data: dict) -> Cluster:
        """A cluster from `clusters.json`'s keys; unknown or missing keys are errors."""
        known = {f.name for f in fields(cls)} - {"name"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"cluster {name!r}: unknown keys {unknown}; known: {sorted(known)}")
        required = {f.name for f in fields(cls) if f.default is MISSING} - {"name"}
        missing = sorted(required - set(data))
        if missing:
            raise ValueError(f"cluster {name!r}: missing keys {missing}")
        return cls(name=name, **data)

    @classmethod
    def load(cls, name_or_path: str) -> Cluster:
        """A preset by name (`preset_names()`), or a JSON file holding one cluster's keys."""
        presets = json.loads(PRESETS_FILE.read_text())
        if name_or_path in presets:
            return cls.from_json(name_or_path, presets[name_or_path])
        path = Path(name_or_path)
        if not path.is_file():
            raise ValueError(
                f"--cluster {name_or_path!r} is neither a preset ({', '.join(presets)}) nor a "
                "JSON file; give one of the presets or a file with the keys of "
                f"{PRESETS_FILE.name}"
            )
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"--cluster {name_or_path!r} is not JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"--cluster {name_or_path!r} must hold one JSON object")
        return cls.from_json(path.stem, data)


def preset_names() -> list[str]:
    """The named clusters of `clusters.json`."""
    return list(json.loads(PRESETS_FILE.read_text()))
