"""Per-category tables of a decoding report and two reports side by side. The oracle is the arithmetic itself,
written out here over hand-made rows (the cycles of each prompt, its tokens, its share of the time)."""

from megatron_dflash.decoding.benchmark_report import (
    category_table,
    compare_reports,
    format_category_table,
    format_comparison,
)


def _row(category, cycles, spec_seconds=1.0, ar_seconds=2.0, set_name="mt-bench"):
    generated = 1 + sum(cycles)
    return {"set": set_name, "category": category, "acceptance_lengths": cycles, "generated_tokens": generated,
            "mean_acceptance_length": sum(cycles) / len(cycles) if cycles else None,
            "spec_seconds": spec_seconds, "autoregressive_seconds": ar_seconds, "autoregressive_tokens": generated}


ROWS = [_row("writing", [4, 2]), _row("math", [1, 1, 1], 0.5, 0.5), _row("writing", [3], 2.0, 1.0), _row("math", [])]


def test_each_category_and_the_set_from_its_own_rows():
    table = category_table(ROWS)
    assert [(line["set"], line["category"]) for line in table] == [("mt-bench", "writing"), ("mt-bench", "math"),
                                                                  ("mt-bench", "all")]
    writing, math, total = table
    assert writing["prompts"] == 2 and writing["cycles"] == 3
    assert writing["acceptance_length"] == (4 + 2 + 3) / 3  # over every cycle
    assert writing["mean_of_prompt_acceptance_lengths"] == (3.0 + 3.0) / 2  # over the prompts' own means
    assert writing["tokens_per_target_forward"] == (7 + 4) / ((1 + 2) + (1 + 1))
    # throughput ratio: (11 tokens / 3 s) over (11 tokens / 3 s)
    assert writing["speedup"] == (11 / 3.0) / (11 / 3.0)
    assert math["acceptance_length"] == 1.0 and math["mean_of_prompt_acceptance_lengths"] == 1.0  # None left out
    assert math["speedup"] == (5 / 1.5) / (5 / 2.5)
    assert total["prompts"] == 4 and total["cycles"] == 6
    assert total["acceptance_length"] == (4 + 2 + 3 + 1 + 1 + 1) / 6
    assert total["tokens_per_target_forward"] == (7 + 4 + 4 + 1) / (3 + 4 + 2 + 1)


def test_several_turns_get_a_line_each():
    rows = [{**_row("writing", [4, 2]), "turn": 1}, {**_row("writing", [1, 1]), "turn": 2},
            {**_row("math", [3]), "turn": 1}]
    table = {line["category"]: line for line in category_table(rows)}
    assert list(table) == ["writing", "math", "turn 1", "turn 2", "all"]
    assert table["turn 1"]["acceptance_length"] == (4 + 2 + 3) / 3 and table["turn 1"]["prompts"] == 2
    assert table["turn 2"]["acceptance_length"] == 1.0 and table["turn 2"]["prompts"] == 1
    assert "turn 1" not in {line["category"] for line in category_table(rows[::2])}  # one turn: no turn lines


def test_no_baseline_no_speedup_and_rows_without_a_category():
    rows = [{k: v for k, v in _row("x", [2]).items() if k not in ("set", "category", "autoregressive_seconds")}]
    (line,) = category_table(rows)
    assert (line["set"], line["category"], line["speedup"], line["acceptance_length"]) == ("prompts", "all", None, 2.0)


def test_the_console_table_shows_the_numbers():
    text = format_category_table(category_table(ROWS))
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["category", "prompts", "cycles"]
    assert lines[2].split() == ["writing", "2", "3", "3.00", "3.00", "2.20", "1.00x"]
    assert lines[-1].startswith("mt-bench (all)") and lines[-1].split()[2:5] == ["4", "6", "2.00"]


