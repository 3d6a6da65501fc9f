"""`minispeed estimate --paper`: the ZeRO paper's per-device memory table, figure for figure.

```bash
minispeed estimate --paper --params 7.5e9 --dp 1,4,16,64,256,1024
```

Rajbhandari et al. (SC20), Table 1, gives the model-state memory per device of mixed-precision
Adam (K = 12) at data-parallel degrees 1-1,024 for Pos (stage 1), Pos+g (stage 2) and
Pos+g+p (stage 3): (2 + 2 + K)Ψ/… in GB of 10^9 bytes. The bytes come from
`zero.memory.model_state_bytes` (the formula, written once); only the rounding is the paper's
(`paper_gb`), so `tests/engine/test_cli_estimate_published.py` can compare every printed cell
with the published one.
"""

from __future__ import annotations

import json
from decimal import ROUND_FLOOR, ROUND_HALF_UP, Decimal

from minispeed.zero.memory import model_state_bytes

__all__ = ["PAPER_STAGES", "paper_gb", "paper_rows"]

#: The paper's names for stages 1-3.
PAPER_STAGES = {1: "Pos", 2: "Pos+g", 3: "Pos+g+p"}


def paper_gb(nbytes: int) -> str:
    """Bytes as Table 1 prints them, in GB (10^9 bytes): from 100 GB whole GB with the fraction
    dropped (513.5 -> 513, 4187.5 -> 4187); below, three significant figures with halves rounded
    up and at most two decimals, trailing zeros dropped (41.25 -> 41.3, 1.875 -> 1.88,
    0.46875 -> 0.47, 7.50 -> 7.5). Every one of the table's 54 cells follows this rule."""
    gb = Decimal(nbytes) / Decimal(10**9)
    if gb >= 100:
        return str(gb.to_integral_value(rounding=ROUND_FLOOR))
    if gb == 0:
        return "0"
    decimals = min(2, 2 - gb.adjusted())  # three significant figures, at most two decimals
    text = f"{gb.quantize(Decimal(1).scaleb(-decimals), rounding=ROUND_HALF_UP):f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def paper_rows(num_params: int, degrees: list[int]) -> list[dict[str, object]]:
    """One row per data-parallel degree: the three stages' bytes per device and Table 1's text
    (fp16 parameters and gradients, K = 12)."""
    rows = []
    for n in degrees:
        per_stage = {s: model_state_bytes(num_params, n, s).total for s in PAPER_STAGES}
        rows.append({
            "dp": n,
            "bytes": {PAPER_STAGES[s]: b for s, b in per_stage.items()},
            "gb": {PAPER_STAGES[s]: paper_gb(b) for s, b in per_stage.items()},
        })  # fmt: skip
    return rows


def print_paper_table(num_params: int, degrees: list[int], as_json: bool) -> None:
    """Print `paper_rows` as a table (or JSON)."""
    rows = paper_rows(num_params, degrees)
    if as_json:
        print(json.dumps(rows, indent=1))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"ZeRO paper, Table 1: model states per device, Ψ = {num_params:,}, K = 12 (GB)",
        caption="(2 + 2 + K)Ψ split as each stage partitions it; the paper's rounding",
        min_width=80,
    )
    table.add_column("DP", justify="right")
    for name in PAPER_STAGES.values():
        table.add_column(name, justify="right")
    for r in rows:
        table.add_row(str(r["dp"]), *r["gb"].values())
    Console(width=max(Console().width, 100)).print(table)
