"""Tests for megatron_dflash.data.formats and the record datasets over it: every file format and record format
gives the same samples, bad records are named with their file and line and skipped or fatal, the writers
round-trip.

The fixture files are written here (no downloads); Parquet and ``save_to_disk`` directories need the optional
``datasets`` package (those tests are skipped without it) and are written with pyarrow / ``datasets`` itself,
not with the writers under test.
"""

from __future__ import annotations

import gzip
import json
import sys

import pytest

from megatron_dflash.common.errors import DataError
from megatron_dflash.data.chat import tokenize_chat
from megatron_dflash.data.datasets import BadRecords, ChatDataset, TextDataset
from megatron_dflash.data.formats import NormalizedRecord, normalize_record, open_records, read_records, write_records

from data_records import MULTI_TURN

CHATS = [
    MULTI_TURN,
    [{"role": "user", "content": "spell the word cat"}, {"role": "assistant", "content": "c a t"}],
]
TEXT = "count from 1 to 5 ."
SHAREGPT_FROM = {"user": "human", "assistant": "gpt", "system": "system"}


def _openai(chat):
    return {"messages": chat}


def _openai_parts(chat):
    """Content as a list of text parts, split in two."""
    return {"messages": [dict(m, content=[{"type": "text", "text": m["content"][:2]},
                                         {"type": "text", "text": m["content"][2:]}]) for m in chat]}


def _sharegpt(chat):
    return {"conversations": [{"from": SHAREGPT_FROM[m["role"]], "value": m["content"]} for m in chat]}


def _records():
    """Every record format; what each must normalize to."""
    records = [_openai(CHATS[0]), _sharegpt(CHATS[1]), _openai_parts(CHATS[0]), {"text": TEXT}]
    expected = [CHATS[0], CHATS[1], CHATS[0], None]
    return records, expected


def _write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def _check_samples(ds, tok, expected, seq_length):
    assert len(ds) == len(expected)
    for i, chat in enumerate(expected):
        sample = ds[i]
        if chat is None:
            ids = (tok(TEXT)["input_ids"] + [tok.eos_token_id])[:seq_length]
            assert sample.input_ids.tolist() == ids and sample.loss_mask.all()
        else:
            ids, mask = tokenize_chat(tok, chat)
            assert sample.input_ids.tolist() == ids[:seq_length]
            assert sample.loss_mask.int().tolist() == mask[:seq_length]


def test_records_are_detected_one_by_one():
    records, expected = _records()
    for record, chat in zip(records, expected):
        got = normalize_record(record, "f:1")
        assert (got.messages, got.text) == ((chat, None) if chat is not None else (None, TEXT))
    shared = normalize_record({"conversations": [{"role": "user", "content": "a"}]}, "f:1")  # OpenAI turns
    assert shared.messages == [{"role": "user", "content": "a"}]
    thinking = normalize_record({"conversations": [{"from": "gpt", "value": "a", "reasoning_content": "r"}]}, "f")
    assert thinking.messages == [{"role": "assistant", "content": "a", "reasoning_content": "r"}]


@pytest.mark.parametrize("record, what", [
    ({"prompt": "a"}, "exactly one of 'messages' .* this one has none"),
    ({"messages": MULTI_TURN, "text": "a"}, "this one has messages and text"),
    ({"conversations": [{"from": "narrator", "value": "a"}]}, "turn 0: 'from' is \"narrator\", not one of human"),
    ({"conversations": [{"value": "a"}]}, "turn 0 must be an object with a 'from'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
     "message 0: content part 0 is 'image_url', not a text part"),
    ({"text": 3}, "no text .*got a number"),
    ({"conversations": []}, "no messages"),
    ([1, 2], "expected a JSON object"),
])
def test_records_of_no_format_are_named(record, what):
    with pytest.raises(DataError, match=rf"^f:7: .*{what}"):
        normalize_record(record, "f:7")


def _write_files(tmp_path, records):
    """The records as JSONL and as a JSON array; their paths."""
    jsonl = _write_jsonl(tmp_path / "data.jsonl", records)
    array = tmp_path / "data.json"
    array.write_text(json.dumps(records))
    return [jsonl, str(array)]


