"""qgZ: a gradient reduce-scatter in int8 (or int4) through two all-to-all hops, inside each node
and then across nodes; the naive one-hop version is comm's `quantized_reduce_scatter_tensor`.

N = M nodes × k ranks per node, node-major (rank ``a·k + j`` is local rank j of node a). The input
is the stage-3 gradient bucket, ``(N, c)``: row r is the part rank r must receive, summed over all
ranks. Every row is zero-padded to ``P = B·ceil(c/B)`` columns, so no quantization block spans two
rows. Q(·) quantizes per block of B elements (one fp32 scale each, comm's `BlockQuantizer`), D(·)
dequantizes; ``g_{r→t}`` is rank r's row for rank t.

```text
hop 1, inside node a (group: its k ranks; one all-to-all):
    I (local j') send to local rank j the M rows destined for ranks {b·k + j : b = 0..M-1},
    quantized: Q(g_{a·k+j' → b·k+j}) for every b;
    I (local j) receive k such messages and reduce in fp32:
        h_b = Σ_{j'=0..k-1} D(Q(g_{a·k+j' → b·k+j}))          (M rows: node a's partial sums)
hop 2, across nodes (group: the M ranks with my local index j; one all-to-all):
    I send row h_b, re-quantized, to node b's rank b·k + j: Q(h_b);
    I (rank a·k + j) receive M messages and reduce in fp32:
        out = Σ_{b=0..M-1} D(Q(h^{(b)}_a))                      (h^{(b)}: node b's partials)
```

So ``out = Σ_r g_{r→me}`` up to two roundings: per element,
``|out - exact| <= Σ_{r} max|block of g_r| / (2 qmax) + Σ_b max|block of h^{(b)}| / (2 qmax)``
(qmax = 127 for int8, 7 for int4; comm/compression/quantize.py derives the per-block bound). The
sum is not divided here: the caller averages (grads.py divides by N). NaN or inf anywhere in a
block makes the whole block NaN on arrival (comm's quantizer), so fp16 overflow detection still
sees it. No error feedback: each step's gradient error is fresh and zero-mean-ish, as in
DeepSpeed's qgZ.

Bytes (message = input bytes, logger convention; ``q(n) = n·bits/8 + 4n/B``):
hop 1: ``q(N·P)`` on the k-rank intra-node group, of which each rank sends ``(k-1)/k``;
hop 2: ``q(M·P)`` on the M-rank inter-node group, of which each rank sends ``(M-1)/M``.
Only hop 2 crosses nodes: ``N·(M-1)·q(P)`` bytes summed over ranks, against ``M·(N-1)·c·g`` for a
flat ring reduce-scatter (the M ring links that leave a node each carry one rank's ``(N-1)·c·g``;
`zeropp_ledger.cross_node_bytes`). With k = 1 hop 1 is skipped; with M = 1 hop 2 is.
"""

from __future__ import annotations

from typing import Any

import torch

import minispeed.comm as comm
from minispeed.comm.compression import BlockQuantizer, ScaledCodes

__all__ = ["hierarchical_quantized_reduce_scatter"]


def _exchange(rows: torch.Tensor, quantizer: BlockQuantizer, group: Any) -> torch.Tensor:
    """Quantize ``rows`` (n, m) fp32, send row i to rank i of ``group`` (one all-to-all), return
    the dequantized ``(n, m)`` received: row i from rank i. ``m`` is a multiple of the block."""
    n, m = rows.shape
    to_ranks = quantizer.compress(rows.reshape(-1)).to_rows(n)  # (n, q(m)) uint8
    from_ranks = torch.empty_like(to_ranks)
    comm.all_to_all_single(from_ranks, to_ranks, group=group)
    received = ScaledCodes.from_rows(from_ranks, m, quantizer.bits, quantizer.block_numel)
    return quantizer.decompress(received).view(n, m)


def hierarchical_quantized_reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    quantizer: BlockQuantizer,
    intra_group: Any,
    inter_group: Any,
    node_size: int,
) -> torch.Tensor:
    """Sum ``input`` (N·c elements, row r for rank r) over all ranks; my row lands in ``output``
    (c elements; it may be a view of ``input``). Two quantized all-to-alls, see the module
    docstring. Synchronous. Returns ``output``."""
    world = comm.get_world_size()
    k, c = node_size, output.numel()
    m = world // k  # nodes
    padded = quantizer.padded_numel(c)
    rows = torch.zeros(world, padded, dtype=torch.float32, device=input.device)
    rows[:, :c] = input.detach().reshape(world, c)  # a copy: output may alias input
    if k > 1:
        # (M, k, P) [node b, local j] -> (k, M, P): block j' = the rows for local index j'
        by_local = rows.view(m, k, padded).transpose(0, 1).reshape(k, m * padded)
        partial = _exchange(by_local, quantizer, intra_group).view(k, m, padded).sum(dim=0)
    else:
        partial = rows  # (M, P): one rank per node, nothing to reduce inside it
    # (P,): across nodes, or my node's partial sum when there is one node
    total = _exchange(partial, quantizer, inter_group).sum(dim=0) if m > 1 else partial[0]
    output.copy_(total[:c].view(output.shape))
    return output
