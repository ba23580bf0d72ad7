"""Tests for megatron_dflash.data.datasets: the chat / text JSONL, indexed and synthetic datasets, hostile
records (one `DataError` line naming the file and line) and the record budget.
"""

from __future__ import annotations

import json
import os
import random
import re

import numpy as np
import pytest
import torch

from megatron_dflash.data.chat import tokenize_chat
from megatron_dflash.data.datasets import (
    CHARS_PER_TOKEN,
    ChatDataset,
    IndexedDataset,
    SyntheticChatDataset,
    TextDataset,
    record_budget,
)
from megatron_dflash.data.samples import stable_sample_id
from megatron_dflash.embedded_job import synthetic_corpus as sc
from data_records import MULTI_TURN


def _write_jsonl(path, records) -> str:
    with open(path, "w") as f:
        for r in records:
            f.write(r if isinstance(r, str) else json.dumps(r))
            f.write("\n")
    return str(path)


# --------------------------------------------------------------------------------------------------
# Datasets
# --------------------------------------------------------------------------------------------------


def test_chat_jsonl_dataset(tmp_path, tok, tok_plain):
    chats = [MULTI_TURN, *sc.conversations(3, 3)]
    lines = [{"messages": m} for m in chats]
    path = _write_jsonl(tmp_path / "chat.jsonl", lines[:2] + ["   "] + lines[2:])  # a blank line is skipped
    ds = ChatDataset(path, tok, seq_length=64)
    assert len(ds) == 4
    for i, messages in enumerate(chats):
        s = ds[i]
        ids, mask = tokenize_chat(tok, messages)
        assert s.input_ids.dtype == torch.int64 and s.loss_mask.dtype == torch.bool
        assert s.input_ids.tolist() == ids[:64] and s.loss_mask.tolist() == [bool(m) for m in mask[:64]]
    # Same data through the fallback template.
    plain = ChatDataset(path, tok_plain, seq_length=64)
    assert all(torch.equal(plain[i].loss_mask, ds[i].loss_mask) for i in range(len(ds)))
    # Truncation.
    short = ChatDataset(path, tok, seq_length=10)
    assert len(short[0]) == 10 and short[0].input_ids.tolist() == ds[0].input_ids[:10].tolist()
    # IDs: unique, reproducible, the documented hash of (kind, name, index, line), and path-independent.
    ids = [ds[i].sample_id for i in range(len(ds))]
    assert len(set(ids)) == len(ids) and all(0 <= x < 2**63 for x in ids)
    assert ids == [ChatDataset(path, tok, seq_length=64)[i].sample_id for i in range(len(ds))]
    assert ids[0] == stable_sample_id("chat", "chat.jsonl", 0, json.dumps(lines[0]).encode())
    os.makedirs(tmp_path / "moved")
    moved = _write_jsonl(tmp_path / "moved" / "chat.jsonl", lines)
    assert ids == [ChatDataset(moved, tok, seq_length=64)[i].sample_id for i in range(len(ds))]