def test_every_file_format_gives_the_same_samples(tmp_path, tok):
    records, expected = _records()
    paths = _write_files(tmp_path, records)
    folder = tmp_path / "folder"
    folder.mkdir()
    _write_jsonl(folder / "a.jsonl", records[:2])
    (folder / "b.json").write_text(json.dumps(records[2:]))
    (folder / "notes.txt").write_text("not data")
    for path in paths + [str(folder)]:
        ds = ChatDataset(path, tok, 64)
        _check_samples(ds, tok, expected, 64)
    jsonl_ids = [s.sample_id for s in ChatDataset(paths[0], tok, 64)]
    assert len(set(jsonl_ids)) == len(jsonl_ids)
    got = list(read_records(str(folder)))
    assert [(f.rsplit("/", 1)[-1], k) for f, k, _ in got] == [("a.jsonl", 1), ("a.jsonl", 2), ("b.json", 0),
                                                             ("b.json", 1)]
    assert [r.messages for _, _, r in got] == expected


def test_arrow_files_give_the_same_samples(tmp_path, tok, monkeypatch):
    datasets = pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    chats = [_openai(CHATS[0]), _openai(CHATS[1])]  # one schema: pyarrow takes the columns of the first row
    parquet = tmp_path / "data.parquet"
    # one table of chats (the Arrow schema fills the keys a row lacks with nulls)
    pq.write_table(pa.Table.from_pylist([_openai(CHATS[0]), _openai(CHATS[1])]), str(parquet))
    _check_samples(ChatDataset(str(parquet), tok, 64), tok, [CHATS[0], CHATS[1]], 64)
    saved = tmp_path / "saved"
    datasets.Dataset(pa.Table.from_pylist([_sharegpt(CHATS[1]), _sharegpt(CHATS[0])]),
                     fingerprint="fixture").save_to_disk(str(saved))
    _check_samples(ChatDataset(str(saved), tok, 64), tok, [CHATS[1], CHATS[0]], 64)
    assert [r.style for _, _, r in read_records(str(saved))] == ["conversations"] * 2
    both = tmp_path / "both"
    datasets.DatasetDict({"train": datasets.Dataset(pa.Table.from_pylist(chats), fingerprint="a"),
                          "test": datasets.Dataset(pa.Table.from_pylist(chats), fingerprint="b")}
                         ).save_to_disk(str(both))
    with pytest.raises(DataError, match=r"holds several splits .*give one split's folder"):
        open_records(str(both))
    _check_samples(ChatDataset(str(both / "train"), tok, 64), tok, CHATS, 64)


def test_without_datasets_arrow_files_say_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets fails
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    with pytest.raises(DataError, match=r"x\.parquet \(Parquet\) needs the 'datasets' package .*pip install datasets"):
        open_records(str(tmp_path / "x.parquet"))


def test_writers_round_trip(tmp_path):
    records, _ = _records()
    normalized = [normalize_record(r, "f") for r in records]
    normalized[0] = NormalizedRecord("messages", messages=[dict(m) for m in CHATS[0]])
    normalized[0].messages[1]["reasoning_content"] = "the cat"
    names = ["out.jsonl", "out.json"]
    try:
        import datasets  # noqa: F401

        names.append("out.parquet")
    except ImportError:
        pass
    for name in names:
        for style in ("messages", "conversations"):
            path = str(tmp_path / f"{style}-{name}")
            assert write_records(path, normalized, style=style) == len(normalized)
            back = [r for _, _, r in read_records(path)]
            assert [r.messages for r in back] == [r.messages for r in normalized]
            assert [r.text for r in back] == [r.text for r in normalized]
            assert {r.style for r in back if r.is_chat} == {style}
    with pytest.raises(ValueError, match="as 'messages' or 'conversations'"):
        write_records(str(tmp_path / "x.jsonl"), normalized[:1], style="text")


# --------------------------------------------------------------------------------------------------
# Bad records
# --------------------------------------------------------------------------------------------------

