"""Per-category acceptance tables of a decoding report, and two reports side by side.

`tools/evaluate_acceptance.py` writes one row per decoded prompt (a benchmark question's turn, one sample) with
its set, its category, the tokens each verify cycle committed, its generated tokens and its share of the
decoding time (and of the autoregressive baseline's). From those rows:

* `category_table`: per category, per turn (several-turn sets), then per set (category ``"all"``): the
  acceptance length over every cycle
  (`decoding.metric.decode_metric`, the repository's headline), the mean of the prompts' own acceptance lengths
  (what the DFlash evaluation prints), tokens per target forward, and the throughput speedup over the baseline;
* `format_category_table`: that table for the console;
* `compare_reports` / `format_comparison`: two reports' tables matched by (set, category), with the
  differences (second minus first), for ``--compare``.

A report written before categories existed has rows without ``set`` / ``category``: they count as set
``"prompts"``, category ``"all"``. No torch here (docs/design.md §7 Module map).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from .metric import decode_metric

__all__ = ["ALL", "DEFAULT_SET", "category_table", "format_category_table", "compare_reports", "format_comparison",
           "report_table"]

ALL = "all"
"""The category of a set's total row."""
DEFAULT_SET = "prompts"
"""The set of rows that name none (a ``--prompts`` file)."""


def _mean(values: Sequence[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


def _ratio(numerator: float, denominator: float) -> Optional[float]:
    return numerator / denominator if denominator > 0 else None


def _group_row(set_name: str, category: str, rows: Sequence[dict]) -> dict:
    """One line of the table: the rows of one (set, category), or of a whole set."""
    metric = decode_metric([r["acceptance_lengths"] for r in rows], [r["generated_tokens"] for r in rows])
    out = {
        "set": set_name,
        "category": category,
        "prompts": len(rows),
        "cycles": metric["cycles"],
        "acceptance_length": metric["acceptance_length"],
        "mean_of_prompt_acceptance_lengths": _mean(
            [r["mean_acceptance_length"] for r in rows if r.get("mean_acceptance_length") is not None]),
        "generated_tokens": metric["generated_tokens"],
        "target_forwards": metric["target_forwards"],
        "tokens_per_target_forward": metric["tokens_per_target_forward"],
        "speedup": None,
    }
    spec_seconds = [r.get("spec_seconds") for r in rows]
    ar_seconds = [r.get("autoregressive_seconds") for r in rows]
    ar_tokens = [r.get("autoregressive_tokens") for r in rows]
    if all(v is not None for v in spec_seconds + ar_seconds + ar_tokens):
        spec_tps = _ratio(metric["generated_tokens"], sum(spec_seconds))
        ar_tps = _ratio(sum(ar_tokens), sum(ar_seconds))
        out["speedup"] = spec_tps / ar_tps if spec_tps is not None and ar_tps else None
    return out


def category_table(rows: Sequence[dict]) -> list:
    """Per set (in order of first appearance): a line per category (in order of first appearance), a line per
    turn when its questions have several (category ``"turn K"``: MT-Bench's second turns meet a longer context
    than the first), then the set's total line (category `ALL`)."""
    sets: dict = {}
    for row in rows:
        categories = sets.setdefault(row.get("set") or DEFAULT_SET, {})
        categories.setdefault(row.get("category") or ALL, []).append(row)
    table = []
    for set_name, categories in sets.items():
        members = [r for group in categories.values() for r in group]
        if list(categories) != [ALL]:
            table.extend(_group_row(set_name, c, group) for c, group in categories.items())
        turns = sorted({r["turn"] for r in members if r.get("turn") is not None})
        if len(turns) > 1:
            table.extend(_group_row(set_name, f"turn {t}", [r for r in members if r.get("turn") == t])
                         for t in turns)
        table.append(_group_row(set_name, ALL, members))
    return table


def _fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return format(value, spec) + suffix


_COLUMNS = (("prompts", "prompts", "d", ""), ("cycles", "cycles", "d", ""),
            ("acceptance_length", "accept len", ".2f", ""),
            ("mean_of_prompt_acceptance_lengths", "prompt mean", ".2f", ""),
            ("tokens_per_target_forward", "tok/fwd", ".2f", ""), ("speedup", "speedup", ".2f", "x"))


def _label(line: dict) -> str:
    return f"{line['set']} (all)" if line["category"] == ALL else line["category"]


def format_category_table(table: Sequence[dict]) -> str:
    """The table as aligned text: one line per category, the set's total last."""
    width = max([len("category")] + [len(_label(line)) for line in table])
    header = f"{'category':<{width}}" + "".join(f"  {title:>11}" for _, title, _, _ in _COLUMNS)
    lines = [header, "-" * len(header)]
    for line in table:
        lines.append(f"{_label(line):<{width}}"
                     + "".join(f"  {_fmt(line[key], spec, suffix):>11}" for key, _, spec, suffix in _COLUMNS))
    return "\n".join(lines)


def report_table(report: dict) -> list:
    """A report's per-category table: the one it holds, or one computed from its prompt rows."""
    return report.get("categories") or category_table(report.get("prompts", []))


_COMPARED = (("acceptance_length", "accept len"), ("tokens_per_target_forward", "tok/fwd"), ("speedup", "speedup"))


def compare_reports(first: dict, second: dict) -> list:
    """Lines matched by (set, category) over both reports' tables (the first's order, then the second's extra
    lines): per compared value, the first's, the second's and their difference (second - first; None where
    either is missing)."""
    a = {(line["set"], line["category"]): line for line in report_table(first)}
    b = {(line["set"], line["category"]): line for line in report_table(second)}
    out = []
    for key in list(a) + [k for k in b if k not in a]:
        entry = {"set": key[0], "category": key[1]}
        for field, _ in _COMPARED:
            x = a[key][field] if key in a else None
            y = b[key][field] if key in b else None
            entry[field] = (x, y, y - x if x is not None and y is not None else None)
        out.append(entry)
    return out


def format_comparison(comparison: Sequence[dict], first_name: str, second_name: str) -> str:
    """Two reports side by side: per line, each compared value in the first, the second, and the difference
    (categories named ``set/category`` when the reports hold several sets)."""
    several = len({e["set"] for e in comparison}) > 1

    def label(entry: dict) -> str:
        return f"{entry['set']}/{entry['category']}" if several and entry["category"] != ALL else _label(entry)

    width = max([len("category")] + [len(label(e)) for e in comparison])
    head = f"{'category':<{width}}" + "".join(f"  {title + ' A':>13}  {title + ' B':>13}  {'diff':>7}"
                                             for _, title in _COMPARED)
    lines = [f"A: {first_name}", f"B: {second_name}", head, "-" * len(head)]
    for entry in comparison:
        cells = []
        for field, _ in _COMPARED:
            x, y, d = entry[field]
            suffix = "x" if field == "speedup" else ""
            cells.append(f"  {_fmt(x, '.2f', suffix):>13}  {_fmt(y, '.2f', suffix):>13}  {_fmt(d, '+.2f'):>7}")
        lines.append(f"{label(entry):<{width}}" + "".join(cells))
    return "\n".join(lines)
