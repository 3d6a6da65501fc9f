"""The demo's data: a character tokenizer and deterministic batches over the bundled corpus.

The corpus (``examples/data/corpus.txt``) is an original essay about distributed training, ~26 KB
of plain English. One character is one token, so the vocabulary is the set of characters in the
text (~53) and a model that guesses uniformly starts at a loss of ln(V) ≈ 4.

Batches are a pure function of (seed, step): every rank draws the same *global* batch and keeps its
own contiguous share (:meth:`CharDataset.batch`). A run on N ranks with micro-batch B therefore sees
exactly the examples a single process with batch N·B sees, which is what lets tests compare a
distributed run with plain PyTorch, and lets a run resume on a different number of ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["CORPUS_PATH", "CharDataset", "CharTokenizer"]

CORPUS_PATH = Path(__file__).resolve().parent / "data" / "corpus.txt"


@dataclass(frozen=True)
class CharTokenizer:
    """Maps each distinct character of a text to an id, in sorted order."""

    chars: str
    """The vocabulary: every token's character, at the index that is its id."""

    def __post_init__(self) -> None:
        if len(set(self.chars)) != len(self.chars):
            raise ValueError("CharTokenizer.chars must not repeat a character; use from_text()")

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """The tokenizer whose vocabulary is exactly the characters in ``text``."""
        if not text:
            raise ValueError("cannot build a tokenizer from an empty text")
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        """Number of distinct tokens."""
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; a character outside the vocabulary is an error naming it."""
        stoi = {c: i for i, c in enumerate(self.chars)}
        try:
            return [stoi[c] for c in text]
        except KeyError as e:
            raise ValueError(
                f"character {e.args[0]!r} is not in the vocabulary; use only characters of the "
                "training corpus"
            ) from None

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        """The text of token ids ``ids``."""
        return "".join(self.chars[int(i)] for i in ids)


class CharDataset:
    """The corpus as one int64 tensor, split 90/10 into train and validation."""

    def __init__(self, text: str, tokenizer: CharTokenizer | None = None) -> None:
        self.tokenizer = tokenizer or CharTokenizer.from_text(text)
        data = torch.tensor(self.tokenizer.encode(text), dtype=torch.long)  # (len(text),)
        n_train = int(0.9 * len(data))
        self.splits = {"train": data[:n_train], "val": data[n_train:]}

    @classmethod
    def from_file(cls, path: str | Path = CORPUS_PATH) -> CharDataset:
        """The dataset of a UTF-8 text file (the bundled corpus by default)."""
        return cls(Path(path).read_text(encoding="utf-8"))

    def batch(
        self,
        split: str,
        step: int,
        global_batch: int,
        block_size: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of global batch number ``step``: (x, y), each (global_batch / world_size, block_size).

        ``y`` is ``x`` shifted by one token: the target at every position is the next character.
        The global batch's random windows depend only on (seed, split, step).
        """
        if split not in self.splits:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        if global_batch % world_size != 0:
            raise ValueError(
                f"global batch {global_batch} does not divide by world size {world_size}; "
                "choose a micro-batch size and let the global batch be micro_batch * world_size"
            )
        data = self.splits[split]
        if len(data) <= block_size + 1:
            raise ValueError(
                f"the {split} split ({len(data)} tokens) is shorter than block_size + 1"
            )
        g = torch.Generator().manual_seed(seed * 1_000_003 + step * 2 + (split == "val"))
        starts = torch.randint(len(data) - block_size - 1, (global_batch,), generator=g)
        per_rank = global_batch // world_size
        starts = starts[rank * per_rank : (rank + 1) * per_rank]  # this rank's contiguous share
        x = torch.stack([data[s : s + block_size] for s in starts.tolist()])  # (B, T)
        y = torch.stack([data[s + 1 : s + 1 + block_size] for s in starts.tolist()])  # (B, T)
        return x, y