def test_two_reports_side_by_side_with_the_differences():
    first = {"prompts": ROWS}
    second = {"categories": category_table([_row("writing", [4, 4]), _row("coding", [2])])}
    comparison = {(e["set"], e["category"]): e for e in compare_reports(first, second)}
    assert comparison[("mt-bench", "writing")]["acceptance_length"] == (3.0, 4.0, 1.0)
    assert comparison[("mt-bench", "math")]["acceptance_length"] == (1.0, None, None)
    assert comparison[("mt-bench", "coding")]["acceptance_length"] == (None, 2.0, None)
    a, b, d = comparison[("mt-bench", "all")]["tokens_per_target_forward"]
    assert (a, b) == (16 / 10, (9 + 3) / (3 + 2)) and d == b - a
    text = format_comparison(compare_reports(first, second), "old.json", "new.json")
    assert text.splitlines()[:2] == ["A: old.json", "B: new.json"]
    writing = next(line for line in text.splitlines() if line.startswith("writing"))
    assert writing.split()[:4] == ["writing", "3.00", "4.00", "+1.00"]


def test_categories_named_like_the_aggregate_lines_stay_lines_of_their_own():
    """Data categories called "all" and "turn 2" next to a two-turn set's turn lines and its total: every line's
    (set, kind, category) is unique, each totals its own rows, and --compare matches each with its own."""
    rows = [{**_row("all", [4, 4]), "turn": 1}, {**_row("all", [1]), "turn": 2},
            {**_row("turn 2", [2, 2]), "turn": 1}, {**_row("turn 2", [3]), "turn": 2}]
    table = category_table(rows)
    keys = [(line["set"], line["kind"], line["category"]) for line in table]
    assert keys == [("mt-bench", "category", "all"), ("mt-bench", "category", "turn 2"), ("mt-bench", "turn", "turn 1"),
                    ("mt-bench", "turn", "turn 2"), ("mt-bench", "set", "all")]
    data_all, data_turn_2, _, turn_2, total = table
    assert data_all["prompts"] == 2 and data_all["acceptance_length"] == (4 + 4 + 1) / 3
    assert data_turn_2["prompts"] == 2 and data_turn_2["acceptance_length"] == (2 + 2 + 3) / 3
    assert turn_2["prompts"] == 2 and turn_2["acceptance_length"] == (1 + 3) / 2
    assert total["prompts"] == 4 and total["cycles"] == 6

    second = [{**r, "acceptance_lengths": [c + 1 for c in r["acceptance_lengths"]]} for r in rows]
    comparison = compare_reports({"prompts": rows}, {"categories": category_table(second)})
    assert [(e["set"], e["kind"], e["category"]) for e in comparison] == keys
    assert comparison[0]["acceptance_length"] == (9 / 3, 12 / 3, 1.0)  # the data category "all", not the set
    assert comparison[3]["acceptance_length"] == (2.0, 3.0, 1.0)      # the turn line, not the category "turn 2"
    labels = [line.split("  ")[0].strip() for line in format_category_table(table).splitlines()[2:]]
    assert labels == ['"all"', '"turn 2"', "turn 1", "turn 2", "mt-bench (all)"]
    compared = [line.split("  ")[0].strip() for line in format_comparison(comparison, "a", "b").splitlines()[4:]]
    assert compared == labels


def test_a_table_written_before_lines_had_a_kind_is_computed_again_from_its_rows():
    rows = [{**_row("all", [4, 4]), "turn": 1}, {**_row("x", [1]), "turn": 2}]
    old = [{k: v for k, v in line.items() if k != "kind"} for line in category_table(rows)]
    comparison = compare_reports({"prompts": rows, "categories": old}, {"prompts": rows})
    assert [(e["kind"], e["category"]) for e in comparison] == [("category", "all"), ("category", "x"),
                                                              ("turn", "turn 1"), ("turn", "turn 2"), ("set", "all")]
    alone = compare_reports({"categories": old[2:]}, {"categories": old[2:]})  # no rows: kinds from the names
    assert [(e["kind"], e["category"]) for e in alone] == [("turn", "turn 1"), ("turn", "turn 2"), ("set", "all")]