BAD = [
    ({"messages": [{"content": "a"}]}, "message 0 must be an object with a 'role'"),
    ({"messages": []}, "no messages"),
    ({"conversations": [{"from": "human", "value": 3}]}, r"message 0 \(user\): content is a number"),
    ('{"messages": [', "invalid JSON"),
]


def _bad_file(tmp_path, good: int):
    """``good`` good records with the `BAD` ones at lines 2, 4, ...; their line numbers."""
    lines, bad_lines = [], []
    for k in range(good):
        lines.append(_openai(CHATS[k % 2]))
        if k < len(BAD):
            lines.append(BAD[k][0])
            bad_lines.append(len(lines))
    return _write_jsonl(tmp_path / "mixed.jsonl", lines), bad_lines


def test_bad_records_fail_by_default_naming_file_and_line(tmp_path, tok):
    path, bad_lines = _bad_file(tmp_path, 10)
    with pytest.raises(DataError, match=rf"^{path}:{bad_lines[0]} .*{BAD[0][1]}"):
        ChatDataset(path, tok, 64)


def test_bad_records_are_skipped_named_and_counted(tmp_path, tok):
    path, bad_lines = _bad_file(tmp_path, 40)
    said = []
    ds = ChatDataset(path, tok, 64, bad_records=BadRecords("skip", 0.1), log=said.append)
    assert len(ds) == 40
    _check_samples(ds, tok, [CHATS[k % 2] for k in range(40)], 64)
    for line, (_, what) in zip(bad_lines, BAD):
        assert any(s.startswith(f"[data] skipped: {path}:{line}") and __import__("re").search(what, s) for s in said)
    assert said[-1] == f"[data] {path}: skipped 4 bad records of 44."
    # IDs are those of the records' places in the file: the same whether the bad ones are there or not
    clean = _write_jsonl(tmp_path / "clean.jsonl", [_openai(CHATS[0])])
    first = ChatDataset(clean, tok, 64, name="mixed.jsonl")[0].sample_id
    assert ds[0].sample_id == first


def test_too_many_bad_records_refuse_the_data(tmp_path, tok):
    path, bad_lines = _bad_file(tmp_path, 10)
    with pytest.raises(DataError, match=rf"{path}: 4 of 14 records are bad \(28.6%, more than --max-bad-fraction "
                                        rf"0.1\); the first: {path}:{bad_lines[0]}"):
        ChatDataset(path, tok, 64, bad_records=BadRecords("skip", 0.1), log=lambda s: None)
    with pytest.raises(ValueError, match="mode must be one of fail, skip"):
        BadRecords("ignore")


def test_a_turn_order_the_template_refuses_is_a_bad_record(tmp_path):
    from megatron_dflash.embedded_job import synthetic_corpus as sc

    strict = sc.build_tokenizer()
    strict.chat_template = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                            "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}{% endfor %}"
                            + sc.CHAT_TEMPLATE)
    swapped = [MULTI_TURN[1], MULTI_TURN[0]]
    path = _write_jsonl(tmp_path / "order.jsonl", [_openai(MULTI_TURN)] * 30 + [_openai(swapped)])
    with pytest.raises(DataError, match=rf"^{path}:31: the chat template refuses the conversation "
                                        r"\(TemplateError: roles must alternate"):
        ChatDataset(path, strict, 64)
    said = []
    assert len(ChatDataset(path, strict, 64, bad_records=BadRecords("skip", 0.05), log=said.append)) == 30
    assert said[0].startswith(f"[data] skipped: {path}:31: the chat template refuses")


def test_text_dataset_reads_every_file_format_and_refuses_chats(tmp_path, tok):
    paths = _write_files(tmp_path, [{"text": TEXT}] * 2)
    for path in paths:
        _check_samples(TextDataset(path, tok, 64), tok, [None, None], 64)
    path = _write_jsonl(tmp_path / "chat.jsonl", [{"text": TEXT}, _openai(MULTI_TURN)])
    with pytest.raises(DataError, match=rf"^{path}:2: no text \(a messages chat; use --data-format chat"):
        TextDataset(path, tok, 64)


