"""`CompressedLinear`: an `nn.Linear` that fake-quantizes and masks on the way through
(docs/packages/compression.md).

`compress` replaces the chosen `nn.Linear` layers of a model with it; each technique is then
switched on by the schedule (`Schedule.step`) and made permanent by `clean`. What the forward
does, in order, to `y = x Wᵀ + b` (W: `(out, in)`):

1. weight quantization: `W ← fake_quantize(W, target_bits, groups)` (STE backward);
2. sparse pruning: `W ← W ⊙ M` (M: `(out, in)`, fixed from |W| (l1) or top-k of learned scores);
3. row pruning: `W ← W ⊙ r`, `b ← b ⊙ r` (r: `(out, 1)`, one per output row);
4. head pruning: W's input columns, viewed as `(heads, in/heads)`, ⊙ h (h: `(1, heads)`);
5. activation quantization: `x ← fake_quantize(x)` per token (dynamic) or with a running range
   (static).

Bytes kept per layer, beyond the weight's Ψ = out·in elements: l1 masks as fp32 buffers
(4Ψ sparse, 4·out row), topk scores as fp32 parameters trained with the optimizer (4Ψ sparse,
4·out row, 4·heads head; plus the optimizer's state for them), 8 bytes for a static activation
range. Quantization keeps nothing: the scale is recomputed every forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from minispeed.compression.quantize import fake_quantize, top_k_mask

__all__ = ["CompressedConv2d", "CompressedEmbedding", "CompressedLinear", "Prune", "keep_channels"]

_RANGE_MOMENTUM = 0.95  # static activation range: DeepSpeed's QuantAct momentum
# DeepSpeed's names for the masks (buffers) and scores (parameters), so state dicts agree.
_MASK = {"sparse": "sparse_pruning_mask", "row": "row_pruning_mask"}
_SCORES = {"sparse": "sparse_mask_scores", "row": "row_mask_scores", "head": "head_pruning_scores"}


@dataclass
class Prune:
    """One pruning technique on a layer: its method, the fraction kept, and whether the
    schedule has switched it on. Its mask lives on the layer (a buffer for l1, learned scores, a
    parameter, for topk; named as DeepSpeed names them)."""

    method: str
    dense_ratio: float
    active: bool = False


def _scores(shape: tuple[int, ...], device: torch.device) -> nn.Parameter:
    """Learned mask scores, initialized as `nn.Linear` initializes its weight."""
    scores = nn.Parameter(torch.empty(shape, device=device))
    nn.init.kaiming_uniform_(scores, a=math.sqrt(5))
    return scores


class CompressedLinear(nn.Linear):
    """`nn.Linear` with optional fake quantization and pruning masks (module docstring).

    Built from a linear with `CompressedLinear.wrap(linear)`, which shares the linear's weight
    and bias tensors. The `enable_*` methods attach a technique (off until the schedule turns
    it on); the `fix_*` methods make it permanent and drop its masks.
    """

    @classmethod
    def wrap(cls, linear: nn.Linear) -> CompressedLinear:
        """A `CompressedLinear` holding `linear`'s own weight and bias (no copy, no init)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        layer.weight = linear.weight
        layer.bias = linear.bias
        layer._reset_techniques()
        return layer

    def _reset_techniques(self) -> None:
        self.weight_bits: int | None = None  # fake-quantize weights to this (None: off)
        self.weight_groups = 1
        self.weight_symmetric = True
        self.weight_active = False
        self.activation_bits: int | None = None
        self.activation_symmetric = True
        self.activation_static = False
        self.activation_active = False
        self.sparse: Prune | None = None
        self.row: Prune | None = None
        self.head: Prune | None = None
        self.num_heads: int | None = None

    # -- attaching techniques (compress) --------------------------------------------------------
    def enable_weight_quantization(self, bits: int, groups: int, symmetric: bool) -> None:
        """Fake-quantize W to `bits` (1: binary, 2: ternary) in `groups` groups, once active."""
        if self.weight.numel() % groups:
            raise ValueError(
                f"quantize_groups={groups} does not divide this layer's weight "
                f"{tuple(self.weight.shape)}; give a divisor of every compressed weight's size"
            )
        if bits <= 2 and not symmetric:
            raise ValueError(f"{bits}-bit weights are symmetric only: set quantization_type")
        self.weight_bits, self.weight_groups, self.weight_symmetric = bits, groups, symmetric

    def enable_activation_quantization(self, bits: int, symmetric: bool, static: bool) -> None:
        """Fake-quantize the input to `bits`, per token (dynamic) or with a running range."""
        self.activation_bits, self.activation_symmetric = bits, symmetric
        self.activation_static = static
        if static:  # (min, max); equal until the first training forward sets them
            self.register_buffer("activation_range", torch.zeros(2, device=self.weight.device))

    def enable_sparse_pruning(self, dense_ratio: float, method: str) -> None:
        """Keep `dense_ratio` of W's entries: by |W| now (l1) or by learned scores (topk)."""
        self.sparse = Prune(method, dense_ratio)
        if method == "l1":
            self.register_buffer(
                _MASK["sparse"], top_k_mask(self.weight.detach().abs(), dense_ratio)
            )
        else:
            self.register_parameter(
                _SCORES["sparse"], _scores(tuple(self.weight.shape), self.weight.device)
            )

    def enable_row_pruning(self, dense_ratio: float, method: str) -> None:
        """Keep `dense_ratio` of W's output rows: by their L1 norm now (l1) or learned (topk)."""
        self.row = Prune(method, dense_ratio)
        if method == "l1":
            norms = torch.linalg.norm(self.weight.detach(), ord=1, dim=1)
            self.register_buffer(_MASK["row"], top_k_mask(norms, dense_ratio).view(-1, 1))
        else:
            self.register_parameter(
                _SCORES["row"], _scores((self.out_features, 1), self.weight.device)
            )

    def enable_head_pruning(self, dense_ratio: float, num_heads: int) -> None:
        """Keep `dense_ratio` of the heads feeding this output projection (learned scores)."""
        if self.in_features % num_heads:
            raise ValueError(
                f"num_heads={num_heads} does not divide this layer's {self.in_features} inputs; "
                "head pruning applies to attention's output projection (inputs = heads x dim)"
            )
        self.head, self.num_heads = Prune("topk", dense_ratio), num_heads
        self.register_parameter(_SCORES["head"], _scores((1, num_heads), self.weight.device))

    # -- the masks ---------------------------------------------------------------------------
    def mask(self, kind: str) -> torch.Tensor:
        """The current 0/1 mask of `kind` ("sparse", "row", "head")."""
        prune = getattr(self, kind)
        if prune.method == "l1":
            return getattr(self, _MASK[kind])
        return top_k_mask(getattr(self, _SCORES[kind]), prune.dense_ratio)

    def _head_masked(self, weight: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # W's input columns grouped by head: Wᵀ (in, out) -> (heads, in/heads · out)
        out, inp = weight.shape
        return (weight.t().reshape(self.num_heads, -1) * mask.view(-1, 1)).reshape(inp, out).t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        if self.weight_active and self.weight_bits is not None:
            weight = fake_quantize(
                weight, self.weight_bits, self.weight_symmetric, self.weight_groups
            )
        if self.sparse is not None and self.sparse.active:
            weight = weight * self.mask("sparse")
        if self.row is not None and self.row.active:
            rows = self.mask("row")
            weight = weight * rows
            bias = None if bias is None else bias * rows.view(-1)
        if self.head is not None and self.head.active:
            weight = self._head_masked(weight, self.mask("head"))
        if self.activation_active and self.activation_bits is not None:
            x = self._quantized_input(x)
        return F.linear(x, weight, bias)

    def _quantized_input(self, x: torch.Tensor) -> torch.Tensor:
        bits, symmetric = self.activation_bits, self.activation_symmetric
        assert bits is not None
        if not self.activation_static:  # each token its own range
            return fake_quantize(x, bits, symmetric, x.numel() // x.size(-1))
        span = self.activation_range
        if self.training:  # a running (min, max) of the whole batch, momentum 0.95
            low, high = x.detach().min(), x.detach().max()
            if span[0] == span[1]:
                span[0], span[1] = low, high
            span[0] = span[0] * _RANGE_MOMENTUM + low * (1 - _RANGE_MOMENTUM)
            span[1] = span[1] * _RANGE_MOMENTUM + high * (1 - _RANGE_MOMENTUM)
        return fake_quantize(x, bits, symmetric, 1, (span[0], span[1]))

    # -- making it permanent (clean) -----------------------------------------------------------
    def fix_weight_quantization(self) -> None:
        """W ← its quantized value; the forward stops quantizing (the values are on the grid)."""
        if self.weight_bits is None:
            return
        with torch.no_grad():
            self.weight.copy_(
                fake_quantize(
                    self.weight, self.weight_bits, self.weight_symmetric, self.weight_groups
                )
            )
        self.weight_bits, self.weight_active = None, False

    def fix_sparse_pruning(self) -> None:
        """W ← W ⊙ M; the mask (or scores) is dropped: Ψ fp32 values freed."""
        if self.sparse is None:
            return
        with torch.no_grad():
            self.weight.mul_(self.mask("sparse"))
        self._drop("sparse")

    def fix_row_pruning(self, shrink: bool) -> torch.Tensor | None:
        """Apply the row mask: `shrink` removes the pruned output rows (and bias entries), else
        they are zeroed. Returns the kept rows (bool, `(out,)`) for the next layer's inputs."""
        if self.row is None:
            return None
        keep = self.mask("row").detach().bool().view(-1)
        if shrink:
            self._set(
                self.weight.detach()[keep, :],
                None if self.bias is None else self.bias.detach()[keep],
            )
        else:
            with torch.no_grad():
                self.weight.mul_(keep.view(-1, 1))
                if self.bias is not None:
                    self.bias.mul_(keep)
        self._drop("row")
        return keep

    def keep_inputs(self, keep: torch.Tensor) -> None:
        """Remove the input columns not in `keep` (the previous layer's pruned rows)."""
        self._set(self.weight.detach()[:, keep], self.bias)

    def fix_head_pruning(self, shrink: bool) -> torch.Tensor | None:
        """Apply the head mask to this output projection: `shrink` removes the pruned heads' input
        columns, else they are zeroed. Returns the kept heads (bool, `(heads,)`)."""
        if self.head is None:
            return None
        keep = self.mask("head").detach().bool().view(-1)
        heads = self.num_heads
        out = self.out_features
        if shrink:
            columns = self.weight.detach().t().reshape(heads, -1)[keep, :].reshape(-1, out).t()
            self._set(columns, self.bias)
        else:
            with torch.no_grad():
                self.weight.copy_(self._head_masked(self.weight, keep.to(self.weight.dtype)))
        self._drop("head")
        return keep

    def keep_heads(self, keep: torch.Tensor, num_heads: int) -> None:
        """Remove the output rows (and bias entries) of the heads not in `keep` (Q, K, V)."""
        rows = self.weight.detach().reshape(num_heads, -1)[keep, :].reshape(-1, self.in_features)
        bias = self.bias
        if bias is not None:
            bias = bias.detach().reshape(num_heads, -1)[keep, :].reshape(-1)
        self._set(rows, bias)

    def _set(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """New, smaller parameters (new tensors: an optimizer built before holds the old ones)."""
        self.weight = nn.Parameter(weight.clone())
        if bias is not None:
            self.bias = nn.Parameter(bias.detach().clone())
        self.out_features, self.in_features = self.weight.shape

    def _drop(self, kind: str) -> None:
        prune = getattr(self, kind)
        delattr(self, _MASK[kind] if prune.method == "l1" else _SCORES[kind])
        setattr(self, kind, None)

    def extra_repr(self) -> str:
        on = [
            name
            for name, value in (
                ("weight_bits", self.weight_bits),
                ("activation_bits", self.activation_bits),
                ("sparse", self.sparse),
                ("row", self.row),
                ("head", self.head),
            )
            if value is not None
        ]
        return f"{super().extra_repr()}, compressed={on}"


class CompressedEmbedding(nn.Embedding):
    """`nn.Embedding` whose table is fake-quantized once active (weight quantization only):
    one scale per token row (`groups = num_embeddings`, DeepSpeed's rule for embeddings, whatever
    `quantize_groups` says). Built with `CompressedEmbedding.wrap(embedding)` (shared weight)."""

    @classmethod
    def wrap(cls, embedding: nn.Embedding) -> CompressedEmbedding:
        """A `CompressedEmbedding` holding `embedding`'s own weight (no copy, no init)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        for name in ("num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type",
                     "scale_grad_by_freq", "sparse"):  # fmt: skip
            setattr(layer, name, getattr(embedding, name))
        layer.weight = embedding.weight
        layer.weight_bits: int | None = None
        layer.weight_symmetric = True
        layer.weight_active = False
        return layer

    def enable_weight_quantization(self, bits: int, groups: int, symmetric: bool) -> None:
        """Fake-quantize the table to `bits`, one group per row (`groups` is not used)."""
        del groups
        if bits <= 2 and not symmetric:
            raise ValueError(f"{bits}-bit weights are symmetric only: set quantization_type")
        self.weight_bits, self.weight_symmetric = bits, symmetric

    def _table(self) -> torch.Tensor:
        assert self.weight_bits is not None
        return fake_quantize(
            self.weight, self.weight_bits, self.weight_symmetric, self.num_embeddings
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if self.weight_active and self.weight_bits is not None:
            weight = self._table()
        return F.embedding(
            tokens, weight, self.padding_idx, self.max_norm, self.norm_type,
            self.scale_grad_by_freq, self.sparse,
        )  # fmt: skip

    def fix_weight_quantization(self) -> None:
        """The table ← its quantized value; the forward stops quantizing."""
        if self.weight_bits is None:
            return
        with torch.no_grad():
            self.weight.copy_(self._table())
        self.weight_bits, self.weight_active = None, False


class CompressedConv2d(nn.Conv2d):
    """`nn.Conv2d` with channel pruning (channel_pruning only): output channels ⊙ c, c keeping
    `dense_ratio` of the channels by their kernels' L1 norm (`l1`, fixed at `init_compression`)
    or learned scores (`topk`). Keeps a 4·out-byte mask or scores. Built with `wrap` (shared
    tensors)."""

    @classmethod
    def wrap(cls, conv: nn.Conv2d) -> CompressedConv2d:
        """A `CompressedConv2d` holding `conv`'s own weight and bias (no copy, no init)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.__dict__.update({k: v for k, v in conv.__dict__.items() if not k.startswith("_")})
        layer._reversed_padding_repeated_twice = conv._reversed_padding_repeated_twice
        layer.weight, layer.bias = conv.weight, conv.bias
        layer.channel: Prune | None = None
        return layer

    def enable_channel_pruning(self, dense_ratio: float, method: str) -> None:
        """Keep `dense_ratio` of the output channels (l1 by kernel norm now, or topk learned)."""
        self.channel = Prune(method, dense_ratio)
        if method == "l1":
            # each kernel's L1 norm (DeepSpeed 0.17.6 writes linalg.norm(ord=1, dim=[1, 2, 3]),
            # which torch refuses for three dims: its l1 channel pruning does not run)
            norms = self.weight.detach().abs().sum(dim=(1, 2, 3))
            self.register_buffer(
                "channel_pruning_mask", top_k_mask(norms, dense_ratio).view(-1, 1, 1, 1)
            )
        else:
            scores = _scores((self.out_channels, 1, 1, 1), self.weight.device)
            self.register_parameter("channel_mask_scores", scores)

    def mask(self) -> torch.Tensor:
        """The current 0/1 channel mask, `(out, 1, 1, 1)`."""
        assert self.channel is not None
        if self.channel.method == "l1":
            return self.channel_pruning_mask
        return top_k_mask(self.channel_mask_scores, self.channel.dense_ratio)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        if self.channel is not None and self.channel.active:
            channels = self.mask()
            weight = weight * channels
            bias = None if bias is None else bias * channels.view(-1)
        return self._conv_forward(x, weight, bias)

    def fix_channel_pruning(self, shrink: bool) -> torch.Tensor | None:
        """Apply the mask: `shrink` removes the pruned output channels, else they are zeroed.
        Returns the kept channels (bool, `(out,)`) for the layers that read them."""
        if self.channel is None:
            return None
        keep = self.mask().detach().bool().view(-1)
        if shrink:
            self.weight = nn.Parameter(self.weight.detach()[keep].clone())
            if self.bias is not None:
                self.bias = nn.Parameter(self.bias.detach()[keep].clone())
            self.out_channels = self.weight.shape[0]
        else:
            with torch.no_grad():
                self.weight.mul_(keep.view(-1, 1, 1, 1))
                if self.bias is not None:
                    self.bias.mul_(keep)
        delattr(
            self, "channel_pruning_mask" if self.channel.method == "l1" else "channel_mask_scores"
        )
        self.channel = None
        return keep


def keep_channels(module: nn.Module, keep: torch.Tensor) -> None:
    """Remove the input channels not in `keep` from the layer reading a pruned convolution: a
    convolution's input channels, or a batch norm's channels (its affine parameters and running
    statistics)."""
    if isinstance(module, nn.Conv2d):
        module.weight = nn.Parameter(module.weight.detach()[:, keep].clone())
        module.in_channels = module.weight.shape[1]
    elif isinstance(module, nn.BatchNorm2d):
        if module.affine:
            module.weight = nn.Parameter(module.weight.detach()[keep].clone())
            module.bias = nn.Parameter(module.bias.detach()[keep].clone())
        if module.running_mean is not None:
            module.running_mean = module.running_mean[keep].clone()
            module.running_var = module.running_var[keep].clone()
        module.num_features = int(keep.sum())
    else:
        raise ValueError(
            f"channel pruning's related modules are convolutions and batch norms, got "
            f"{type(module).__name__}"
        )
