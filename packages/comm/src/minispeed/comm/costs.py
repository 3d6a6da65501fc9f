"""What each collective costs, written once: message size, bus-bandwidth factor, bytes on the wire.

The comms logger, the tests, the benchmark and the docs all call these functions, so the prose,
the ledger and the assertions cannot drift apart (STYLE habit 11).

Conventions (those of nccl-tests, so our numbers compare with theirs). `S` is the *message size*
in bytes and `n` the number of ranks in the group:

| op | message size S | busbw factor | bytes this rank sends |
|---|---|---|---|
| all_reduce | tensor bytes | 2(n-1)/n | 2(n-1)/n · S  (ring) |
| all_gather | OUTPUT (gathered) bytes | (n-1)/n | (n-1)/n · S   (ring) |
| reduce_scatter | INPUT (full, unreduced) bytes | (n-1)/n | (n-1)/n · S   (ring) |
| all_to_all | input bytes | (n-1)/n | input bytes - own chunk |
| broadcast | tensor bytes | 1 | S on the root, 0 elsewhere |
| reduce | tensor bytes | 1 | S off the root (a chain of partial sums), 0 on it |
| gather | OUTPUT bytes (n chunks, on the root) | (n-1)/n | S/n off the root, 0 on it |
| scatter | INPUT bytes (n chunks, on the root) | (n-1)/n | (n-1)/n · S on the root, 0 elsewhere |
| send / recv | tensor bytes | 1 | S (send), 0 (recv) |
| barrier | 0 | 0 | 0 |

*Algorithmic bandwidth* is `algbw = S / latency`. *Bus bandwidth* is `busbw = algbw · factor`:
the rate each link must sustain for an optimal ring to take `latency`; it is comparable across
ops and group sizes and should approach the link speed for large messages.

The alpha-beta model predicts a ring collective's time as `steps · alpha + wire_bytes · beta`
with `alpha` the per-message latency and `beta` the seconds per byte of one link
(`ring_time_s`). See docs/packages/comm.md for the derivations.
"""

from __future__ import annotations

__all__ = [
    "OPS",
    "bus_bandwidth_factor",
    "ring_steps",
    "ring_time_s",
    "wire_bytes",
]

#: Every op name the comms logger records. Coalesced all-gather and the object collectives are
#: priced as the op they are built on.
OPS = (
    "all_reduce",
    "all_gather",
    "all_gather_coalesced",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "send",
    "recv",
    "batch_p2p",
    "barrier",
)

_GATHER_LIKE = (
    "all_gather",
    "all_gather_coalesced",
    "reduce_scatter",
    "all_to_all",
    "gather",
    "scatter",
)


def _check(op: str, n: int) -> None:
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; use one of {OPS}")
    if n < 1:
        raise ValueError(f"group size must be >= 1, got {n}")


def bus_bandwidth_factor(op: str, n: int) -> float:
    """busbw / algbw for `op` on `n` ranks: 2(n-1)/n for all_reduce, (n-1)/n for the
    gather/scatter/all-to-all family, 1 for broadcast and point-to-point, 0 for barrier."""
    _check(op, n)
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in _GATHER_LIKE:
        return (n - 1) / n
    if op == "barrier":
        return 0.0
    return 1.0


def wire_bytes(
    op: str,
    msg_bytes: int,
    n: int,
    *,
    is_root: bool = True,
    own_chunk_bytes: int | None = None,
    impl: str = "native",
) -> int:
    """Bytes this rank puts on the wire for one call, for the bandwidth-optimal algorithm.

    `msg_bytes` follows the convention of the module docstring. For `all_to_all` pass
    `own_chunk_bytes` (the split this rank keeps for itself) when splits are uneven; by default
    the equal split `msg_bytes / n` is assumed. `is_root` matters for the rooted ops
    (`broadcast`, `reduce`, `gather`, `scatter`).
    `impl` is the implementation that ran (`CommRecord.impl`): a reduce-scatter run as an
    all-reduce (`all_reduce+slice`, `all_reduce_in_place`; see `api_compat`) sends what the
    all-reduce sends. all_reduce rounds down when `2(n-1)·S` is not a multiple of `n` (ring
    chunks differ by at most one element then); every other value is exact.
    """
    _check(op, n)
    if op == "reduce_scatter" and impl.startswith("all_reduce"):
        op = "all_reduce"
    if op == "all_reduce":
        return 2 * (n - 1) * msg_bytes // n
    if op in ("all_gather", "all_gather_coalesced", "reduce_scatter"):
        # msg_bytes = n chunks; each rank forwards n-1 of them around the ring.
        return (n - 1) * msg_bytes // n
    if op == "all_to_all":
        own = msg_bytes // n if own_chunk_bytes is None else own_chunk_bytes
        return msg_bytes - own
    if op == "broadcast":
        return msg_bytes if (is_root and n > 1) else 0
    if op == "reduce":
        return 0 if is_root else msg_bytes
    if op == "gather":
        return 0 if is_root else msg_bytes // n
    if op == "scatter":
        return (n - 1) * msg_bytes // n if is_root else 0
    if op in ("send", "batch_p2p"):
        return msg_bytes
    return 0  # recv, barrier


def ring_steps(op: str, n: int) -> int:
    """Number of sequential message rounds of the ring algorithm (the `alpha` count)."""
    _check(op, n)
    if op == "all_reduce":
        return 2 * (n - 1)  # reduce-scatter phase, then all-gather phase
    if op in _GATHER_LIKE:
        return n - 1
    if op in ("broadcast", "reduce"):
        return n - 1  # a pipelined chain; a tree would take ceil(log2 n)
    if op == "barrier":
        return 0
    return 1


def ring_time_s(op: str, msg_bytes: int, n: int, alpha_s: float, beta_s_per_byte: float) -> float:
    """Alpha-beta estimate of one call: `ring_steps · alpha + wire_bytes · beta` seconds."""
    return ring_steps(op, n) * alpha_s + wire_bytes(op, msg_bytes, n) * beta_s_per_byte
