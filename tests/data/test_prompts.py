"""Prompt files: a limited subset of a prompt file spreads over its categories as a benchmark's does."""

import json

from megatron_dflash.data.prompts import read_prompt_file, spread_over_categories


def test_spread_takes_each_category_in_turn_and_keeps_file_order():
    items = list("aaabbc")
    assert spread_over_categories(items, 4, lambda c: c) == list("aabc")
    assert spread_over_categories(items, 2, lambda c: c) == list("ab")
    assert spread_over_categories(items, None, lambda c: c) == items
    assert spread_over_categories(items, 10, lambda c: c) == items
    numbered = list(enumerate("cbacba"))
    assert spread_over_categories(numbered, 3, lambda p: p[1]) == numbered[:3]
    assert spread_over_categories(numbered, 4, lambda p: p[1]) == numbered[:4]


def test_a_prompt_file_limit_spreads_over_its_categories(tmp_path):
    lines = [{"text": f"{name} {k}", "category": name} for name in ("count", "spell", "repeat") for k in range(4)]
    lines += [{"text": "no category"}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    got = read_prompt_file(str(path), limit=5)
    assert [item.record["text"] for item in got] == ["count 0", "count 1", "spell 0", "repeat 0", "no category"]
    assert [item.where for item in got] == [f"{path}:{n}" for n in (1, 2, 5, 9, 13)]
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps({"text": str(k)}) + "\n" for k in range(6)))
    assert [item.record["text"] for item in read_prompt_file(str(plain), limit=2)] == ["0", "1"]
