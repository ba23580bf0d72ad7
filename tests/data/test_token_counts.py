"""Choosing a reduced draft vocabulary (docs/design.md §20): counts over the loss-masked tokens only, the
special tokens always kept, ties broken by the smaller id, the same file from the same data and tokenizer; a file
whose fields do not hold what the tool writes refused in one line naming the file and the entry."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from megatron_dflash.common.errors import DataError
from megatron_dflash.data.samples import Sample
from megatron_dflash.data.token_counts import (
    DraftVocabFile,
    choose_draft_ids,
    count_label_tokens,
    special_token_ids,
    tokenizer_fingerprint,
)


class _Tokenizer:
    """The parts of a HF tokenizer the choice reads."""

    def __init__(self, words: int = 12, template: str = "t"):
        self.vocab = {f"w{i}": i for i in range(words)}
        self.all_special_ids = [0, 1]
        self.added_tokens_decoder = {11: "<|im_end|>"}
        self.chat_template = template

    def get_vocab(self):
        return dict(self.vocab)


def _samples(seed: int, count: int = 30, vocab: int = 12):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        ids = torch.randint(0, vocab, (int(torch.randint(3, 20, (1,), generator=gen)),), generator=gen)
        mask = torch.rand(ids.shape, generator=gen) < 0.6
        out.append(Sample(ids, mask, i))
    return out


def test_counts_are_those_of_the_loss_masked_tokens():
    data = _samples(0)
    counts = count_label_tokens(data, 12)
    plain = Counter(int(t) for s in data for t, m in zip(s.input_ids, s.loss_mask) if m)
    assert counts.tolist() == [plain.get(i, 0) for i in range(12)]
    assert int(counts.sum()) < sum(len(s) for s in data)  # the unmasked tokens are not counted


def test_choice_keeps_the_specials_then_the_most_frequent_with_ties_by_id():
    counts = torch.tensor([0, 0, 5, 9, 9, 1, 7, 7, 7, 0, 2, 0])
    ids = choose_draft_ids(counts, 6, keep=[0, 11])
    # kept 0 and 11; then 3 and 4 (9 each, 3 first), then 6 and 7 of the three 7s (8 left out: the larger id)
    assert ids.tolist() == [0, 3, 4, 6, 7, 11]
    # never-seen ids fill up by increasing id
    assert choose_draft_ids(torch.tensor([0, 4, 0, 0, 2]), 4).tolist() == [0, 1, 2, 4]
    with pytest.raises(ValueError, match="special tokens"):
        choose_draft_ids(counts, 1, keep=[0, 11])


def test_special_ids_are_the_tokenizers_and_the_mask():
    assert special_token_ids(_Tokenizer(), extra=[7, None]) == [0, 1, 7, 11]


def test_the_file_is_reproducible_and_reads_back(tmp_path):
    tokenizer = _Tokenizer()
    data = _samples(1)
    first = DraftVocabFile.build(count_label_tokens(data, 12), 6, [0, 1, 11], tokenizer)
    again = DraftVocabFile.build(count_label_tokens(_samples(1), 12), 6, [0, 1, 11], tokenizer)
    first.write(str(tmp_path / "a.json"))
    again.write(str(tmp_path / "b.json"))
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    read = DraftVocabFile.read(str(tmp_path / "a.json"))
    assert read == first and {0, 1, 11} <= set(read.ids) and 0 < read.coverage < 1
    # the coverage counts the supervised tokens of the data inside the chosen ids
    labels = [int(t) for s in data for t, m in zip(s.input_ids, s.loss_mask) if m]
    assert read.label_tokens == len(labels) and read.covered_tokens == sum(t in read.ids for t in labels)
    other = DraftVocabFile.build(count_label_tokens(_samples(2), 12), 6, [0, 1, 11], tokenizer)
    assert other.data_fingerprint != first.data_fingerprint
    assert tokenizer_fingerprint(_Tokenizer(template="u")) != first.tokenizer_fingerprint
    (tmp_path / "bad.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ValueError, match="not a draft vocabulary file"):
        DraftVocabFile.read(str(tmp_path / "bad.json"))


def _set(name, value):
    return lambda data: data.__setitem__(name, value)


def _set_id(index, value):
    return lambda data: data["ids"].__setitem__(index, value)


BAD_FILES = {  # name: (what is changed in a good file, what the one line says)
    "no-ids": (lambda data: data.pop("ids"), "no ids field"),
    "ids-not-a-list": (_set("ids", {"0": 0}), "ids is dict, not a list of token ids"),
    "string-id": (_set_id(2, "2"), "ids[2] is '2', not an integer token id"),
    "fractional-id": (_set_id(2, 5.5), "ids[2] is 5.5, not an integer token id"),
    "float-id": (_set_id(2, 5.0), "ids[2] is 5.0, not an integer token id"),
    "bool-id": (_set_id(0, False), "ids[0] is False, not an integer token id"),
    "out-of-range": (_set_id(-1, 12), "ids[5] is 12, outside [0, 12) (the target vocabulary)"),
    "negative": (_set_id(0, -1), "ids[0] is -1, outside [0, 12)"),
    "repeated": (lambda data: _set_id(3, data["ids"][2])(data), "ids[3] is 2, like entry 2: that maps two draft ids "
                                                                "to the same target id"),
    "unsorted": (lambda data: data["ids"].__setitem__(slice(2, 4), data["ids"][3:1:-1]),
                 "the ids must be in increasing order"),
    "size-disagrees": (_set("draft_vocab_size", 7), "holds 6 ids for draft_vocab_size 7"),
    "size-a-string": (_set("draft_vocab_size", "6"), "draft_vocab_size is '6', not an integer of at least 1"),
    "vocab-below-size": (_set("target_vocab_size", 5), "target_vocab_size 5 is below draft_vocab_size 6"),
    "kept-outside": (_set("kept_ids", [0, 1, 11, 12]), "kept_ids[3] is 12, outside [0, 12)"),
    "newer-version": (_set("version", 2), "version 2, but this package reads draft vocabulary files of version 1"),
    "fingerprint-a-number": (_set("tokenizer_fingerprint", 5), "tokenizer_fingerprint is 5, not a string"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_file_with_a_bad_field_is_refused_in_one_line_naming_it(tmp_path, case):
    good = DraftVocabFile.build(count_label_tokens(_samples(1), 12), 6, [0, 1, 11], _Tokenizer())
    good.write(str(tmp_path / "good.json"))
    data = json.loads((tmp_path / "good.json").read_text())
    change, said = BAD_FILES[case]
    assert data["ids"][:4] == [0, 1, 2, 3]  # what the cases change
    change(data)
    path = tmp_path / "vocab.json"
    path.write_text(json.dumps(data))
    with pytest.raises(DataError) as refused:
        DraftVocabFile.read(str(path))
    message = str(refused.value)
    assert message.startswith(f"{path}: ") and said in message and "\n" not in message, message
    assert message.endswith("count it again with tools/count_draft_vocab.py.")


def test_a_file_nested_too_deep_for_the_decoder_is_refused_in_one_line(tmp_path):
    path = tmp_path / "vocab.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(DataError, match="not a readable draft vocabulary file"):
        DraftVocabFile.read(str(path))