def test_jsonl_errors(tmp_path, tok):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        ChatDataset(str(tmp_path / "nope.jsonl"), tok, 32)
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"messages": MULTI_TURN}, '{"messages": [', "{}"])
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: invalid JSON"):
        ChatDataset(bad, tok, 32)
    nomsg = _write_jsonl(tmp_path / "nomsg.jsonl", [{"messages": MULTI_TURN}, {"body": "hi"}])
    with pytest.raises(ValueError, match=r"nomsg\.jsonl:2: a record holds exactly one of 'messages'"):
        ChatDataset(nomsg, tok, 32)
    emptymsg = _write_jsonl(tmp_path / "emptymsg.jsonl", [{"messages": []}])
    with pytest.raises(ValueError, match=r"emptymsg\.jsonl:1: no messages"):
        ChatDataset(emptymsg, tok, 32)
    notobj = _write_jsonl(tmp_path / "list.jsonl", ["[1, 2]"])
    with pytest.raises(ValueError, match=r"list\.jsonl:1: expected a JSON object"):
        ChatDataset(notobj, tok, 32)
    empty = _write_jsonl(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(ValueError, match="no samples"):
        ChatDataset(empty, tok, 32)
    with pytest.raises(ValueError, match="no samples"):
        TextDataset(empty, tok, 32)
    notext = _write_jsonl(tmp_path / "notext.jsonl", [{"text": "a b"}, {"body": "a"}])
    with pytest.raises(ValueError, match=r"notext\.jsonl:2: a record holds exactly one of"):
        TextDataset(notext, tok, 32)
    with pytest.raises(ValueError, match="seq_length"):
        TextDataset(notext, tok, 0)


def test_text_jsonl_dataset(tmp_path, tok):
    texts = ["the cat is red", "count from 1 to 5 .", "a b c d e f g h i j"]
    path = _write_jsonl(tmp_path / "text.jsonl", [{"text": t} for t in texts])
    ds = TextDataset(path, tok, seq_length=8)
    assert len(ds) == 3
    for i, text in enumerate(texts):
        s = ds[i]
        expected = (tok(text)["input_ids"] + [tok.eos_token_id])[:8]
        assert s.input_ids.tolist() == expected
        assert s.loss_mask.all() and len(s) == len(expected)
    no_eos = TextDataset(path, tok, seq_length=8, append_eos=False)
    assert no_eos[0].input_ids.tolist() == tok(texts[0])["input_ids"]
    assert len({ds[i].sample_id for i in range(3)}) == 3


# --------------------------------------------------------------------------------------------------
# Hostile records: one DataError line naming the file and line, whatever is wrong
# --------------------------------------------------------------------------------------------------

GOOD_CHAT = {"messages": MULTI_TURN}
HOSTILE_CHATS = {  # record -> what the error must say
    "deep nesting": ('{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested deeper than the JSON parser"),
    "lone surrogate": ('{"messages": [{"role": "user", "content": "count \\ud800 to 3"}]}',
                       r"message 0 \(user\): the content is not valid Unicode \(a lone surrogate \\ud800"),
    "content null": ({"messages": [{"role": "user", "content": None}]}, r"message 0 \(user\): content is null"),
    "content dict": ({"messages": [MULTI_TURN[0], {"role": "assistant", "content": {"text": "3"}}]},
                     r"message 1 \(assistant\): content is an object"),
    "content number": ({"messages": [{"role": "user", "content": 3}]}, r"message 0 \(user\): content is a number"),
    "role null": ({"messages": [{"role": None, "content": "3 4"}]}, "message 0: role is null"),
    "role number": ({"messages": [MULTI_TURN[0], {"role": 2, "content": "3 4"}]}, "message 1: role is a number"),
    "role unknown": ({"messages": [MULTI_TURN[0], {"role": "narrator", "content": "3 4"}]},
                     r'message 1: role is "narrator", not one of the roles the chat template renders '
                     r"\(user, assistant\)"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_CHATS))
def test_hostile_chat_records_are_one_line_data_errors(tmp_path, tok, case):
    from megatron_dflash.common.errors import DataError

    record, what = HOSTILE_CHATS[case]
    path = _write_jsonl(tmp_path / "chats.jsonl", [GOOD_CHAT, "", record, GOOD_CHAT])
    with pytest.raises(DataError) as info:
        ChatDataset(path, tok, 32)
    message = str(info.value)
    assert "\n" not in message and len(message) < 300, message
    assert re.match(rf"{re.escape(path)}:3\b.*{what}", message), message  # line 3: 1-based, blank lines count
    # a record that was fine when the file was scanned and is not any more when it is read: the same error
    ds = ChatDataset(_write_jsonl(tmp_path / "later.jsonl", [GOOD_CHAT, "", GOOD_CHAT]), tok, 32)
    _write_jsonl(tmp_path / "later.jsonl", [GOOD_CHAT, "", record])
    with pytest.raises(DataError, match=rf"later\.jsonl:3\b.*{what}"):
        ds[1]


def test_hostile_text_records_are_one_line_data_errors(tmp_path, tok):
    from megatron_dflash.common.errors import DataError

    for record, what in (('{"text": "a \\udfff b"}', r"the text is not valid Unicode \(a lone surrogate \\udfff"),
                         ('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested deeper than")):
        path = _write_jsonl(tmp_path / "texts.jsonl", [{"text": "the cat"}, record])
        with pytest.raises(DataError, match=rf"^{re.escape(path)}:2: .*{what}"):
            TextDataset(path, tok, 32)


def test_whatever_fails_while_tokenising_a_record_names_it(tmp_path, tok):
    """The template's or the tokenizer's own exceptions become a `DataError` naming the file and line."""
    from megatron_dflash.common.errors import DataError

    strict = sc.build_tokenizer()  # a template that refuses a conversation (as templates may: jinja's raise)
    strict.chat_template = "{% if messages | length > 3 %}{{ raise_exception('at most 3 turns') }}{% endif %}" + \
        sc.CHAT_TEMPLATE
    path = _write_jsonl(tmp_path / "chats.jsonl", [{"messages": MULTI_TURN[:2]}, GOOD_CHAT])
    with pytest.raises(DataError, match=rf"^{re.escape(path)}:2: the chat template refuses the conversation "
                                        r"\(TemplateError: at most"):
        ChatDataset(path, strict, 32)  # refused when the data is scanned, before training
    ds = ChatDataset(_write_jsonl(tmp_path / "later.jsonl", [{"messages": MULTI_TURN[:2]}] * 2), strict, 32)
    assert len(ds[0]) > 0
    _write_jsonl(tmp_path / "later.jsonl", [{"messages": MULTI_TURN[:2]}, GOOD_CHAT])  # changed since the scan
    with pytest.raises(DataError, match=r"later\.jsonl:2: the chat template refuses the conversation \(TemplateE"):
        ds[1]

    class Refusing:  # a tokenizer that raises on some input, like a real one on text it cannot encode
        eos_token_id = tok.eos_token_id

        def __call__(self, text):
            if "dog" in text:
                raise TypeError("TextEncodeInput must be Union[TextInputSequence, Tuple[InputSequence, InputSequence]]")
            return tok(text)

    path = _write_jsonl(tmp_path / "texts.jsonl", [{"text": "the cat"}, {"text": "the dog"}])
    ds = TextDataset(path, Refusing(), 32)
    assert len(ds[0]) > 0
    with pytest.raises(DataError, match=rf"^{re.escape(path)}:2: cannot tokenise the record \(TypeError: TextEncode"):
        ds[1]


def test_hostile_prompts_are_one_line_prompt_errors(tmp_path, tok):
    """Evaluation prompt files refuse the same records as the training data, naming the file and line."""
    from megatron_dflash.data.prompts import PromptError, read_prompt_file, tokenize_prompt

    cases = [HOSTILE_CHATS[case] for case in sorted(HOSTILE_CHATS)] + [
        ('{"text": "count \\ud800 to 3"}', r"cannot tokenise the prompt \(TypeError: "),  # the tokenizer's own
        (b'{"text": "caf\xe9"}', r"not UTF-8 text \(invalid continuation byte at byte 13\)"),
    ]
    path = tmp_path / "prompts.jsonl"
    for record, what in cases:
        if not isinstance(record, bytes):
            record = (record if isinstance(record, str) else json.dumps(record)).encode()
        path.write_bytes(b'{"text": "count from 1 to 4"}\n\n' + record + b"\n")
        with pytest.raises(PromptError) as info:
            [tokenize_prompt(item, tok) for item in read_prompt_file(str(path))]
        message = str(info.value)
        assert "\n" not in message and re.match(rf"{re.escape(str(path))}:3\b.*{what}", message), message


# --------------------------------------------------------------------------------------------------
# Huge records: at most record_budget(seq_length) characters are tokenised
# --------------------------------------------------------------------------------------------------

_WORDS = ("the of and to in is was for on that with as by at from this be are or an it not which have had but their "
          "were one all been they has more will would there can when who what so about if out into only data model "
          "token sequence train café naïve über 数据 模型 don't it's we'll 3.14 2024 100000 x_1 f(x) "
          "--flag").split()
# the pre-tokenizer pattern of Llama-3 / Qwen-2.5 style byte-level BPE (digits in threes, punctuation with newlines)
_LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                   r"\s*[\r\n]+|\s+(?!\S)|\s+")
_CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% generation %}"
           "{{ m['content'] }}<|im_end|>{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>{% endif %}\n"
           "{% endfor %}")


def _ordinary_text(rng: random.Random, length: int) -> str:
    """Sentences of English-like words, numbers, code and other scripts, with spaces, newlines and indents."""
    parts, size = [], 0
    while size < length:
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 15)))
        parts.append(words + rng.choice(".!?:;,") + rng.choice([" ", " ", " ", "\n", "\n\n", "  ", "\n    "]))
        size += len(parts[-1])
    return "".join(parts)