def test_gzipped_jsonl_and_json_files_give_the_same_samples(tmp_path, tok):
    """Data files compressed as published (``.jsonl.gz``, ``.json.gz``), alone or in a data directory, give the
    samples of the uncompressed files; the writer compresses a ``.gz`` name, and the same records give the same
    bytes."""
    records, expected = _records()
    folder = tmp_path / "folder"
    folder.mkdir()
    paths = []
    for path in _write_files(tmp_path, records):
        packed = folder / (path.rsplit("/", 1)[-1] + ".gz")
        packed.write_bytes(gzip.compress(open(path, "rb").read()))
        paths.append(str(packed))
    for path in paths + [str(folder)]:
        ds = ChatDataset(path, tok, 64)
        _check_samples(ds, tok, expected * (2 if path == str(folder) else 1), 64)
    assert open_records(paths[0]).where(1) == f"{paths[0]}:2"
    normalized = [r for _, _, r in read_records(paths[0])]
    for name in ("out.jsonl.gz", "out.json.gz"):
        write_records(str(tmp_path / name), normalized, style=None)
        assert [r for _, _, r in read_records(str(tmp_path / name))] == normalized
        first = (tmp_path / name).read_bytes()
        write_records(str(tmp_path / name), normalized, style=None)
        assert (tmp_path / name).read_bytes() == first and first[:2] == b"\x1f\x8b"
    (tmp_path / "plain.jsonl.gz").write_text(json.dumps(records[0]) + "\n")
    with pytest.raises(DataError, match=r"plain\.jsonl\.gz: not a readable gzip file"):
        open_records(str(tmp_path / "plain.jsonl.gz"))


def _cut_array(tmp_path, n, keep_bytes_short):
    """A JSON array of ``n`` ShareGPT chats cut ``keep_bytes_short`` bytes before its end (inside the last
    record), as a packaged copy that stopped early."""
    records = [_sharegpt(CHATS[k % 2]) for k in range(n)]
    text = json.dumps(records, indent=1)
    path = tmp_path / "cut.json"
    path.write_text(text[:len(text) - keep_bytes_short])
    return str(path), records


def test_a_json_array_cut_mid_record_keeps_its_whole_records_under_skip(tmp_path, tok):
    """The records before the cut are the data; the cut is one bad record, named with the byte where the array
    stops being readable: the run fails on it by default and trains on the rest with --bad-records skip."""
    path, records = _cut_array(tmp_path, 120, 25)
    with pytest.raises(DataError, match=rf"^{path}\[119\]: the JSON array is cut or damaged at byte \d+ of "
                                        r"\d+ .*the 119 whole records before it are readable") as err:
        ChatDataset(path, tok, 64)
    assert "\n" not in str(err.value)
    said = []
    ds = ChatDataset(path, tok, 64, bad_records=BadRecords("skip", 0.01), log=said.append)
    _check_samples(ds, tok, [CHATS[k % 2] for k in range(119)], 64)
    assert said[0].startswith(f"[data] skipped: {path}[119]: the JSON array is cut")
    got = [r for _, _, r in read_records(path, bad_records=BadRecords("skip", 0.01), log=lambda s: None)]
    assert [r.messages for r in got] == [normalize_record(r, "x").messages for r in records[:119]]
    # cut between two records (after a comma) and damaged (a stray token) are named the same way
    text = json.dumps(records[:3])
    for damaged, whole in ((text[:text.index("}]}, ") + 4], 1), (text[:-1] + " x]", 3)):
        (tmp_path / "d.json").write_text(damaged)
        source = open_records(str(tmp_path / "d.json"))
        assert len(source) == whole + 1 and source.record(whole - 1) == records[whole - 1]
        with pytest.raises(DataError, match=rf"d\.json\[{whole}\]: the JSON array is cut or damaged"):
            source.record(whole)
    (tmp_path / "obj.json").write_text('{"messages": [')
    with pytest.raises(DataError, match=r"obj\.json: invalid JSON"):
        open_records(str(tmp_path / "obj.json"))
