"""The inference form of a GPT (minispeed's examples/gpt.py, HF GPT-2): fused blocks, KV-cache forward.

`FusedGPTBlock` computes what `Block` computes, with the original block's weight tensors (shared,
not copied; or int8 copies when quantized) and the fused kernels of `minispeed.inference.kernels`:

```text
a       = LayerNorm1(x)                                   kernels.layer_norm
q, k, v = qkv(a)                                          one matmul
y       = attention(q, k, v)                              SDPA, or paged decode attention
n2, h   = LayerNorm2(proj(y) + x), and h = proj(y) + x    kernels.layer_norm(residual=x)
out     = h + mlp_proj(gelu(fc(n2) + fc_bias))            kernels.bias_gelu
```

`InferenceGPT` runs the embeddings, the blocks and the head (tied or its own) in three modes: a full forward
(no cache: every position recomputed), a prefill of one sequence that writes its K and V into a
`minispeed.inference.kv_cache.PagedKVCache`, and a decode step of one new token for each
of B sequences that reads the cache (see Note [paged decode attention] in csrc/kernels/kernels.cpp).
With `int8=True` the token table and the head are `Int8Embedding`s (see Note [int8 vocabulary]).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minispeed.inference import kernels
from minispeed.inference.kv_cache import PagedKVCache
from minispeed.inference.quantize import Int8Embedding, Int8Linear
from minispeed.inference.tensor_parallel import (
    RowParallelLinear,
    TPContext,
    column_shard,
    row_shard,
)

__all__ = ["FusedGPTBlock", "InferenceGPT", "StreamingLinear"]

# attend(layer, q, k, v) -> y, all (B, T, C): the mode-specific attention of one block.
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class StreamingLinear(nn.Linear):
    """An `nn.Linear` over another linear's weight and bias (the same Parameters: no copy) whose
    forward is `kernels.linear`: at decode's few rows it reads the weight once at the memory's
    bandwidth (see Note [reading the weights once at full bandwidth] in csrc/kernels/linear.cpp);
    at more rows it is `F.linear`."""

    def __init__(self, linear: nn.Linear, keep_bias: bool = True) -> None:
        super().__init__(linear.in_features, linear.out_features, bias=False, device="meta")
        self.weight = linear.weight
        if keep_bias:
            self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, self.weight, self.bias)


def _linear(linear: nn.Linear, int8: bool, keep_bias: bool = True) -> nn.Module:
    """A `StreamingLinear` sharing `linear`'s weights, or an `Int8Linear` copy; `keep_bias=False`
    drops the bias."""
    if int8:
        q = Int8Linear(linear)
        if not keep_bias:
            q.bias = None
        return q
    return StreamingLinear(linear, keep_bias)


def _row_parallel(linear: nn.Linear, int8: bool, tp: TPContext | None) -> nn.Module:
    """`linear` whole (TP off), or this rank's column slice all-reduced (see `tensor_parallel`)."""
    if tp is None:
        return _linear(linear, int8)
    return RowParallelLinear(_linear(row_shard(linear, tp), int8), linear.bias, tp)