@pytest.fixture(scope="module", params=["gpt2", "llama3"])
def tok_bpe(request):
    """A byte-level BPE tokenizer trained on `_ordinary_text`, pre-tokenized like GPT-2 or Llama-3, with a
    ChatML template with generation markers."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    if request.param == "gpt2":
        core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        core.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    core.decoder = decoders.ByteLevel()
    rng = random.Random(0)
    core.train_from_iterator([_ordinary_text(rng, 2000) for _ in range(100)], trainers.BpeTrainer(
        vocab_size=1500, special_tokens=["<|im_start|>", "<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    t = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|im_end|>",
                                additional_special_tokens=["<|im_start|>"])
    t.chat_template = _CHATML
    return t


def test_text_cut_to_the_budget_keeps_the_tokens_of_the_whole_text(tmp_path, tok_bpe):
    rng = random.Random(1)
    texts = [_ordinary_text(rng, rng.randint(3500, 9000)) for _ in range(24)]
    path = _write_jsonl(tmp_path / "long.jsonl", [{"text": t} for t in texts])
    for seq_length in (16, 57, 100):
        said = []
        ds = TextDataset(path, tok_bpe, seq_length, log=said.append)
        for i, text in enumerate(texts):
            whole = tok_bpe(text)["input_ids"]
            assert len(whole) > seq_length and len(text) > record_budget(seq_length)
            assert ds[i].input_ids.tolist() == whole[:seq_length], (seq_length, i)
            ds[i]
        # every text was cut (each said so once, not once per read), and each cut still filled the sequence
        assert len(said) == len(texts) and all(f"long.jsonl:{i + 1}: the text of {len(texts[i])} characters cut to"
                                               in said[i] and "only" not in said[i] for i in range(len(texts)))


def test_chat_cut_to_the_budget_keeps_tokens_and_mask(tmp_path, tok, tok_plain, tok_bpe):
    """The kept tokens and their loss mask are those of the whole chat, with the cut in a user or an assistant
    turn, many turns dropped, through generation markers and through rendered prefixes."""
    rng = random.Random(2)
    words = lambda n: " ".join(rng.choice(sc.WORDS + sc.ANIMALS + sc.NUMBERS) for _ in range(n))  # noqa: E731
    chats = [
        [{"role": "user", "content": words(800)}, {"role": "assistant", "content": words(20)}],
        [{"role": "user", "content": words(5)}, {"role": "assistant", "content": words(900)},
         {"role": "user", "content": words(5)}, {"role": "assistant", "content": words(5)}],
        [{"role": ("user", "assistant")[j % 2], "content": words(rng.randint(1, 6))} for j in range(400)],
    ]
    path = _write_jsonl(tmp_path / "long_chats.jsonl", [{"messages": c} for c in chats])
    for tokenizer in (tok, tok_plain, tok_bpe):
        for seq_length in (48, 100):
            said = []
            ds = ChatDataset(path, tokenizer, seq_length, log=said.append)
            for i, chat in enumerate(chats):
                ids, mask = tokenize_chat(tok if tokenizer is tok_plain else tokenizer, chat)  # the whole chat
                assert ds[i].input_ids.tolist() == ids[:seq_length]
                assert ds[i].loss_mask.tolist() == [bool(m) for m in mask[:seq_length]]
                assert i != 1 or (any(mask[:seq_length]) and not all(mask[:seq_length]))  # cut in the answer
            assert len(said) == len(chats) and all("chat's" in line and "only" not in line for line in said)


def test_a_huge_record_is_tokenised_only_to_the_budget(tmp_path, tok, monkeypatch):
    """What the tokenizer and the template are handed is bounded by the sequence length, not the record;
    a cut that leaves fewer tokens than the sequence holds says so."""
    text = "count from 1 to 5 . " * 20_000  # 400 k characters
    chat = [{"role": "user", "content": text}, {"role": "assistant", "content": text}] + \
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}] * 20_000
    seen = []
    render = type(tok).apply_chat_template

    def spy_render(self, messages, **kwargs):
        seen.append((len(messages), sum(len(m["content"]) for m in messages)))
        return render(self, messages, **kwargs)

    monkeypatch.setattr(type(tok), "apply_chat_template", spy_render)
    path = _write_jsonl(tmp_path / "huge.jsonl", [{"messages": chat}])
    said = []
    sample = ChatDataset(path, tok, 48, log=said.append)[0]
    budget = record_budget(48)
    assert seen and all(n <= budget // CHARS_PER_TOKEN and chars <= budget for n, chars in seen), seen
    assert sample.input_ids.tolist() == tokenize_chat(tok, chat[:2])[0][:48]
    assert len(said) == 1 and f"the chat's {2 * len(text) + 40_000} characters of content in 40002 messages" in said[0]

    class Spy:
        eos_token_id = tok.eos_token_id

        def __call__(self, text):
            seen.append(len(text))
            return tok(text)

    seen.clear()
    unknown = "x" * 100_000  # one word the vocabulary does not know: one token, however long
    path = _write_jsonl(tmp_path / "huge_text.jsonl", [{"text": text}, {"text": unknown}])
    said = []
    ds = TextDataset(path, Spy(), 48, log=said.append)
    assert ds[0].input_ids.tolist() == tok(text)["input_ids"][:48] and max(seen) <= budget
    assert ds[1].input_ids.tolist() == [tok.unk_token_id]  # not followed by EOS: the record does not end there
    assert len(said) == 2 and f"huge_text.jsonl:2: the text of 100000 characters cut to {budget} characters" in said[1]
    assert "they give only 1 of the 48 tokens a sample holds" in said[1]


def _write_indexed(prefix: str, documents: list[list[list[int]]]) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for sequences in documents:
        for seq in sequences:
            builder.add_item(torch.tensor(seq, dtype=torch.int32))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def _ranks_indexed_dataset(rank: int, world_size: int, directory: str) -> dict:
    prefix = os.path.join(directory, f"rank{rank}", "corpus_text_document")
    os.makedirs(os.path.dirname(prefix))
    _write_indexed(prefix, [[[5, 6, 7]], [[1, 2], [3, 4, 5]], [list(range(50))]])
    ds = IndexedDataset(prefix, seq_length=8)
    out = {
        "len": len(ds),
        "ids": [ds[i].input_ids.tolist() for i in range(len(ds))],
        "dtypes_ok": all(ds[i].input_ids.dtype == torch.int64 and ds[i].loss_mask.dtype == torch.bool
                         for i in range(len(ds))),
        "all_loss": all(bool(ds[i].loss_mask.all()) for i in range(len(ds))),
        "sample_ids": [ds[i].sample_id for i in range(len(ds))],
    }
    try:
        IndexedDataset(os.path.join(directory, "missing"), seq_length=8)
    except FileNotFoundError as err:
        out["missing"] = str(err)
    return out


def test_indexed_dataset(tmp_path, tp_pool):
    # Runs on the pool's ranks: they have megatron imported already, this process may not (saves ~10 s).
    for out in tp_pool(2).run(_ranks_indexed_dataset, str(tmp_path)):
        assert out["len"] == 3
        assert out["ids"] == [[5, 6, 7], [1, 2, 3, 4, 5], list(range(8))]  # sequences concatenated; truncated
        assert out["dtypes_ok"] and out["all_loss"]
        assert out["sample_ids"] == [stable_sample_id("indexed", "corpus_text_document", i) for i in range(3)]
        assert len(set(out["sample_ids"])) == 3
        assert "missing.idx" in out["missing"]


def test_synthetic_chat_dataset(tok):
    ds = SyntheticChatDataset(5, 40, tok, seq_length=48)
    again = SyntheticChatDataset(5, 40, tok, seq_length=48)
    held_out = SyntheticChatDataset(6, 40, tok, seq_length=48)
    assert len(ds) == 40
    for i in (0, 17, 39):
        assert torch.equal(ds[i].input_ids, again[i].input_ids) and ds[i].sample_id == again[i].sample_id
        assert 0 < len(ds[i]) <= 48 and ds[i].loss_mask.any()
    ids = {ds[i].sample_id for i in range(40)}
    assert len(ids) == 40 and not ids & {held_out[i].sample_id for i in range(40)}
    assert [ds[i].input_ids.tolist() for i in range(40)] != [held_out[i].input_ids.tolist() for i in range(40)]


def test_an_answer_cut_at_max_new_tokens_is_trained_open(tmp_path, tok, tok_bpe):
    """A regenerated record whose last answer was cut (``finish_reason`` "length") ends where the answer's
    content ends: the end of turn the template adds is a stop the target never made. A finished one ("stop",
    or no finish reason) keeps it; so does a record whose cut answer has a later turn (its end of turn was in
    the prompt the target answered next)."""
    records = [{"messages": MULTI_TURN, "finish_reason": "length"}, {"messages": MULTI_TURN, "finish_reason": "stop"},
               {"messages": MULTI_TURN}, {"messages": MULTI_TURN + [MULTI_TURN[0]], "finish_reason": "length"}]
    path = _write_jsonl(tmp_path / "regenerated.jsonl", records)
    for tokenizer in (tok, tok_bpe):
        end = tokenizer.convert_tokens_to_ids("<|end|>" if tokenizer is tok else "<|im_end|>")
        ds = ChatDataset(path, tokenizer, seq_length=96)
        for i, record in enumerate(records):
            ids, mask = tokenize_chat(tokenizer, record["messages"])
            if i == 0:  # everything from the last end of turn on goes
                last_end = len(ids) - 1 - ids[::-1].index(end)
                ids, mask = ids[:last_end], mask[:last_end]
                assert tokenizer.decode(ids).endswith("c a t")
            assert ds[i].input_ids.tolist() == ids, (tokenizer, i)
            assert ds[i].loss_mask.tolist() == [bool(m) for m in mask]
