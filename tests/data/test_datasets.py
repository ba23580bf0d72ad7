"""Tests for megatron_dflash.data.datasets: datasets, packing, collation, the sampler and Megatron GPT batches.

Oracles are written independently of the implementation: the assistant mask from token strings, packing
invariants from first principles, sampler coverage by counting.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections import Counter

import numpy as np
import pytest
import torch

from megatron_dflash.data import datasets as D
from megatron_dflash.embedded_job import synthetic_corpus as sc

MULTI_TURN = [
    {"role": "user", "content": "count from 3 to 7"},
    {"role": "assistant", "content": "3 4 5 6 7"},
    {"role": "user", "content": "spell the word cat"},
    {"role": "assistant", "content": "c a t"},
]


@pytest.fixture(scope="module")
def tok():
    return sc.build_tokenizer()


@pytest.fixture(scope="module")
def tok_plain():
    """The same tokenizer with a template that has no {% generation %} markers."""
    t = sc.build_tokenizer()
    t.chat_template = sc.CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    return t


def _expected_assistant_mask(tokens: list[str]) -> list[int]:
    """Oracle: after each <|assistant|> header, everything up to and including the next <|end|>."""
    mask, inside = [], False
    for t in tokens:
        if t == "<|assistant|>":
            mask.append(0)
            inside = True
        elif inside:
            mask.append(1)
            inside = t != "<|end|>"
        else:
            mask.append(0)
    return mask


def _write_jsonl(path, records) -> str:
    with open(path, "w") as f:
        for r in records:
            f.write(r if isinstance(r, str) else json.dumps(r))
            f.write("\n")
    return str(path)


def _sample(ids, mask=None, sid=0):
    ids = torch.as_tensor(ids, dtype=torch.int64)
    mask = torch.ones_like(ids, dtype=torch.bool) if mask is None else torch.as_tensor(mask, dtype=torch.bool)
    return D.Sample(ids, mask, sid)


# --------------------------------------------------------------------------------------------------
# Chat tokenisation
# --------------------------------------------------------------------------------------------------


def test_chat_mask_covers_assistant_turns(tok):
    for messages in [MULTI_TURN, *sc.conversations(7, 5)]:
        ids, mask = D.tokenize_chat(tok, messages)
        tokens = tok.convert_ids_to_tokens(ids)
        assert mask == _expected_assistant_mask(tokens)
        assert sum(mask) > 0
    # The supervised text of the multi-turn chat is exactly the two answers and their end tokens.
    ids, mask = D.tokenize_chat(tok, MULTI_TURN)
    picked = [t for t, m in zip(tok.convert_ids_to_tokens(ids), mask) if m]
    assert picked == "3 4 5 6 7 <|end|> c a t <|end|>".split()


def test_prefix_fallback_matches_generation_markers(tok, tok_plain):
    assert D.template_has_generation_markers(tok)
    assert not D.template_has_generation_markers(tok_plain)
    chats = [MULTI_TURN, [MULTI_TURN[1]] + MULTI_TURN[2:], *sc.conversations(11, 12)]  # incl. assistant first
    for messages in chats:
        reference = D.tokenize_chat(tok, messages, assistant_mask="template")
        assert D.tokenize_chat(tok_plain, messages) == reference  # "auto" falls back to prefixes
        assert D.tokenize_chat(tok_plain, messages, assistant_mask="prefix") == reference
        assert D.tokenize_chat(tok, messages, assistant_mask="prefix") == reference
    with pytest.raises(ValueError, match="generation"):
        D.tokenize_chat(tok_plain, MULTI_TURN, assistant_mask="template")


def test_prefix_fallback_rejects_non_incremental_template():
    t = sc.build_tokenizer()
    # The message count at the start changes with every prefix: prefixes are not token prefixes.
    t.chat_template = "{{ messages | length }} " + sc.CHAT_TEMPLATE.replace("{% generation %}", "").replace(
        "{% endgeneration %}", "")
    with pytest.raises(ValueError, match="incrementally"):
        D.tokenize_chat(t, MULTI_TURN)


# --------------------------------------------------------------------------------------------------
# Datasets
# --------------------------------------------------------------------------------------------------


def test_chat_jsonl_dataset(tmp_path, tok, tok_plain):
    chats = [MULTI_TURN, *sc.conversations(3, 3)]
    lines = [{"messages": m} for m in chats]
    path = _write_jsonl(tmp_path / "chat.jsonl", lines[:2] + ["   "] + lines[2:])  # a blank line is skipped
    ds = D.ChatJSONLDataset(path, tok, seq_length=64)
    assert len(ds) == 4
    for i, messages in enumerate(chats):
        s = ds[i]
        ids, mask = D.tokenize_chat(tok, messages)
        assert s.input_ids.dtype == torch.int64 and s.loss_mask.dtype == torch.bool
        assert s.input_ids.tolist() == ids[:64] and s.loss_mask.tolist() == [bool(m) for m in mask[:64]]
    # Same data through the fallback template.
    plain = D.ChatJSONLDataset(path, tok_plain, seq_length=64)
    assert all(torch.equal(plain[i].loss_mask, ds[i].loss_mask) for i in range(len(ds)))
    # Truncation.
    short = D.ChatJSONLDataset(path, tok, seq_length=10)
    assert len(short[0]) == 10 and short[0].input_ids.tolist() == ds[0].input_ids[:10].tolist()
    # IDs: unique, reproducible, the documented hash of (kind, name, index, line), and path-independent.
    ids = [ds[i].sample_id for i in range(len(ds))]
    assert len(set(ids)) == len(ids) and all(0 <= x < 2**63 for x in ids)
    assert ids == [D.ChatJSONLDataset(path, tok, seq_length=64)[i].sample_id for i in range(len(ds))]
    assert ids[0] == D.stable_sample_id("chat", "chat.jsonl", 0, json.dumps(lines[0]).encode())
    os.makedirs(tmp_path / "moved")
    moved = _write_jsonl(tmp_path / "moved" / "chat.jsonl", lines)
    assert ids == [D.ChatJSONLDataset(moved, tok, seq_length=64)[i].sample_id for i in range(len(ds))]


def test_jsonl_errors(tmp_path, tok):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        D.ChatJSONLDataset(str(tmp_path / "nope.jsonl"), tok, 32)
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"messages": MULTI_TURN}, '{"messages": [', "{}"])
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: invalid JSON"):
        D.ChatJSONLDataset(bad, tok, 32)
    nomsg = _write_jsonl(tmp_path / "nomsg.jsonl", [{"messages": MULTI_TURN}, {"text": "hi"}])
    with pytest.raises(ValueError, match=r"nomsg\.jsonl:2 .*no messages"):
        D.ChatJSONLDataset(nomsg, tok, 32)
    emptymsg = _write_jsonl(tmp_path / "emptymsg.jsonl", [{"messages": []}])
    with pytest.raises(ValueError, match=r"emptymsg\.jsonl:1 .*no messages"):
        D.ChatJSONLDataset(emptymsg, tok, 32)
    notobj = _write_jsonl(tmp_path / "list.jsonl", ["[1, 2]"])
    with pytest.raises(ValueError, match=r"list\.jsonl:1: expected a JSON object"):
        D.ChatJSONLDataset(notobj, tok, 32)
    empty = _write_jsonl(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(ValueError, match="no samples"):
        D.ChatJSONLDataset(empty, tok, 32)
    with pytest.raises(ValueError, match="no samples"):
        D.TextJSONLDataset(empty, tok, 32)
    notext = _write_jsonl(tmp_path / "notext.jsonl", [{"text": "a b"}, {"body": "a"}])
    with pytest.raises(ValueError, match=r"notext\.jsonl:2: no text"):
        D.TextJSONLDataset(notext, tok, 32)
    with pytest.raises(ValueError, match="seq_length"):
        D.TextJSONLDataset(notext, tok, 0)


def test_text_jsonl_dataset(tmp_path, tok):
    texts = ["the cat is red", "count from 1 to 5 .", "a b c d e f g h i j"]
    path = _write_jsonl(tmp_path / "text.jsonl", [{"body": t} for t in texts])
    ds = D.TextJSONLDataset(path, tok, seq_length=8, text_key="body")
    assert len(ds) == 3
    for i, text in enumerate(texts):
        s = ds[i]
        expected = (tok(text)["input_ids"] + [tok.eos_token_id])[:8]
        assert s.input_ids.tolist() == expected
        assert s.loss_mask.all() and len(s) == len(expected)
    no_eos = D.TextJSONLDataset(path, tok, seq_length=8, text_key="body", append_eos=False)
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
        D.ChatJSONLDataset(path, tok, 32)
    message = str(info.value)
    assert "\n" not in message and len(message) < 300, message
    assert re.match(rf"{re.escape(path)}:3\b.*{what}", message), message  # line 3: 1-based, blank lines count
    # a record that was fine when the file was scanned and is not any more when it is read: the same error
    ds = D.ChatJSONLDataset(_write_jsonl(tmp_path / "later.jsonl", [GOOD_CHAT, "", GOOD_CHAT]), tok, 32)
    _write_jsonl(tmp_path / "later.jsonl", [GOOD_CHAT, "", record])
    with pytest.raises(DataError, match=rf"later\.jsonl:3\b.*{what}"):
        ds[1]


def test_roles_follow_the_chat_template(tok):
    # the tiny template renders every role but the user's as the assistant's: it has no system or tool role
    assert D.chat_roles(tok) == ("user", "assistant")
    t = sc.build_tokenizer()
    t.chat_template = ("{% for m in messages %}{% if m['role'] in ['user', 'system', 'tool'] %}<|user|> "
                       "{{ m['content'] }} <|end|> {% else %}<|assistant|> {% generation %}{{ m['content'] }} <|end|>"
                       "{% endgeneration %} {% endif %}{% endfor %}")
    assert D.chat_roles(t) == ("system", "user", "assistant", "tool")


def test_hostile_text_records_are_one_line_data_errors(tmp_path, tok):
    from megatron_dflash.common.errors import DataError

    for record, what in (('{"text": "a \\udfff b"}', r"the text is not valid Unicode \(a lone surrogate \\udfff"),
                         ('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested deeper than")):
        path = _write_jsonl(tmp_path / "texts.jsonl", [{"text": "the cat"}, record])
        with pytest.raises(DataError, match=rf"^{re.escape(path)}:2: .*{what}"):
            D.TextJSONLDataset(path, tok, 32)


def test_whatever_fails_while_tokenising_a_record_names_it(tmp_path, tok):
    """The template's or the tokenizer's own exceptions become a `DataError` naming the file and line."""
    from megatron_dflash.common.errors import DataError

    strict = sc.build_tokenizer()  # a template that refuses a conversation (as templates may: jinja's raise)
    strict.chat_template = "{% if messages | length > 3 %}{{ raise_exception('at most 3 turns') }}{% endif %}" + \
        sc.CHAT_TEMPLATE
    path = _write_jsonl(tmp_path / "chats.jsonl", [{"messages": MULTI_TURN[:2]}, GOOD_CHAT])
    ds = D.ChatJSONLDataset(path, strict, 32)
    assert len(ds[0]) > 0
    with pytest.raises(DataError, match=rf"^{re.escape(path)}:2: cannot tokenise the record \(TemplateError: at most"):
        ds[1]

    class Refusing:  # a tokenizer that raises on some input, like a real one on text it cannot encode
        eos_token_id = tok.eos_token_id

        def __call__(self, text):
            if "dog" in text:
                raise TypeError("TextEncodeInput must be Union[TextInputSequence, Tuple[InputSequence, InputSequence]]")
            return tok(text)

    path = _write_jsonl(tmp_path / "texts.jsonl", [{"text": "the cat"}, {"text": "the dog"}])
    ds = D.TextJSONLDataset(path, Refusing(), 32)
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
        ds = D.TextJSONLDataset(path, tok_bpe, seq_length, log=said.append)
        for i, text in enumerate(texts):
            whole = tok_bpe(text)["input_ids"]
            assert len(whole) > seq_length and len(text) > D.record_budget(seq_length)
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
            ds = D.ChatJSONLDataset(path, tokenizer, seq_length, log=said.append)
            for i, chat in enumerate(chats):
                ids, mask = D.tokenize_chat(tok if tokenizer is tok_plain else tokenizer, chat)  # the whole chat
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
    sample = D.ChatJSONLDataset(path, tok, 48, log=said.append)[0]
    budget = D.record_budget(48)
    assert seen and all(n <= budget // D.CHARS_PER_TOKEN and chars <= budget for n, chars in seen), seen
    assert sample.input_ids.tolist() == D.tokenize_chat(tok, chat[:2])[0][:48]
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
    ds = D.TextJSONLDataset(path, Spy(), 48, log=said.append)
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
    ds = D.IndexedDataset(prefix, seq_length=8)
    out = {
        "len": len(ds),
        "ids": [ds[i].input_ids.tolist() for i in range(len(ds))],
        "dtypes_ok": all(ds[i].input_ids.dtype == torch.int64 and ds[i].loss_mask.dtype == torch.bool
                         for i in range(len(ds))),
        "all_loss": all(bool(ds[i].loss_mask.all()) for i in range(len(ds))),
        "sample_ids": [ds[i].sample_id for i in range(len(ds))],
    }
    try:
        D.IndexedDataset(os.path.join(directory, "missing"), seq_length=8)
    except FileNotFoundError as err:
        out["missing"] = str(err)
    return out


def test_indexed_dataset(tmp_path, tp_pool):
    # Runs on the pool's ranks: they have megatron imported already, this process may not (saves ~10 s).
    for out in tp_pool(2).run(_ranks_indexed_dataset, str(tmp_path)):
        assert out["len"] == 3
        assert out["ids"] == [[5, 6, 7], [1, 2, 3, 4, 5], list(range(8))]  # sequences concatenated; truncated
        assert out["dtypes_ok"] and out["all_loss"]
        assert out["sample_ids"] == [D.stable_sample_id("indexed", "corpus_text_document", i) for i in range(3)]
        assert len(set(out["sample_ids"])) == 3
        assert "missing.idx" in out["missing"]


def test_synthetic_chat_dataset(tok):
    ds = D.SyntheticChatDataset(5, 40, tok, seq_length=48)
    again = D.SyntheticChatDataset(5, 40, tok, seq_length=48)
    held_out = D.SyntheticChatDataset(6, 40, tok, seq_length=48)
    assert len(ds) == 40
    for i in (0, 17, 39):
        assert torch.equal(ds[i].input_ids, again[i].input_ids) and ds[i].sample_id == again[i].sample_id
        assert 0 < len(ds[i]) <= 48 and ds[i].loss_mask.any()
    ids = {ds[i].sample_id for i in range(40)}
    assert len(ids) == 40 and not ids & {held_out[i].sample_id for i in range(40)}
    assert [ds[i].input_ids.tolist() for i in range(40)] != [held_out[i].input_ids.tolist() for i in range(40)]


def test_sample_ids_are_stable_golden_values(tok):
    # Pinned: changing the hash changes every plan of every run (and breaks exact resumption).
    assert D.stable_sample_id("chat", "x.jsonl", 3, b'{"a": 1}') == 3706432689276645088
    assert D.stable_sample_id("synthetic-chat", 0, 0) == 8849768050157614828
    assert D.stable_sample_id("packed", 1, 2) == 1977666467192771840
    assert D.stable_sample_id("ab", "c") != D.stable_sample_id("a", "bc")
    assert D.SyntheticChatDataset(0, 1, tok, 32)[0].sample_id == 8849768050157614828
    many = {D.stable_sample_id("synthetic-chat", 0, i) for i in range(20000)}
    assert len(many) == 20000


# --------------------------------------------------------------------------------------------------
# Packing and collation
# --------------------------------------------------------------------------------------------------


def test_pack_first_fit_example():
    lengths = [6, 5, 3, 4, 2]
    samples = [_sample(list(range(10 * i, 10 * i + n)), sid=100 + i) for i, n in enumerate(lengths)]
    rows = D.pack_samples(samples, 8)
    assert [r.sample_ids for r in rows] == [(100, 104), (101, 102), (103,)]
    assert rows[2].sample_id == 103  # a single document keeps its own ID
    assert rows[0].sample_id == D.stable_sample_id("packed", 100, 104)
    assert rows[0].document_ids.tolist() == [0] * 6 + [1] * 2
    assert rows[0].position_ids.tolist() == list(range(6)) + [0, 1]


def test_pack_invariants():
    rng = random.Random(0)
    for trial in range(30):
        seq_length = rng.randint(4, 40)
        samples = []
        for i in range(rng.randint(1, 25)):
            n = rng.randint(1, seq_length + 5)  # some longer than seq_length: truncated
            samples.append(_sample([rng.randrange(1000) for _ in range(n)], [rng.random() < 0.7 for _ in range(n)],
                                   sid=rng.randrange(2**63)))
        rows = D.pack_samples(samples, seq_length)
        again = D.pack_samples(samples, seq_length)
        assert [(r.sample_ids, r.input_ids.tolist(), r.sample_id) for r in rows] == \
               [(r.sample_ids, r.input_ids.tolist(), r.sample_id) for r in again]
        by_id = {s.sample_id: s for s in samples}
        placed = []
        for row in rows:
            assert 1 <= len(row) <= seq_length
            docs = row.document_ids.tolist()
            # document ids contiguous, 0..k-1 in order
            assert docs[0] == 0 and all(b - a in (0, 1) for a, b in zip(docs, docs[1:]))
            assert docs[-1] == len(row.sample_ids) - 1
            start = 0
            for d, sid in enumerate(row.sample_ids):
                n = docs.count(d)
                src = by_id[sid]
                assert row.input_ids[start:start + n].tolist() == src.input_ids[:seq_length].tolist()
                assert row.loss_mask[start:start + n].tolist() == src.loss_mask[:seq_length].tolist()
                assert row.position_ids[start:start + n].tolist() == list(range(n))  # positions reset
                assert n == min(len(src), seq_length)  # nothing lost beyond truncation
                start += n
            placed.extend(row.sample_ids)
            # within a row, documents keep the input order
            order = [next(i for i, s in enumerate(samples) if s.sample_id == sid) for sid in row.sample_ids]
            assert order == sorted(order)
        assert Counter(placed) == Counter(s.sample_id for s in samples)  # every document exactly once
        # first fit: no later row could have taken a document that opened a new row
        sizes = [0] * len(rows)
        row_of = {sid: r for r, row in enumerate(rows) for sid in row.sample_ids}
        for s in samples:
            r = row_of[s.sample_id]
            n = min(len(s), seq_length)
            assert all(sizes[q] + n > seq_length for q in range(r))
            sizes[r] += n


def test_collate_unpacked_and_packed():
    samples = [_sample([11, 12, 13], [0, 1, 1], sid=7), _sample([21, 22], sid=8), _sample(list(range(30, 40)), sid=9)]
    b = D.collate(samples, pad_id=0, seq_length=6)
    assert set(b) == {"tokens", "loss_mask", "position_ids", "document_ids", "sample_ids"}
    assert b["tokens"].dtype == torch.int64 and b["loss_mask"].dtype == torch.bool
    assert b["sample_ids"].dtype == torch.int64 and b["sample_ids"].tolist() == [7, 8, 9]
    assert b["tokens"].tolist() == [[11, 12, 13, 0, 0, 0], [21, 22, 0, 0, 0, 0], [30, 31, 32, 33, 34, 35]]
    assert b["loss_mask"].tolist()[0] == [False, True, True, False, False, False]
    assert b["document_ids"].tolist()[1] == [0, 0, -1, -1, -1, -1]
    assert b["position_ids"].tolist() == [list(range(6))] * 3
    p = D.Collator(pad_id=0, seq_length=6, pack_sequences=True)(samples)
    assert p["tokens"].shape == (2, 6)
    assert p["tokens"].tolist() == [[11, 12, 13, 21, 22, 0], [30, 31, 32, 33, 34, 35]]
    assert p["document_ids"].tolist() == [[0, 0, 0, 1, 1, -1], [0] * 6]
    assert p["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2], list(range(6))]
    assert p["loss_mask"].tolist()[0] == [False, True, True, True, True, False]
    assert p["sample_ids"].tolist() == [D.stable_sample_id("packed", 7, 8), 9]
    with pytest.raises(ValueError, match="no tokens"):
        D.collate([_sample([], sid=1)], 0, 4)


# --------------------------------------------------------------------------------------------------
# Sampler
# --------------------------------------------------------------------------------------------------


class _Counting:
    def __init__(self, n):
        self.n, self.reads = n, 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.reads += 1
        return i


def _step_samples(ds, step, dp_size, **kw):
    per_rank = []
    for r in range(dp_size):
        it = D.MicroBatchIterator(ds, dp_rank=r, dp_size=dp_size, start_step=step, **kw)
        per_rank.append([x for _ in range(it.num_micro_batches) for x in next(it)])
    return per_rank


@pytest.mark.parametrize("n", [24, 20])
def test_sampler_covers_every_sample_once_per_epoch(n):
    ds = _Counting(n)
    kw = dict(micro_batch_size=2, global_batch_size=8, seed=3)
    stream = []
    for step in range(3 * n // 8 + 1):
        ranks = _step_samples(ds, step, 2, **kw)
        if n % 8 == 0:  # a step inside one epoch: the DP ranks see different samples
            assert not set(ranks[0]) & set(ranks[1])
        # Megatron's layout: micro-batch m of the step is rank 0's M samples, then rank 1's
        for m in range(2):
            stream += ranks[0][2 * m:2 * m + 2] + ranks[1][2 * m:2 * m + 2]
    for e in range(3):
        assert sorted(stream[e * n:(e + 1) * n]) == list(range(n)), f"epoch {e}"
    assert stream[:n] != stream[n:2 * n]  # a new order every epoch
    # Another seed gives another order.
    other = _step_samples(ds, 0, 2, micro_batch_size=2, global_batch_size=8, seed=4)
    assert other != _step_samples(ds, 0, 2, **kw)


def test_sampler_resumes_exactly():
    ds = _Counting(37)
    kw = dict(micro_batch_size=3, global_batch_size=12, dp_rank=1, dp_size=2, seed=9,
              collate_fn=lambda xs: list(xs))
    full = D.MicroBatchIterator(ds, **kw)
    assert full.num_micro_batches == 2
    reference = [next(full) for _ in range(2 * 20)]
    for k in (0, 1, 3, 7, 19):
        resumed = D.MicroBatchIterator(ds, start_step=k, **kw)
        assert resumed.consumed_samples == 12 * k
        assert [next(resumed) for _ in range(2 * (20 - k))] == reference[2 * k:]
    # Resuming far away reads only the samples it yields.
    ds.reads = 0
    far = D.MicroBatchIterator(ds, start_step=10**9, **kw)
    next(far)
    assert ds.reads == 3 and far.step == 10**9 and far.micro == 1
    assert far.epoch_of(10**9) == 12 * 10**9 // 37


def test_sampler_validation():
    ds = _Counting(10)
    divisible = r"global_batch_size=10 must be divisible by micro_batch_size \* dp_size = 2 \* 2 = 4"
    with pytest.raises(ValueError, match=divisible):
        D.MicroBatchIterator(ds, micro_batch_size=2, global_batch_size=10, dp_rank=0, dp_size=2, seed=0)
    with pytest.raises(ValueError, match="dp_rank=2 must be < dp_size=2"):
        D.MicroBatchIterator(ds, micro_batch_size=2, global_batch_size=8, dp_rank=2, dp_size=2, seed=0)
    with pytest.raises(ValueError, match="micro_batch_size"):
        D.MicroBatchIterator(ds, micro_batch_size=0, global_batch_size=8, dp_rank=0, dp_size=2, seed=0)
    with pytest.raises(ValueError, match="empty"):
        D.MicroBatchIterator(_Counting(0), micro_batch_size=1, global_batch_size=1, dp_rank=0, dp_size=1, seed=0)


def test_sampler_with_collator_on_synthetic_data(tok):
    ds = D.SyntheticChatDataset(1, 32, tok, seq_length=64)
    it = D.MicroBatchIterator(ds, micro_batch_size=4, global_batch_size=8, dp_rank=0, dp_size=1, seed=0,
                              collate_fn=D.Collator(tok.pad_token_id, 64))
    batch = next(it)
    assert batch["tokens"].shape == (4, 64)
    idx = it.micro_batch_indices(0, 0)
    assert batch["sample_ids"].tolist() == [ds[i].sample_id for i in idx]
    assert (batch["tokens"][~(batch["document_ids"] >= 0)] == tok.pad_token_id).all()


# --------------------------------------------------------------------------------------------------
# Megatron GPT batches
# --------------------------------------------------------------------------------------------------


def test_content_sample_ids():
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 50, (6, 32), generator=gen)
    tokens[3] = tokens[1]
    ids = D.content_sample_ids(tokens)
    assert ids.dtype == torch.int64 and (ids >= 0).all()
    assert ids[3] == ids[1] and len(set(ids.tolist())) == 5
    perm = torch.tensor([5, 2, 0, 4, 1, 3])
    assert torch.equal(D.content_sample_ids(tokens[perm]), ids[perm])  # row-wise only
    swapped = tokens.clone()
    swapped[0, [0, 1]] = swapped[0, [1, 0]]
    assert tokens[0, 0] == tokens[0, 1] or D.content_sample_ids(swapped)[0] != ids[0]  # order matters
    assert torch.equal(D.content_sample_ids(tokens), ids)


def test_from_megatron_gpt_batch():
    eod = 9
    tokens = torch.tensor([[1, 2, eod, 3, 4, 5, eod, 6], [7, 7, 7, 7, 7, 7, 7, 7]])
    # reset_position_ids on row 0; label-aligned loss mask with eod_mask_loss (prediction from EOD masked)
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0], list(range(8))])
    megatron_mask = torch.tensor([[1, 1, 0, 1, 1, 1, 0, 1], [1, 1, 1, 1, 1, 0, 0, 0]], dtype=torch.float)
    batch = {"tokens": tokens, "labels": torch.roll(tokens, -1, 1), "loss_mask": megatron_mask,
             "position_ids": position_ids}
    out = D.from_megatron_gpt_batch(batch)
    assert out["loss_mask"].tolist() == [[False, True, True, False, True, True, True, False],
                                         [False, True, True, True, True, True, False, False]]
    assert out["document_ids"].tolist() == [[0, 0, 0, 1, 1, 1, 1, 2], [0] * 8]
    assert torch.equal(out["sample_ids"], D.content_sample_ids(tokens)) and "labels" in out
    # without position resets, EOD tokens split the documents
    flat = dict(batch, position_ids=torch.arange(8).expand(2, 8))
    assert D.from_megatron_gpt_batch(flat, eod_token_id=eod)["document_ids"].tolist()[0] == [0, 0, 0, 1, 1, 1, 1, 2]
    given = D.from_megatron_gpt_batch(dict(batch, sample_ids=torch.tensor([4, 5])))
    assert given["sample_ids"].tolist() == [4, 5]
