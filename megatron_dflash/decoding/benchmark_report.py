"""Per-category acceptance tables of a decoding report, and two reports side by side.

`tools/evaluate_acceptance.py` writes one row per decoded prompt (a benchmark question's turn, one sample) with
its set, its category, the tokens each verify cycle committed, its generated tokens and its share of the
decoding time (and of the autoregressive baseline's). From those rows:

* `category_table`: per category, per turn (several-turn sets), then per set (category ``"all"``), each line
  keyed by (set, `kind`, category) with `kind` one of `KINDS` (a data category may be called ``"all"`` or
  ``"turn 2"`` too: it never meets the aggregate lines): the acceptance length over every cycle
  (`decoding.metric.decode_metric`, the repository's headline), the mean of the prompts' own acceptance lengths
  (what the DFlash evaluation prints), tokens per target forward, and the throughput speedup over the baseline;
* `format_category_table`: that table for the console;
* `compare_reports` / `format_comparison`: two reports' tables matched by (set, kind, category), with the
  differences (second minus first), for ``--compare``.

A report written before categories existed has rows without ``set`` / ``category``: they count as set
``"prompts"`` with no category (the set's total line only). A table written before lines had a `kind` is
computed again from the report's prompt rows, or, without them, given the kind its category name implies.
No torch here (docs/design.md §7 Module map).
"""

from __future__ import annotations

import math
import re
from typing import Optional, Sequence

from .metric import decode_metric

__all__ = ["ALL", "DEFAULT_SET", "KINDS", "CATEGORY", "TURN", "SET", "category_table", "format_category_table",
           "compare_reports", "format_comparison", "report_table", "line_kind", "line_key"]

ALL = "all"
"""The category of a set's total row."""
DEFAULT_SET = "prompts"
"""The set of rows that name none (a ``--prompts`` file)."""
CATEGORY, TURN, SET = "category", "turn", "set"
KINDS = (CATEGORY, TURN, SET)
"""What a table line totals: the rows of one data category, of one turn, or of the whole set."""
_NO_CATEGORY = "(none)"
"""The label of a set's rows that name no category, next to rows that do."""


def _mean(values: Sequence[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


def _ratio(numerator: float, denominator: float) -> Optional[float]:
    return numerator / denominator if denominator > 0 else None


def _group_row(set_name: str, kind: str, category: Optional[str], rows: Sequence[dict]) -> dict:
    """One line of the table: the rows of one (set, kind, category)."""
    metric = decode_metric([r["acceptance_lengths"] for r in rows], [r["generated_tokens"] for r in rows])
    out = {
        "set": set_name,
        "kind": kind,
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
    """Per set (in order of first appearance): a line per category (kind `CATEGORY`, in order of first
    appearance; rows naming none get a line of category None when others do), a line per turn when its
    questions have several (kind `TURN`, category ``"turn K"``: MT-Bench's second turns meet a longer context
    than the first), then the set's total line (kind `SET`, category `ALL`). Keys (set, kind, category) are
    unique whatever the categories are called."""
    sets: dict = {}
    for row in rows:
        categories = sets.setdefault(row.get("set") or DEFAULT_SET, {})
        categories.setdefault(row.get("category"), []).append(row)
    table = []
    for set_name, categories in sets.items():
        members = [r for group in categories.values() for r in group]
        if list(categories) != [None]:
            table.extend(_group_row(set_name, CATEGORY, c, group) for c, group in categories.items())
        turns = sorted({r["turn"] for r in members if r.get("turn") is not None})
        if len(turns) > 1:
            table.extend(_group_row(set_name, TURN, f"turn {t}", [r for r in members if r.get("turn") == t])
                         for t in turns)
        table.append(_group_row(set_name, SET, ALL, members))
    return table


def line_kind(line: dict) -> str:
    """The kind of a table line; for a line written before lines had one, what its category name implies."""
    if line.get("kind") in KINDS:
        return line["kind"]
    category = str(line.get("category"))
    return SET if category == ALL else TURN if re.fullmatch(r"turn \d+", category) else CATEGORY


def line_key(line: dict) -> tuple:
    """(set, kind, category): what identifies a table line (what `--compare` matches on)."""
    return line["set"], line_kind(line), line.get("category")


def _fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return format(value, spec) + suffix


_COLUMNS = (("prompts", "prompts", "d", ""), ("cycles", "cycles", "d", ""),
            ("acceptance_length", "accept len", ".2f", ""),
            ("mean_of_prompt_acceptance_lengths", "prompt mean", ".2f", ""),
            ("tokens_per_target_forward", "tok/fwd", ".2f", ""), ("speedup", "speedup", ".2f", "x"))


def _label(line: dict, aggregates: frozenset = frozenset()) -> str:
    """A line's name on the console: the set's total `SET (all)`, a turn `turn K`, a category its own name, quoted
    where it reads like one of the `aggregates` (the labels of the table's other lines) or is None."""
    kind = line_kind(line)
    if kind == SET:
        return f"{line['set']} (all)"
    category = line.get("category")
    if kind == TURN:
        return str(category)
    if category is None:
        return _NO_CATEGORY
    return f'"{category}"' if category in aggregates or category == _NO_CATEGORY else str(category)


def _aggregate_labels(lines: Sequence[dict]) -> frozenset:
    return frozenset({str(line.get("category")) for line in lines if line_kind(line) != CATEGORY}
                     | {f"{line['set']} (all)" for line in lines})


def format_category_table(table: Sequence[dict]) -> str:
    """The table as aligned text: one line per category, the set's total last."""
    aggregates = _aggregate_labels(table)
    width = max([len("category")] + [len(_label(line, aggregates)) for line in table])
    header = f"{'category':<{width}}" + "".join(f"  {title:>11}" for _, title, _, _ in _COLUMNS)
    lines = [header, "-" * len(header)]
    for line in table:
        lines.append(f"{_label(line, aggregates):<{width}}"
                     + "".join(f"  {_fmt(line[key], spec, suffix):>11}" for key, _, spec, suffix in _COLUMNS))
    return "\n".join(lines)


def report_table(report: dict) -> list:
    """A report's per-category table: the one it holds, or one computed from its prompt rows (also when its
    lines have no `kind`: written before a category could share a name with an aggregate line)."""
    lines = report.get("categories")
    if lines and (all("kind" in line for line in lines) or not report.get("prompts")):
        return lines
    return category_table(report.get("prompts", []))


_COMPARED = (("acceptance_length", "accept len"), ("tokens_per_target_forward", "tok/fwd"), ("speedup", "speedup"))


def compare_reports(first: dict, second: dict) -> list:
    """Lines matched by (set, kind, category) (`line_key`) over both reports' tables (the first's order, then the
    second's extra lines): per compared value, the first's, the second's and their difference (second - first;
    None where either is missing)."""
    a = {line_key(line): line for line in report_table(first)}
    b = {line_key(line): line for line in report_table(second)}
    out = []
    for key in list(a) + [k for k in b if k not in a]:
        entry = {"set": key[0], "kind": key[1], "category": key[2]}
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
    aggregates = _aggregate_labels(comparison)

    def label(entry: dict) -> str:
        name = _label(entry, aggregates)
        return f"{entry['set']}/{name}" if several and line_kind(entry) != SET else name

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
