"""Continuous batching: requests join the running batch whenever a slot and cache blocks free up.

`ContinuousBatcher.submit` queues a request at any time; each `step` (1) admits queued requests
while the batch has room and the pool can hold their worst case (prompt + max_new_tokens), and
prefills them, (2) runs one decode step for every live request together, (3) retires the ones
that finished and returns their blocks. A request that cannot ever run (empty, a token id
outside the vocabulary, longer than the model's positions or the whole pool) fails alone at
`submit` with its error; the others carry on.

Note [a request fails alone]
Whatever goes wrong for one request inside `step` (its prefill or its sampling raises, or a
decode step that includes it raises) must not stop the others or keep its blocks: the request
gets `error` (the exception, named), `done=True`, and its blocks back in the pool. A batched
decode that raises cannot say whose fault it was, so each live request is then decoded alone
(B = 1, what `generate` does for one prompt); the ones that still fail are retired with their
error. Retrying is safe because a decode step counts its positions as cached (`advance`) only
after every layer ran: the retry writes the same slots again.

Admission reserves a request's worst-case blocks up front, so a live request never meets a full
pool mid-generation (no preemption or swapping in this cut). Each request samples with its own
generator (`cfg.seed`), so its tokens equal `generate(model, [prompt], cfg)` run alone
(see Note [sampling draws one uniform per token] in generation.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from minispeed.core import ranges
from minispeed.inference.fused_gpt import InferenceGPT
from minispeed.inference.generation import SamplingConfig, prompt_error, sample_next

__all__ = ["ContinuousBatcher", "RequestResult"]


@dataclass
class RequestResult:
    """What became of one request: its new tokens, or the error that stopped it."""

    tokens: list[int] = field(default_factory=list)
    error: str | None = None
    done: bool = False


@dataclass
class _Request:
    rid: int
    prompt: list[int]
    cfg: SamplingConfig
    generator: torch.Generator
    blocks: int  # worst-case KV blocks, reserved at admission
    result: RequestResult


class ContinuousBatcher:
    """Runs many requests through one `InferenceGPT` and one paged KV cache (see module docstring)."""

    def __init__(
        self, model: InferenceGPT, num_blocks: int, kv_block_size: int = 16, max_batch: int = 16
    ) -> None:
        for name, value in (("num_blocks", num_blocks), ("kv_block_size", kv_block_size),
                            ("max_batch", max_batch)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ContinuousBatcher: {name} must be an int >= 1, got {value!r}")
        self.model, self.max_batch = model, max_batch
        self.cache = model.new_cache(num_blocks, kv_block_size)
        self.waiting: deque[_Request] = deque()
        self.live: list[_Request] = []
        self.results: dict[int, RequestResult] = {}
        self._reserved = 0  # blocks promised to live requests
        self._next_id = 0

    @property
    def reserved_blocks(self) -> int:
        """KV blocks promised to live requests (their worst case); 0 when none is live."""
        return self._reserved

    def submit(self, prompt: list[int] | torch.Tensor, cfg: SamplingConfig) -> int:
        """Queue a request; returns its id (the key of `results`).

        A request that can never run gets its `error` here, `done=True`, and is not queued.
        """
        rid, self._next_id = self._next_id, self._next_id + 1
        bs = self.cache.block_size
        blocks = -(-(len(prompt) + cfg.max_new_tokens) // bs)
        prompt = prompt.tolist() if isinstance(prompt, torch.Tensor) else prompt  # 1-D ids
        req = _Request(rid, list(prompt), cfg, torch.Generator().manual_seed(cfg.seed), blocks,
                       RequestResult())  # fmt: skip
        self.results[rid] = req.result
        error = self._why_never(req)
        if error:
            req.result.error, req.result.done = error, True
        else:
            self.waiting.append(req)
        return rid

    def _why_never(self, req: _Request) -> str | None:
        error = prompt_error(req.prompt, self.model.vocab_size)
        if error:
            return error
        if len(req.prompt) + req.cfg.max_new_tokens > self.model.block_size:
            return (f"prompt of {len(req.prompt)} tokens + max_new_tokens {req.cfg.max_new_tokens} "
                    f"exceeds the model's {self.model.block_size} positions")  # fmt: skip
        if req.blocks > self.cache.num_blocks:
            return (f"needs {req.blocks} KV blocks but the whole cache has {self.cache.num_blocks}: "
                    "build the batcher with more num_blocks")  # fmt: skip
        return None

    def _finish(self, req: _Request) -> None:
        req.result.done = True
        self.cache.free(req.rid)
        self._reserved -= req.blocks

    def _fail(self, req: _Request, stage: str, exc: Exception) -> None:
        """See Note [a request fails alone]."""
        req.result.error = f"{stage} failed: {type(exc).__name__}: {exc}"
        self._finish(req)

    def _finished(self, req: _Request) -> bool:
        out = req.result.tokens
        return len(out) >= req.cfg.max_new_tokens or (bool(out) and out[-1] in req.cfg.stop_tokens)

    def step(self) -> None:
        """Admit and prefill what fits, then one decode step for every live request."""
        with torch.no_grad():
            self._admit()
            self._retire()
            if self.live:
                self._decode_live()
            self._retire()

    def _admit(self) -> None:
        while (self.waiting and len(self.live) < self.max_batch
               and self._reserved + self.waiting[0].blocks <= self.cache.num_blocks):  # fmt: skip
            req = self.waiting.popleft()
            self._reserved += req.blocks
            self.cache.add_sequence(req.rid)
            if req.cfg.max_new_tokens == 0:
                self._finish(req)
                continue
            try:
                with ranges.range("inference.prefill"):
                    logits = self.model.prefill(
                        torch.tensor(req.prompt), self.cache, req.rid, last_only=True
                    )
                req.result.tokens.append(sample_next(logits[-1], req.cfg, req.generator))
            except Exception as exc:
                self._fail(req, "prefill", exc)
                continue
            self.live.append(req)

    def _decode_live(self) -> None:
        """One decode step for every live request; see Note [a request fails alone]."""
        try:
            with ranges.range("inference.decode"):
                logits = self._decode(self.live)
        except Exception:
            for req in list(self.live):
                try:
                    with ranges.range("inference.decode"):
                        row = self._decode([req])[0]
                    req.result.tokens.append(sample_next(row, req.cfg, req.generator))
                except Exception as exc:
                    self._fail(req, "decode", exc)
            return
        for row, req in enumerate(self.live):
            try:
                req.result.tokens.append(sample_next(logits[row], req.cfg, req.generator))
            except Exception as exc:
                self._fail(req, "sampling", exc)

    def _decode(self, reqs: list[_Request]) -> torch.Tensor:
        tokens = torch.tensor([r.result.tokens[-1] for r in reqs])
        return self.model.decode(tokens, self.cache, [r.rid for r in reqs])

    def _retire(self) -> None:
        for req in self.live:
            if not req.result.done and self._finished(req):
                self._finish(req)
        self.live = [r for r in self.live if not r.result.done]

    def run(self) -> dict[int, RequestResult]:
        """Step until no request is waiting or live; returns every result by request id."""
        while self.waiting or self.live:
            self.step()
        return self.results
