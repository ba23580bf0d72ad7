"""A seeded slice of first user turns: the stated filters, the same slice for a seed, a JSON array cut
mid-record read up to its last whole record, a training-format JSONL for regeneration to answer."""

import json

import pytest

from megatron_dflash.common.errors import DataError
from megatron_dflash.data.formats import read_records
from megatron_dflash.recipes.first_turns import FirstTurnFilter, looks_english, write_first_turns


class WordTokenizer:
    """One token per whitespace-separated word: lengths a test can count."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": list(range(len(text.split())))}


def _chat(i, first_role="human", text=None):
    text = text or f"how can you tell me what the number {i} is and why it is {'very ' * (i % 7)}odd"
    return {"id": f"c{i}", "conversations": [{"from": first_role, "value": text}, {"from": "gpt", "value": "an answer"}]}


@pytest.fixture
def sharegpt_file(tmp_path):
    """A ShareGPT array of 250 usable chats, 3 that the filter drops and one bad record, cut mid-record (two bad
    records of 255: under the default 1% of bad records that `BadRecords("skip")` accepts)."""
    chats = [_chat(i) for i in range(250)]
    chats += [_chat(1100, first_role="gpt"),  # opens with the assistant: no first user turn
              _chat(1101, text="¿Cómo puedo aprender a programar en Python rápidamente, y qué libros me ayudan?"),
              _chat(1102, text=chats[0]["conversations"][0]["value"]),  # a duplicate of the first text
              {"id": "bad", "conversations": []}]
    data = json.dumps(chats + [_chat(999)])
    path = tmp_path / "sharegpt.json"
    path.write_text(data[: data.rindex('{"id": "c999"') + 30])  # the last record cut in the middle
    return str(path)


def test_a_seed_draws_the_same_slice_of_english_first_turns(sharegpt_file, tmp_path):
    out = tmp_path / "prompts.jsonl"
    logged = []
    records = write_first_turns(sharegpt_file, str(out), 10, WordTokenizer(), seed=3, log=logged.append)
    assert any("c999" in line or "cut" in line or "skipped" in line for line in logged)
    again = write_first_turns(sharegpt_file, str(tmp_path / "again.jsonl"), 10, WordTokenizer(), seed=3,
                              log=lambda _: None)
    assert out.read_bytes() == (tmp_path / "again.jsonl").read_bytes()
    other = write_first_turns(sharegpt_file, str(tmp_path / "other.jsonl"), 10, WordTokenizer(), seed=4,
                              log=lambda _: None)
    assert [r.fields["id"] for r in other] != [r.fields["id"] for r in records]
    ids = [r.fields["id"] for r in records]
    assert len(set(ids)) == 10 and not {"c1100", "c1101", "c1102", "c999", "bad"} & set(ids)
    read = [record for _, _, record in read_records(str(out))]
    assert [r.messages for r in read] == [[{"role": "user", "content": r.messages[0]["content"]}] for r in records]
    assert all(r.fields["prompt_tokens"] == len(r.messages[0]["content"].split()) for r in read)


def test_length_bounds_are_in_target_tokens(sharegpt_file, tmp_path):
    rule = FirstTurnFilter(min_tokens=17, max_tokens=19)
    records = write_first_turns(sharegpt_file, str(tmp_path / "p.jsonl"), 5, WordTokenizer(), seed=0, rule=rule,
                                log=lambda _: None)
    assert all(17 <= r.fields["prompt_tokens"] <= 19 for r in records)
    with pytest.raises(DataError, match=r"only \d+ first user turns of 250 English ones are 17\.\.19 tokens long, "
                                        r"200 asked"):
        write_first_turns(sharegpt_file, str(tmp_path / "q.jsonl"), 200, WordTokenizer(), seed=0, rule=rule,
                          log=lambda _: None)
    assert not (tmp_path / "q.jsonl").exists()


def test_the_english_heuristic_as_stated():
    assert looks_english("What is the best way to learn Python?")
    assert not looks_english("Was ist der beste Weg, Python zu lernen?")  # ASCII, but none of the words
    assert not looks_english("什么是学习 Python 的最佳方法？ the and")  # the words, but not ASCII