class FusedGPTBlock(nn.Module):
    """A `Block` of examples/gpt.py rebuilt on the fused kernels (see the module docstring).

    With `tp` (see `minispeed.inference.tensor_parallel`) it keeps H/n heads of qkv and the
    matching columns of the output projection, F/n rows of fc and columns of the MLP projection,
    and all-reduces the two block outputs.
    """

    is_fused = True  # InferenceGPT calls it with (x, layer, attend, positions)

    def __init__(
        self, block: nn.Module, int8: bool = False, tanh_gelu: bool = False,
        tp: TPContext | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.gelu_approximate = "tanh" if tanh_gelu else "none"  # tanh: GPT-2's "gelu_new"
        n = 1 if tp is None else tp.size
        self.n_head = block.attn.n_head // n  # heads of this rank
        self.ln1, self.ln2 = block.ln1, block.ln2  # weights read by kernels.layer_norm
        qkv, fc = block.attn.qkv, block.mlp.fc
        if tp is not None:  # column-parallel: q, k and v each cut by heads; fc by rows
            qkv, fc = column_shard(qkv, tp, parts=3), column_shard(fc, tp)
        self.qkv = _linear(qkv, int8)
        self.attn_proj = _row_parallel(block.attn.proj, int8, tp)
        self.fc = _linear(fc, int8, keep_bias=False)  # bias added inside bias_gelu
        self.fc_bias = fc.bias
        self.mlp_proj = _row_parallel(block.mlp.proj, int8, tp)

    def forward(
        self, x: torch.Tensor, layer: int, attend: Attend, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        a, _ = kernels.layer_norm(x, self.ln1.weight, self.ln1.bias, self.ln1.eps)
        q, k, v = self.qkv(a).chunk(3, dim=-1)  # each (B, T, C / n)
        y = attend(layer, q, k, v)
        n2, h = kernels.layer_norm(
            self.attn_proj(y), self.ln2.weight, self.ln2.bias, self.ln2.eps, residual=x
        )
        act = kernels.bias_gelu(self.fc(n2), self.fc_bias, self.gelu_approximate)
        return h + self.mlp_proj(act)


# Note [decode step plan]
# At batch 1 on a small model a decode step is mostly Python: ~10 kernel or linear calls per
# block, each with its checks. What does not change between the L layers of one step is built
# once: the block tables and lengths (int32, checked once by `kernels.check_decode_inputs`, so the
# L `decode_attention` calls pass validate=False and skip three reductions each), and the flat
# cache slots the new K and V go to (one `index_copy_` per layer instead of indexing with
# (block, offset) pairs). The positions are checked against block_size once per forward (`_run`),
# so the rotary layers skip their own range check (two reductions each). At 124M parameters the
# linears dominate instead: see Note [reading the weights once at full bandwidth] in
# csrc/kernels/linear.cpp. benchmarks/inference_decode.py reports both (docs: before/after).


# Note [int8 vocabulary]
# With int8 weights the block linears are a quarter of their fp32 bytes, and the vocabulary
# tables become most of what a step reads: GPT-2's tied 50257 × 768 head alone is 154 MB, two
# thirds of its int8 step. `InferenceGPT(int8=True)` holds the token table as an `Int8Embedding`
# (one scale per token row): the lookup dequantizes the B gathered rows, and a tied head is
# `kernels.int8_linear` over the same int8 bytes, so the table is kept once at V·C + 4·V bytes
# and no fp32 copy is referenced. An untied head (LLaMA's lm_head) gets its own `Int8Embedding`.
# Per step at batch B the head reads V·C + 4·V bytes instead of 4·V·C; each logit moves by at
# most (s_v / 2)·Σ|x| (Note in quantize.py), so greedy tokens can part from fp32's where two
# logits are that close. Learned positions (wpe, P × C, gathered) stay fp32.


# Note [prefill: the last position's logits only]
# Sampling the first new token reads the last prompt position's logits; the other T - 1 rows of a
# prefill's head are computed for callers that score the prompt (perplexity, tests). The head is
# the largest matmul of a step (V·C: GPT-2's 50257 × 768), so for B prompts of T tokens it costs
# 2·B·T·V·C FLOPs against 2·B·V·C for the last row, and at int8 the kernel's rows go in chunks of 8
# over the whole table (ceil(B·T / 8) reads of it instead of ceil(B / 8)). `generate` and the
# batcher ask for `last_only`. Its logits are the full forward's last row: bit for bit with int8
# weights (the final norm and `int8_linear` sum each row alone, in the same order at any row
# count), to fp32 rounding with fp32 ones (one row goes to the streaming `kernels.linear`, more
# than 8 to torch's GEMM: the same split as a decode step's).


# The decode-plan builder (decode_plan.build). decode_plan imports this module for its block
# types and registers itself here when imported (the package's __init__ imports it), so this
# module does not import it back (docs/architecture.md, "No cycle").
_PLANNER: Callable[..., Any] | None = None


def set_decode_planner(build: Callable[..., Any]) -> None:
    """Install the builder of decode plans (`decode_plan.build`)."""
    global _PLANNER
    _PLANNER = build


class InferenceGPT(nn.Module):
    """minispeed's GPT for inference: fused blocks where a policy matched, originals elsewhere.

    Original (unrecognised) blocks run only in the full forward; the cached modes need every
    block fused and say so otherwise.
    """

    def __init__(
        self,
        wte: nn.Embedding,
        wpe: nn.Embedding | None,
        blocks: list[nn.Module],
        ln_f: nn.Module,
        n_head: int,
        head_weight: torch.Tensor | None = None,
        max_positions: int | None = None,
        rms_final_norm: bool = False,
        head_dim: int | None = None,
        tp: TPContext | None = None,
        n_kv_head: int | None = None,
        int8: bool = False,
    ) -> None:
        super().__init__()
        # n_head: the query heads this rank attends over (H / tp_size under TP); n_kv_head: the
        # K/V heads it caches (grouped-query attention, LLaMA; n_head when None).
        self.tp = tp
        self.n_kv_head = n_head if n_kv_head is None else n_kv_head
        if self.n_kv_head < 1 or n_head % self.n_kv_head:
            raise ValueError(f"n_head {n_head} must be a multiple of n_kv_head {self.n_kv_head}")
        # Positions: learned (wpe, GPT) or rotary inside the blocks (wpe None, LLaMA).
        self.block_size = wpe.num_embeddings if wpe is not None else int(max_positions)
        self.rms_final_norm = rms_final_norm  # LLaMA's final RMSNorm, else LayerNorm
        self.n_head, self.n_embd = n_head, wte.embedding_dim
        self.head_dim = wte.embedding_dim // n_head if head_dim is None else head_dim
        self.wpe, self.ln_f = wpe, ln_f
        self.blocks = nn.ModuleList(blocks)
        # The output head's (V, C) weight; None: tied to wte (minispeed's GPT, GPT-2).
        self.head_weight = head_weight
        # int8 (Note [int8 vocabulary]): wte an Int8Embedding, head_q the head as int8 (wte
        # itself when tied); the fp32 tables are not referenced.
        self.wte: nn.Module = Int8Embedding(wte) if int8 else wte
        self.head_q: Int8Embedding | None = None
        self._plans: dict = {}  # (batch, id(op), thread) -> decode plan or None: _decode_plan
        if int8:
            self.head_q = self.wte if head_weight is None else Int8Embedding(head_weight)
            self.head_weight = None

    @property
    def vocab_size(self) -> int:
        """Token ids the embedding accepts: [0, vocab_size)."""
        return self.wte.num_embeddings

    @property
    def tp_size(self) -> int:
        """Ranks each block is split over (1: no tensor parallelism)."""
        return 1 if self.tp is None else self.tp.size

    def new_cache(self, num_blocks: int, block_size: int = 16) -> PagedKVCache:
        """An empty paged KV cache shaped for this model (its `n_kv_head` K/V heads)."""
        return PagedKVCache(
            len(self.blocks), self.n_kv_head, self.head_dim, num_blocks, block_size,
            dtype=torch.float32, device=self.device,
        )  # fmt: skip

    @property
    def device(self) -> torch.device:
        """Where the token table (fp32 or int8) lives: inputs are moved there."""
        return (self.wte.weight_q if self.head_q is not None else self.wte.weight).device

    def _heads(self, t: torch.Tensor) -> torch.Tensor:  # (B, T, n·D) -> (B, n, T, D), n heads
        B, T, _ = t.shape
        return t.view(B, T, -1, self.head_dim).transpose(1, 2)

    def _run(
        self, idx: torch.Tensor, positions: torch.Tensor, attend: Attend | None,
        last_only: bool = False, plan: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        # Token ids and positions built on the host (generate, the batcher) go to the weights'
        # device here, once per forward (a no-op when they are already there).
        idx, positions = idx.to(self.device), positions.to(self.device)
        if positions.numel() and int(positions.max()) >= self.block_size:  # Note [decode step plan]
            raise ValueError(
                f"position {int(positions.max())} is past the model's {self.block_size} positions: "
                "generate fewer tokens or start a new sequence"
            )
        with kernels.pinned_op():  # the op is looked up once per forward, not per kernel call
            return self._run_blocks(idx, positions, attend, last_only, plan)

    def _run_blocks(
        self, idx: torch.Tensor, positions: torch.Tensor, attend: Attend | None,
        last_only: bool = False, plan: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        x = self.wte(idx)  # (B, T, C)
        if self.wpe is not None:
            x = x + self.wpe(positions)
        if plan is not None:  # the blocks as raw op calls: see decode_plan.py
            x = plan(x)
        for layer, block in enumerate(self.blocks if plan is None else ()):
            if getattr(block, "is_fused", False):
                x = block(x, layer, attend or self._full_attention, positions)
            elif attend is None:
                x = block(x)
            else:
                why = getattr(block, "why_kept", None)
                raise RuntimeError(
                    f"block {layer} ({type(block).__name__}) was not replaced by a fused block"
                    f"{f' ({why})' if why else ''}, so it cannot read a KV cache: generate with "
                    "use_cache=False"
                )
        if last_only:  # See Note [prefill: the last position's logits only].
            x = x[:, -1:]
        if self.rms_final_norm:
            x, _ = kernels.rms_norm(x, self.ln_f.weight, self.ln_f.variance_epsilon)
        else:
            x, _ = kernels.layer_norm(x, self.ln_f.weight, self.ln_f.bias, self.ln_f.eps)
        if self.head_q is not None:  # Note [int8 vocabulary]
            return self.head_q.logits(x)  # (B, T, V)
        head = self.wte.weight if self.head_weight is None else self.head_weight
        return kernels.linear(x, head)  # (B, T, V)

    def _full_attention(self, layer: int, q, k, v) -> torch.Tensor:
        B, T, C = q.shape
        y = F.scaled_dot_product_attention(
            self._heads(q), self._heads(k), self._heads(v), is_causal=True,
            enable_gqa=self.n_kv_head != self.n_head,
        )  # fmt: skip
        return y.transpose(1, 2).reshape(B, T, C)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits `(B, T, V)` for `idx` `(B, T)`, every position recomputed (no cache)."""
        T = idx.shape[1]
        if self.block_size < T:
            raise ValueError(f"sequence length {T} exceeds block_size {self.block_size}")
        return self._run(idx, torch.arange(T, device=idx.device), None)

    def prefill(
        self, idx: torch.Tensor, cache: PagedKVCache, seq_id: int, last_only: bool = False
    ) -> torch.Tensor:
        """Logits `(T, V)` of one new sequence's prompt `idx` `(T,)`; its K, V go into `cache`.
        `last_only`: the last position's only, `(1, V)` (see `prefill_many`)."""
        return self.prefill_many(idx[None], cache, [seq_id], last_only)[0]

    def prefill_many(
        self, idx: torch.Tensor, cache: PagedKVCache, seq_ids: list[int], last_only: bool = False
    ) -> torch.Tensor:
        """Logits `(B, T, V)` of B new sequences whose prompts `idx` `(B, T)` have the same length,
        in one forward (one pass of Python per layer for all B); their K, V go into `cache`.

        `last_only=True` returns `(B, 1, V)`: the final norm and the head run on the last
        position only, what sampling the first new token needs (see Note [prefill: the last
        position's logits only]); the other positions' K and V are cached all the same."""
        B, T = idx.shape
        if len(seq_ids) != B:
            raise ValueError(f"{B} prompts but {len(seq_ids)} sequence ids")
        for s in seq_ids:
            if cache.lengths[s] != 0:
                raise ValueError(f"sequence {s} already holds tokens: prefill starts a sequence")
        for s in seq_ids:
            cache.reserve(s, T)

        def attend(layer, q, k, v):
            kh, vh = self._heads(k).transpose(1, 2), self._heads(v).transpose(1, 2)  # (B, T, KV, D)
            for row, s in enumerate(seq_ids):
                cache.write(layer, s, kh[row], vh[row])
            return self._full_attention(layer, q, k, v)

        logits = self._run(idx, torch.arange(T, device=idx.device), attend, last_only)
        for s in seq_ids:
            cache.advance(s, T)
        return logits

    def _decode_plan(self, batch: int, cache: PagedKVCache):
        """The decode plan of this model at `batch` rows for the op in force, kept per (batch, op,
        thread) and dropped when the model moves (`_apply`); None where it does not apply."""
        op = kernels.load_op()
        if op is None or not cache.k[0].is_cpu or _PLANNER is None:
            return None
        key = (batch, id(op), threading.get_ident())  # a plan's buffers serve one step at a time
        if key not in self._plans:
            self._plans[key] = _PLANNER(self, op, batch)
        return self._plans[key]

    def _apply(self, fn, recurse=True):  # .to(), .cuda(), .float(): the plans' addresses go stale
        self._plans.clear()
        return super()._apply(fn, recurse)

    def decode(self, tokens: torch.Tensor, cache: PagedKVCache, seq_ids: list[int]) -> torch.Tensor:
        """Logits `(B, V)` for one new token per sequence (`tokens` `(B,)`), reading the cache."""
        B = len(seq_ids)
        positions = [cache.lengths[s] for s in seq_ids]
        for s in seq_ids:
            cache.reserve(s, 1)
        # Once per step, shared by every layer (Note [decode step plan]): tables, lengths, slots.
        shape, kv_shape = (B, self.n_head, self.head_dim), (B, self.n_kv_head, self.head_dim)
        tables, seq_lens = kernels.check_decode_inputs(
            shape, cache.k[0], cache.v[0], cache.block_tables(seq_ids),
            torch.tensor([p + 1 for p in positions], dtype=torch.int32, device=cache.k[0].device),
        )  # fmt: skip
        slots = cache.next_slots(seq_ids)

        def attend(layer, q, k, v):
            k_cache, v_cache = cache.k[layer], cache.v[layer]
            cache.write_next(layer, slots, k.reshape(kv_shape), v.reshape(kv_shape))
            y = kernels.decode_attention(
                q.reshape(shape).contiguous(), k_cache, v_cache, tables, seq_lens, validate=False
            )
            return y.view(B, 1, -1)

        pos = torch.tensor(positions, device=tokens.device)[:, None]
        plan = self._decode_plan(B, cache)
        run_plan = None
        if plan is not None:
            run_plan = lambda x: plan.run(x, cache, slots, tables, seq_lens, pos)  # noqa: E731
        logits = self._run(tokens[:, None], pos, attend, plan=run_plan)[:, 0]
        for s in seq_ids:
            cache.advance(s, 1)
        return logits
