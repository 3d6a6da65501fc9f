"""What a pipeline costs, written once: the bubble, the activations kept, the bytes sent.

Symbols: P stages, M micro-batches per step, V model chunks per stage (interleaved), A bytes of
one micro-batch's activation message between two stages (Σ over the tensors of the tuple), G
bytes of its gradient message (the tensors that require grad), H = 16 bytes of message header
(see Note [a header before every message] in `p2p.py`).

Tests assert the executor's measurements against these functions, the schedule docstrings and
the docs page quote them.
"""

from __future__ import annotations

__all__ = [
    "HEADER_BYTES",
    "bubble_fraction",
    "in_flight_bound",
    "p2p_bytes_sent_per_step",
    "zero_bubble_fraction",
]

HEADER_BYTES = 16
"""One 2-element int64 header per message (see `p2p.py`)."""


def bubble_fraction(stages: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Idle share of a GPipe / 1F1B / interleaved step: (P−1)/(V·M + P−1).

    Fill and drain each take (P−1) chunk-times on some stage while the step does V·M chunk-times
    of work per stage; with V = 1 this is GPipe's and 1F1B's (P−1)/(M+P−1).
    """
    p, m, v = stages, micro_batches, virtual_stages
    return (p - 1) / (v * m + p - 1)


def zero_bubble_fraction(
    stages: int, micro_batches: int, f: float = 1.0, b: float = 1.0, w: float = 1.0
) -> float:
    """Idle share of `ZeroBubbleH1`: (P−1)(F+b−W) / (M(F+b+W) + (P−1)(F+b−W)), for W ≤ F, b.

    Each fill/drain step costs F + b on the critical path, and a held-back W fills W of it; with
    F = b = W this is (P−1)/(3M+P−1), a third of 1F1B's idle time. (The ZB paper's assumption
    W ≤ F, b is where the held W's fit their gaps; the checker's simulation covers the rest.)
    """
    p, m = stages, micro_batches
    if w > f or w > b:
        raise ValueError(f"the closed form needs W <= F and W <= b, got F={f}, b={b}, W={w}")
    idle = (p - 1) * (f + b - w)
    return idle / (m * (f + b + w) + idle)


def in_flight_bound(schedule_name: str, stage: int, stages: int, micro_batches: int) -> int:
    """Most micro-batches whose activations stage `stage` keeps at once (V = 1 schedules).

    GPipe: M (every forward runs before any backward). 1F1B: min(P − s, M) (the warm-up depth
    plus the one in the steady state). ZB-H1: P on every stage (P − s in flight to b, plus s
    held-back W's), i.e. 1F1B's largest. Inference: 0 (nothing kept for backward).
    """
    if schedule_name == "gpipe":
        return micro_batches
    if schedule_name == "1f1b":
        return min(stages - stage, micro_batches)
    if schedule_name == "zb_h1":
        return min(stages, micro_batches)
    if schedule_name == "inference":
        return 0
    raise ValueError(f"no closed-form in-flight bound for schedule {schedule_name!r}")


def p2p_bytes_sent_per_step(
    stage: int,
    stages: int,
    micro_batches: int,
    activation_bytes: int,
    grad_bytes: int,
    virtual_stages: int = 1,
    trains: bool = True,
) -> int:
    """Bytes `stage` puts on the wire through send per step (headers included).

    Each virtual stage v = c·P + s sends its output forward when v < P·V − 1 and, when training,
    its input's gradient backward when v > 0; each message carries H header bytes:
    the sum over chunks c of M·(A+H) (if v < PV−1) plus M·(G+H) (if training and v > 0). The shape negotiation of the first
    micro-batch adds 8·len(layout) bytes per channel, once per executor (not per step).
    """
    total = 0
    last = stages * virtual_stages - 1
    for c in range(virtual_stages):
        v = c * stages + stage
        if v < last:
            total += micro_batches * (activation_bytes + HEADER_BYTES)
        if trains and v > 0:
            total += micro_batches * (grad_bytes + HEADER_BYTES)
    return total
