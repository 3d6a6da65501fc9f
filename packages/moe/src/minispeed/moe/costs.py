"""The arithmetic of an MoE layer, written once: capacity, buffer rows, all-to-all bytes.

Symbols: S tokens on a rank (batch × sequence), d the hidden size, E experts, E_p the
expert-parallel degree, k experts per token, f the capacity factor, b bytes per element.
The layer, the tests and the docs page call these functions, so they cannot drift apart.
"""

from __future__ import annotations

import math

__all__ = ["all_to_all_bytes", "capacity", "capacity_buffer_rows"]


def capacity(
    num_tokens: int, num_experts: int, top_k: int, factor: float, min_capacity: int
) -> int:
    """Assignments one expert accepts from one rank's S tokens when dropping:

    C = min(S, max(ceil(k·S/E · f), min_capacity)).

    k·S/E is an expert's fair share of the k·S assignments; f > 1 leaves head-room for
    imbalance; C never exceeds S because a token sends at most one assignment to an expert.
    f = inf means no limit: C = S (nothing is dropped; the buffers keep the E·C layout).
    """
    if math.isinf(factor):
        return num_tokens
    fair = math.ceil(top_k * num_tokens / num_experts * factor)
    return min(num_tokens, max(fair, min_capacity))


def capacity_buffer_rows(num_experts: int, capacity_per_expert: int) -> int:
    """Rows of the dispatch buffer when dropping: E·C (empty slots included, as zeros)."""
    return num_experts * capacity_per_expert


def all_to_all_bytes(rows_to_each_rank: list[int], my_rank: int, row_bytes: int) -> int:
    """Bytes one rank puts on the wire in one all-to-all: every row except those it keeps.

    Σ_{j ≠ r} rows_j · d·b. With dropping, rows_j = (E/E_p)·C for every j, so it is
    (E_p − 1)/E_p · E·C·d·b. An MoE layer runs 2 of them forward (dispatch, combine) and 2
    backward, so 4 (E_p − 1)/E_p · E·C·d·b per layer per step.
    """
    return sum(r for j, r in enumerate(rows_to_each_rank) if j != my_rank) * row_bytes
