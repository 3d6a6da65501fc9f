"""DeepSpeed-Ulysses sequence parallelism: attention over a sequence split across P ranks by
trading the sequence split for a head split, with all-to-alls.

Outside attention every rank of the sequence-parallel group holds T/P tokens of every sequence
and all H heads (the layers around attention are per token, so they need nothing else).
Attention needs the whole sequence, but its heads are independent: one all-to-all per tensor
turns `(T/P tokens, H heads)` into `(T tokens, H/P heads)`, local attention runs on the whole
sequence for its H/P heads, and one all-to-all turns the output back.

```
q, k, v  (B, T/P, H, D) ──all-to-all: scatter heads, gather sequence──▶ (B, T, H/P, D)
                         local attention (any: softmax, flash, causal mask on the full T)
out      (B, T/P, H, D) ◀──all-to-all: scatter sequence, gather heads── (B, T, H/P, D)
```

**Cost.** `seq_all_to_all` of a tensor of S = numel · itemsize bytes sends (P-1)/P · S per rank
(the 1/P it keeps does not travel) and receives as much. An attention forward makes 4 such calls
(q, k, v in, the output back), each of S = B · (T/P) · H · D · itemsize, and its backward the 4
inverse ones on the gradients: 8 · (P-1)/P · S per layer per step, a volume that does not grow
with P (unlike an all-gather of the sequence, (P-1) · S). Memory: the activations outside
attention are 1/P of the unsplit model's; attention itself holds T tokens for H/P heads.

**What is supported.** P divides the sequence length. Heads split evenly when P divides the
key/value head count; otherwise (DeepSpeed's uneven heads) the K key/value heads are dealt out
in contiguous groups, rank r taking K // P of them plus one when r < K mod P, and every query
head goes with its key/value group (`head_shares`). Fewer key/value heads than ranks is refused,
as in DeepSpeed (a rank would hold no head). DeepSpeed's communication overlap on a side stream
is not implemented (`DistributedAttention` runs it on the current stream).

Every exchange is `minispeed.comm.all_to_all_autograd`, so the comms logger counts it. See
`docs/architecture.md` (the grid's sequence-parallel dimension).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

import minispeed.comm as comm
from minispeed.core.logging import warn_once

__all__ = [
    "DistributedAttention",
    "head_shares",
    "seq_all_to_all",
    "seq_all_to_all_bytes",
    "uneven_seq_all_to_all",
]


def seq_all_to_all_bytes(x: torch.Tensor, world_size: int) -> int:
    """Bytes one rank sends in `seq_all_to_all(x, ...)` over `world_size` ranks:
    numel · itemsize · (P-1)/P (and as many received)."""
    return x.numel() * x.element_size() * (world_size - 1) // world_size


def seq_all_to_all(x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split `x` along `scatter_dim` into P equal chunks, send chunk j to rank j of `group`, and
    concatenate the P chunks received (rank order) along `gather_dim`. Differentiable: the
    backward is the inverse exchange (scatter `gather_dim`, gather `scatter_dim`).

    The result has `x.shape` with `scatter_dim` divided by P and `gather_dim` multiplied by P.
    Every rank of `group` must call it with the same shape (checked on the first call of the call
    site, on every call in `comm.validation_mode("all")`).

    Bytes sent per call and rank: numel · itemsize · (P-1)/P (`seq_all_to_all_bytes`); an
    attention forward makes 4 calls (q, k, v in, output back), its backward 4 more. On a group
    of one rank it returns `x` and sends nothing.
    """
    p = comm.get_world_size(group)
    nd = x.dim()
    for name, d in (("scatter_dim", scatter_dim), ("gather_dim", gather_dim)):
        if not -nd <= d < nd:
            raise ValueError(
                f"seq_all_to_all: {name}={d} is out of range for a tensor of shape "
                f"{tuple(x.shape)} ({nd} dims)"
            )
    scatter_dim, gather_dim = scatter_dim % nd, gather_dim % nd
    if x.shape[scatter_dim] % p:
        raise ValueError(
            f"seq_all_to_all: dim {scatter_dim} of shape {tuple(x.shape)} has size "
            f"{x.shape[scatter_dim]}, not divisible by the sequence-parallel size {p}; make it a "
            f"multiple of {p} (pad the sequence, or choose a head count divisible by {p})"
        )
    if p == 1:
        return x
    # (P, ...): row j is chunk j along scatter_dim, the rows rank j receives from us.
    rows = x.unflatten(scatter_dim, (p, x.shape[scatter_dim] // p)).movedim(scatter_dim, 0)
    received = comm.all_to_all_autograd(rows.contiguous(), group)  # row j: rank j's chunk for us
    # Put the source-rank axis just before gather_dim and merge the two: rank-major concatenation.
    return received.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


def head_shares(heads: int, kv_heads: int, world_size: int) -> list[int]:
    """Heads per rank when `kv_heads` key/value heads are dealt over `world_size` ranks in
    contiguous groups (DeepSpeed's uneven-head split): rank r takes `kv_heads // P` groups plus
    one when r < `kv_heads % P`, and each group carries `heads / kv_heads` heads of this tensor
    (1 for keys and values, the query heads sharing one key/value head for queries)."""
    if kv_heads < world_size:
        raise ValueError(
            f"DistributedAttention: {kv_heads} key/value heads are fewer than the "
            f"sequence-parallel size {world_size}, which would leave a rank with no head (DeepSpeed "
            f"refuses it too); use a sequence_parallel_size of at most {kv_heads}"
        )
    if heads % kv_heads:
        raise ValueError(
            f"DistributedAttention: {heads} heads are not a multiple of the {kv_heads} key/value "
            "heads; each query head must belong to one key/value group (pass num_kv_heads= the "
            "model's key/value head count)"
        )
    group = heads // kv_heads
    return [
        group * (kv_heads // world_size + (r < kv_heads % world_size)) for r in range(world_size)
    ]


def uneven_seq_all_to_all(
    x: torch.Tensor,
    group: Any,
    scatter_dim: int,
    gather_dim: int,
    send_sizes: list[int],
    recv_sizes: list[int],
) -> torch.Tensor:
    """`seq_all_to_all` with unequal chunks: split `x` along `scatter_dim` into `send_sizes`
    (chunk j to rank j) and concatenate what rank j sends, `recv_sizes[j]` long along
    `gather_dim`, in rank order. What rank j sends us has `x`'s shape with `scatter_dim` set to
    our `send_sizes` entry and `gather_dim` to `recv_sizes[j]` (every rank passes the same lists).
    Each chunk travels flattened, so one all-to-all of 1-D splits carries them. Differentiable
    (the backward swaps the splits). Bytes sent per rank: `x`'s bytes less its own chunk."""
    me = comm.get_rank(group)
    chunks = x.split(send_sizes, dim=scatter_dim)
    flat = torch.cat([c.reshape(-1) for c in chunks])
    shapes = []
    for size in recv_sizes:
        shape = list(x.shape)
        shape[scatter_dim], shape[gather_dim] = send_sizes[me], size
        shapes.append(shape)
    out_splits = [torch.Size(s).numel() for s in shapes]
    received = comm.all_to_all_autograd(flat, group, out_splits, [c.numel() for c in chunks])
    parts = [part.view(s) for part, s in zip(received.split(out_splits), shapes, strict=True)]
    return torch.cat(parts, dim=gather_dim)


class DistributedAttention(nn.Module):
    """Wrap a local attention so it runs on a sequence split across `sequence_process_group`
    (DeepSpeed's `deepspeed.sequence.layer.DistributedAttention`, same signature and meaning).

    `forward(query, key, value, batch_dim_idx, rotary_pos_emb=None, *args, **kwargs)` takes this
    rank's tokens, `(B, T/P, H, D)` when `batch_dim_idx == 0` or `(T/P, B, H, D)` when it is 1
    (Megatron's layout), all-to-alls q, k, v to the whole sequence and H/P heads, calls
    `local_attention(q, k, v, *args, **kwargs)`, and all-to-alls its output back to this rank's
    tokens and all heads. `scatter_idx` and `gather_idx` are DeepSpeed's: with 4-D tensors only
    `scatter_idx >= 2` (the default: scatter heads on the way in) or `< 2` (scatter the sequence
    on the way in, the reverse use) matters; the sequence dim is the one that is not the batch.

    `rotary_pos_emb`, when given, is Megatron-DeepSpeed's `(cos, sin)` pair of shape
    `(B', T, 1, D_rot)`; it is applied to q and k after the exchange, on the full sequence.

    Supported: P divides the sequence; heads split evenly when P divides the key/value head
    count K (`num_kv_heads`, else the key's head count, as DeepSpeed), unevenly otherwise
    (`head_shares`: whole key/value groups per rank, the first K mod P ranks one more), which is
    DeepSpeed's uneven-head split. Refused with an error: K < P, and uneven splits whose query
    heads are not a multiple of K.
    `sp_stream` is accepted and its overlap not implemented: every exchange runs on the current
    stream, with a warning. Cost: 4 `seq_all_to_all` per forward and 4 per backward, each
    (P-1)/P of one of q, k, v, out (module docstring).
    """

    def __init__(
        self,
        local_attention: nn.Module,
        sequence_process_group: Any,
        scatter_idx: int = 2,
        gather_idx: int = 0,
        sp_stream: Any = None,
        num_kv_heads: int | None = None,
    ) -> None:
        super().__init__()
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx, self.gather_idx = scatter_idx, gather_idx
        self.num_kv_heads = num_kv_heads
        self.sp_stream = sp_stream
        if sp_stream is not None:
            warn_once(
                "DistributedAttention: sp_stream is accepted but minispeed does not overlap the "
                "all-to-alls with compute; they run on the current stream (same results)"
            )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        batch_dim_idx: int,
        rotary_pos_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Attention over the whole sequence from this rank's tokens; returns this rank's
        tokens of the output, in the layout of `query`."""
        if batch_dim_idx not in (0, 1):
            raise ValueError(
                f"DistributedAttention: batch_dim_idx must be 0 ((B, T, H, D)) or 1 "
                f"((T, B, H, D)), got {batch_dim_idx}"
            )
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.dim() != 4:
                raise ValueError(
                    f"DistributedAttention: {name} has shape {tuple(t.shape)}; it must be 4-D, "
                    "(B, T, H, D) or (T, B, H, D) with heads in dim 2"
                )
        seq_dim, head_dim = 1 - batch_dim_idx, 2
        # DeepSpeed's scatter_idx: >= 2 scatters heads on the way in, < 2 the sequence.
        inward = (head_dim, seq_dim) if self.scatter_idx >= 2 else (seq_dim, head_dim)
        p = comm.get_world_size(self.spg)
        kv_heads = self.num_kv_heads if self.num_kv_heads is not None else key.shape[2]
        if inward[0] == head_dim and kv_heads % p:  # DeepSpeed's uneven heads
            exchange_in, exchange_out = self._uneven_exchanges(kv_heads, seq_dim, query)
        else:
            if inward[0] == head_dim:
                self._check_heads(query, key, value)
            scatter, gather = inward
            exchange_in = partial(
                seq_all_to_all, group=self.spg, scatter_dim=scatter, gather_dim=gather
            )
            exchange_out = partial(
                seq_all_to_all, group=self.spg, scatter_dim=gather, gather_dim=scatter
            )
        q, k, v = (exchange_in(t) for t in (query, key, value))
        if rotary_pos_emb is not None:
            cos, sin = (f.permute(1, 0, 2, 3) for f in rotary_pos_emb)
            q, k = _rotary(q, cos, sin), _rotary(k, cos, sin)
        context = self.local_attn(q, k, v, *args, **kwargs)
        return exchange_out(context)

    def _uneven_exchanges(self, kv_heads: int, seq_dim: int, query: torch.Tensor) -> tuple:
        """The two exchanges when P does not divide the K key/value heads: in, each tensor's
        `head_shares` of its heads for the whole sequence; out, this rank's T/P tokens of every
        rank's heads, rank order (DeepSpeed's uneven-head split)."""
        p, me, head_dim = comm.get_world_size(self.spg), comm.get_rank(self.spg), 2
        tokens = [query.shape[seq_dim]] * p  # T/P from each rank

        def exchange_in(t: torch.Tensor) -> torch.Tensor:
            shares = head_shares(t.shape[head_dim], kv_heads, p)
            return uneven_seq_all_to_all(t, self.spg, head_dim, seq_dim, shares, tokens)

        def exchange_out(context: torch.Tensor) -> torch.Tensor:
            # this rank holds (K // P + [me < K mod P]) key/value groups of H_out / K heads each
            per_group = context.shape[head_dim] // (kv_heads // p + (me < kv_heads % p))
            shares = head_shares(per_group * kv_heads, kv_heads, p)
            return uneven_seq_all_to_all(context, self.spg, seq_dim, head_dim, tokens, shares)

        return exchange_in, exchange_out

    def _check_heads(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """P must divide every head count when it divides the key/value heads."""
        p = comm.get_world_size(self.spg)
        heads = {"query": query.shape[2], "key": key.shape[2], "value": value.shape[2]}
        if self.num_kv_heads is not None:
            heads["num_kv_heads"] = self.num_kv_heads
        uneven = {name: h for name, h in heads.items() if h % p}
        if uneven:
            raise ValueError(
                f"DistributedAttention: head counts {uneven} are not divisible by the "
                f"sequence-parallel size {p} while the key/value heads are; make every head "
                f"count a multiple of {p} (or the query heads a multiple of the key/value heads)"
            )


def _rotary(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding on the first `cos.shape[-1]` channels of `t` (half-split
    rotation: channels [a, b] -> [-b, a]); the rest pass through. Pure PyTorch."""
    rot = cos.shape[-1]
    t_rot, t_pass = t[..., :rot], t[..., rot:]
    a, b = t_rot.chunk(2, dim=-1)
    t_rot = t_rot * cos + torch.cat((-b, a), dim=-1) * sin
    return torch.cat((t_rot, t_pass), dim=-1) if t_pass.shape[-1] else t_rot
