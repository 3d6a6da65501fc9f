"""The run's outputs: `gpu_check.json` (everything, rewritten after every check) and
`gpu_check.md` (one table, printed last). Standard library only: the driver uses it."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

__all__ = ["format_value", "markdown", "summary", "write_outputs"]

_STATUS_MARK = {
    "pass": "pass",
    "fail": "**FAIL**",
    "error": "**ERROR**",
    "crashed": "**CRASHED**",
    "timeout": "**TIMEOUT**",
    "finding": "finding",
    "below goal": "below goal",
    "skipped": "skipped",
    "not run": "not run",
}


def format_value(value: Any, unit: str) -> str:
    """A number as the table shows it, by unit."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if unit == "rel err":
        return "0" if value == 0 else f"{value:.1e}"
    if unit == "×":
        return f"{value:.2f}×"
    if unit == "%":
        return f"{value:.1f}%"
    if unit in ("s", "ms", "µs", "ns"):
        return f"{value:.3g} {unit}"
    if unit:
        return f"{value:.4g} {unit}"
    return f"{value:.4g}"


def _limit(row: dict[str, Any]) -> str:
    if row["limit"] is None:
        return ""
    text = format_value(row["limit"], row["unit"])
    if row["kind"] == "check":
        return f"≤ {text}"
    return f"goal {text}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(meta: dict[str, Any], results: dict[str, dict[str, Any]], order: list[str]) -> str:
    """The table: one line per measurement, the check's name and status on its first line."""
    lines = [
        f"GPU check, {meta.get('mode', '?')}: {meta.get('device', '?')}; "
        f"torch {meta.get('torch', '?')}, CUDA {meta.get('cuda', '?')}; "
        f"{meta.get('started', '')}; {meta.get('elapsed_s', 0):.0f} s of {meta.get('budget_s', 0):.0f} s",
        "",
        "| check | status | measurement | value | limit | s |",
        "|---|---|---|---|---|---|",
    ]
    findings: list[str] = []
    for name in order:
        res = results.get(name)
        if res is None:
            lines.append(f"| {name} | pending |  |  |  |  |")
            continue
        status = _STATUS_MARK.get(res["status"], res["status"])
        seconds = f"{res.get('seconds', 0):.1f}"
        rows = list(res.get("rows", []))
        first = True
        if res.get("error"):
            error = res["error"].splitlines()[0][:300]
            lines.append(f"| {name} | {status} | {_cell(error)} |  |  | {seconds} |")
            first = False
        for row in rows:
            head = (name, status, seconds) if first else ("", "", "")
            if row["kind"] == "skip":
                what, value = row["what"], row["note"]
            else:
                what = row["what"] + (f" ({row['note']})" if row["note"] else "")
                value = format_value(row["value"], row["unit"])
                if row["ok"] is False:
                    value = f"**{value}**"
            lines.append(
                f"| {head[0]} | {head[1]} | {_cell(what)} | {_cell(value)} | {_limit(row)} | "
                f"{head[2]} |"
            )
            first = False
        if first:
            lines.append(f"| {name} | {status} |  |  |  | {seconds} |")
        findings += [f"- {name}: {f}" for f in res.get("findings", [])]
    if findings:
        lines += ["", "Findings (what minispeed cannot do on CUDA yet, or does wrongly):", ""]
        lines += findings
    return "\n".join(lines) + "\n"


def summary(results: dict[str, dict[str, Any]], order: list[str]) -> str:
    """One line per check (printed after the table, so the end of a long output holds it):
    the status, the seconds, and the first failing or goal-missing row."""
    lines = ["Summary:"]
    for name in order:
        res = results.get(name, {"status": "pending"})
        worst = next((r for r in res.get("rows", []) if r["ok"] is False), None)
        detail = res.get("error", "").splitlines()[0] if res.get("error") else ""
        if worst is not None and not detail:
            value = format_value(worst["value"], worst["unit"])
            why = _limit(worst) or worst["note"]
            detail = f"{worst['what']}: {value} ({why})"
        lines.append(
            f"  {name:24} {res['status']:10} {res.get('seconds', 0):6.1f} s  {detail[:110]}"
        )
    return "\n".join(lines) + "\n"


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_outputs(
    out: Path, meta: dict[str, Any], results: dict[str, dict[str, Any]], order: list[str]
) -> str:
    """Write gpu_check.json and gpu_check.md under `out` (each atomically); returns the table."""
    out.mkdir(parents=True, exist_ok=True)
    doc = {"meta": meta, "checks": [{"name": n, **results[n]} for n in order if n in results]}
    _atomic_write(out / "gpu_check.json", json.dumps(doc, indent=1, default=str) + "\n")
    table = markdown(meta, results, order)
    _atomic_write(out / "gpu_check.md", table)
    return table
