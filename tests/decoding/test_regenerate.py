"""Regeneration in this process (`decoding/regenerate.py` with `decoding/local_answers.py`): the target's own
greedy answers, whatever the batch size and the number of ranks; resumable shards; the manifest's refusals."""

from __future__ import annotations

import io
import json
import os
import re

import pytest

from chat_server import load_tiny_target, reference_messages
from megatron_dflash.common.errors import DataError
from megatron_dflash.data.formats import BadRecords
from megatron_dflash.decoding.local_answers import LocalAnswers
from megatron_dflash.decoding.regenerate import (Progress, Settings, answer_seed, conversation_turns, regenerate,
                                                 shard_path)
from megatron_dflash.embedded_job import synthetic_corpus as sc
from megatron_dflash.embedded_job.tiny_target import SHIPPED_TARGET_DIR

MAX_NEW = 12  # short: some answers (long counts) are cut, so both finish reasons occur


def chat_records() -> list:
    """Synthetic chats: single-turn ones, two-turn ones (two chats in a row), a prompt without an answer."""
    chats = list(sc.conversations(11, 12))
    records = [{"id": f"chat-{i}", "messages": c} for i, c in enumerate(chats[:7])]
    records += [{"messages": chats[i] + chats[i + 1]} for i in (7, 9)]
    records.append({"messages": chats[11][:1], "source": "prompt only"})
    return records


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    path = tmp_path_factory.mktemp("input") / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in chat_records()))
    return str(path)


@pytest.fixture(scope="module")
def reference():
    model, tok = load_tiny_target()
    return [reference_messages(model, tok, r["messages"], MAX_NEW) for r in chat_records()]


def local(settings, batch_size, calls=None):
    def build():
        if calls is not None:
            calls.append(batch_size)
        return LocalAnswers(SHIPPED_TARGET_DIR, settings, batch_size=batch_size)
    return build


def output_records(out) -> list:
    names = sorted(n for n in os.listdir(out) if n.startswith("shard-") and n.endswith(".jsonl"))
    return [json.loads(line) for n in names for line in open(os.path.join(out, n), encoding="utf-8")]


def files_of(out) -> dict:
    return {n: open(os.path.join(out, n), "rb").read() for n in sorted(os.listdir(out))}


def test_turns_are_the_answers_to_generate():
    u1, a1, u2, a2 = ({"role": r, "content": c} for r, c in (("user", "q1"), ("assistant", "a1"), ("user", "q2"),
                                                            ("assistant", "a2")))
    assert conversation_turns([u1, a1, u2, a2]) == [[u1], [u2]]
    assert conversation_turns([u1, a1, u2]) == [[u1], [u2]]
    assert conversation_turns([u1, u2, a1, a2]) == [[u1, u2]]


@pytest.mark.parametrize("batch_size", [1, 4])
def test_in_process_answers_are_the_targets_greedy_answers(chats, reference, tmp_path, batch_size):
    settings = Settings(max_new_tokens=MAX_NEW)
    summary = regenerate(chats, str(tmp_path), local(settings, batch_size), settings, target="tiny", shard_size=3,
                         truncated="drop-rest")
    records, inputs = output_records(tmp_path), chat_records()
    assert summary.records_written == len(inputs) and not summary.failed and summary.shards_written == 4
    assert [r["messages"] for r in records] == [m for m, _ in reference]
    assert [r["finish_reason"] for r in records] == [reason for _, reason in reference]
    assert {"stop", "length"} == {r["finish_reason"] for r in records}
    assert summary.truncated == sum(reason == "length" for _, reason in reference)
    for r, original in zip(records, inputs):  # the record's other fields stay; the settings are on it
        assert {k: v for k, v in r.items() if k not in ("messages", "finish_reason", "generation")} == \
            {k: v for k, v in original.items() if k != "messages"}
        assert r["generation"] == settings.as_dict()


def test_output_does_not_depend_on_batch_size_or_ranks(chats, tmp_path):
    """Sampled (temperature 1): the seeds come from the record ids, not from batches or ranks."""
    settings = Settings(max_new_tokens=MAX_NEW, temperature=1.0, top_p=0.9, seed=5)
    one = tmp_path / "one"
    regenerate(chats, str(one), local(settings, 1), settings, target="tiny", shard_size=3)
    two = tmp_path / "two"
    for rank in (0, 1):
        regenerate(chats, str(two), local(settings, 3), settings, target="tiny", shard_size=3, rank=rank, world_size=2)
    assert files_of(one) == files_of(two)
    greedy = tmp_path / "greedy"
    regenerate(chats, str(greedy), local(Settings(max_new_tokens=MAX_NEW), 4), Settings(max_new_tokens=MAX_NEW),
               target="tiny", shard_size=3)
    assert output_records(one) != output_records(greedy)  # the sampling really sampled


def test_rerun_skips_finished_shards_and_redoes_missing_ones(chats, tmp_path):
    settings = Settings(max_new_tokens=MAX_NEW)
    regenerate(chats, str(tmp_path), local(settings, 4), settings, target="tiny", shard_size=3)
    before = files_of(tmp_path)
    calls = []
    summary = regenerate(chats, str(tmp_path), local(settings, 4, calls), settings, target="tiny", shard_size=3)
    assert calls == [] and summary.shards_skipped == 4 and summary.shards_written == 0  # nothing loaded
    os.unlink(shard_path(str(tmp_path), 2))
    (tmp_path / ".shard-00001.jsonl.tmp-killed").write_text("half a shard")  # staged by a killed run
    os.unlink(shard_path(str(tmp_path), 1))
    summary = regenerate(chats, str(tmp_path), local(settings, 2, calls), settings, target="tiny", shard_size=3)
    assert calls == [2] and summary.shards_written == 2
    assert files_of(tmp_path) == before


def test_records_with_a_cut_answer_are_left_out_by_default(chats, reference, tmp_path):
    settings = Settings(max_new_tokens=MAX_NEW)
    summary = regenerate(chats, str(tmp_path), local(settings, 4), settings, target="tiny", shard_size=3)
    kept = [m for m, reason in reference if reason == "stop"]
    assert [r["messages"] for r in output_records(tmp_path)] == kept and len(kept) < len(reference)
    assert summary.truncated == len(reference) - len(kept)


@pytest.mark.parametrize("change, field", [
    (dict(settings=Settings(max_new_tokens=MAX_NEW, temperature=0.7)), "sampling.temperature"),
    (dict(target="other"), "target"),
    (dict(shard_size=4), "shard_size"),
    (dict(truncated="drop-rest"), "truncated"),
    (dict(input="other"), "input fingerprint"),
])
def test_a_manifest_of_other_settings_is_refused(chats, tmp_path, change, field):
    settings = Settings(max_new_tokens=MAX_NEW)
    regenerate(chats, str(tmp_path), local(settings, 4), settings, target="tiny", shard_size=3)
    args = dict(input=chats, settings=settings, target="tiny", shard_size=3)
    args.update(change)
    if args["input"] == "other":
        records = chat_records()[:-1]
        args["input"] = str(tmp_path.parent / "other.jsonl")
        with open(args["input"], "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    calls = []
    with pytest.raises(DataError, match=f"another {field}"):
        regenerate(args.pop("input"), str(tmp_path), local(settings, 4, calls), args.pop("settings"), **args)
    assert calls == []


def test_seeds_depend_on_the_record_and_turn_only():
    seeds = {answer_seed(0, rid, turn) for rid in ("0", "1", "chat-0") for turn in (0, 1)}
    assert len(seeds) == 6 and answer_seed(0, "1", 1) == answer_seed(0, "1", 1) != answer_seed(1, "1", 1)


def test_chat_template_kwargs_reach_the_template():
    """Thinking mode: `--chat-template-kwargs` is passed to the template when a prompt is rendered."""
    answers = LocalAnswers(SHIPPED_TARGET_DIR, Settings(chat_template_kwargs={"enable_thinking": True}))
    answers.tokenizer.chat_template = sc.CHAT_TEMPLATE + "{% if enable_thinking %}think{% endif %}"
    messages = [{"role": "user", "content": "count from 1 to 3"}]
    assert answers.prompt_text(messages).endswith("<|assistant|> think")
    answers.settings = Settings()
    assert answers.prompt_text(messages).endswith("<|assistant|> ")


def test_progress_says_records_and_tokens_per_second():
    stream = io.StringIO()
    progress = Progress(8, "rank 1: ", stream)
    progress.update(0, 50)
    assert stream.getvalue() == ""  # not a terminal: a line per shard only
    progress.update(4, 30, force=True)
    line = stream.getvalue()
    assert line.startswith("rank 1: [") and " 4/8 records " in line and "records/s" in line and "tokens/s" in line
    progress.close()
    stream = io.StringIO()
    progress = Progress(3, "spec_generate: ", stream, unit="prompts")  # what another tool counts
    progress.update(3, 12, force=True)
    progress.close()
    line = stream.getvalue()
    assert " 3/3 prompts " in line and "prompts/s" in line and "records" not in line


# ------------------------------------------------------------------------------ every input kind and style

SHAREGPT_FROM = {"user": "human", "assistant": "gpt", "system": "system"}


def uniform_records() -> list:
    """`chat_records()` with the same fields on every record (Arrow tables have one set of columns)."""
    return [{"id": f"r{i}", "meta": {"n": i}, "messages": r["messages"]} for i, r in enumerate(chat_records())]


def as_sharegpt(record: dict) -> dict:
    turns = [{"from": SHAREGPT_FROM[m["role"]], "value": m["content"]} for m in record["messages"]]
    return {**{k: v for k, v in record.items() if k != "messages"}, "conversations": turns}


def with_parts(record: dict) -> dict:
    """The first message's content as a list of two text parts; an assistant turn with reasoning_content."""
    messages = [dict(m) for m in record["messages"]]
    text = messages[0]["content"]
    messages[0]["content"] = [{"type": "text", "text": text[:5]}, {"type": "text", "text": text[5:]}]
    if len(messages) > 1:
        messages[1]["reasoning_content"] = "thinking"  # an assistant turn: replaced by the target's answer
    return {**record, "messages": messages}


def write_input(kind: str, folder) -> tuple[str, str, str]:
    """The records written as `kind` (by hand or by `datasets`, not by the package's writer): (input path, the
    record style, the shards' extension)."""
    import datasets

    records = uniform_records()
    if kind == "sharegpt.jsonl":
        path = folder / kind
        path.write_text("".join(json.dumps(as_sharegpt(r)) + "\n" for r in records))
        return str(path), "conversations", "jsonl"
    if kind == "messages.json":
        path = folder / kind
        path.write_text(json.dumps([with_parts(r) for r in records]))
        return str(path), "messages", "json"
    if kind == "sharegpt.parquet":
        path = folder / kind
        datasets.Dataset.from_list([as_sharegpt(r) for r in records]).to_parquet(str(path))
        return str(path), "conversations", "parquet"
    if kind == "saved":
        path = folder / kind
        datasets.Dataset.from_list(records).save_to_disk(str(path))
        return str(path), "messages", "jsonl"
    path = folder / "files"  # a directory of two JSONL files, read in name order
    path.mkdir()
    (path / "a.jsonl").write_text("".join(json.dumps(with_parts(r)) + "\n" for r in records[:4]))
    (path / "b.jsonl").write_text("".join(json.dumps(as_sharegpt(r)) + "\n" for r in records[4:]))
    return str(path), None, "jsonl"


def read_shards(out, ext: str) -> list:
    """The output records, read with json / pyarrow directly."""
    import pyarrow.parquet as pq

    names = sorted(n for n in os.listdir(out) if n.startswith("shard-"))
    assert names and all(n.endswith("." + ext) for n in names)
    rows = []
    for n in names:
        path = os.path.join(out, n)
        if ext == "parquet":
            rows += pq.read_table(path).to_pylist()
        elif ext == "json":
            rows += json.load(open(path, encoding="utf-8"))
        else:
            rows += [json.loads(line) for line in open(path, encoding="utf-8")]
    return rows


def turns_of(row: dict) -> list:
    """A written record's turns as role / content messages (ShareGPT turns mapped by hand)."""
    if "conversations" in row:
        roles = {v: k for k, v in SHAREGPT_FROM.items()}
        return [{"role": roles[t["from"]], "content": t["value"]} for t in row["conversations"]]
    return [{k: m[k] for k in ("role", "content")} for m in row["messages"]]


@pytest.mark.parametrize("kind", ["sharegpt.jsonl", "messages.json", "sharegpt.parquet", "saved", "files"])
def test_every_input_kind_regenerates_the_targets_answers_in_its_own_style(kind, reference, tmp_path):
    pytest.importorskip("datasets")
    path, style, ext = write_input(kind, tmp_path)
    settings = Settings(max_new_tokens=MAX_NEW)
    out = tmp_path / "out"
    summary = regenerate(path, str(out), local(settings, 4), settings, target="tiny", shard_size=4,
                         truncated="drop-rest")
    rows = read_shards(out, ext)
    assert summary.records_written == len(rows) == len(reference) and not summary.failed
    assert [turns_of(r) for r in rows] == [m for m, _ in reference]  # the per-record generate oracle
    assert [r["finish_reason"] for r in rows] == [reason for _, reason in reference]
    styles = [style] * len(rows) if style else ["messages"] * 4 + ["conversations"] * (len(rows) - 4)
    assert ["conversations" if "conversations" in r else "messages" for r in rows] == styles
    for i, r in enumerate(rows):  # the other fields stay; the settings are on every record
        assert (r["id"], r["meta"]) == (f"r{i}", {"n": i})
        assert {k: v for k, v in r["generation"].items() if v is not None} == \
            {k: v for k, v in settings.as_dict().items() if v is not None}


class EchoAnswers:
    """A back end that answers every request with its last message's content (fast, for the bookkeeping)."""

    def answer(self, requests):
        from megatron_dflash.decoding.regenerate import Answer

        return [Answer(q.messages[-1]["content"], "stop", 1) for q in requests]


class SlowEchoAnswers(EchoAnswers):
    """`EchoAnswers` whose every turn of a shard takes `seconds` (a long `generate` call, a slow server)."""

    seconds = 0.35

    def answer(self, requests):
        import time

        time.sleep(self.seconds)
        return super().answer(requests)


def test_a_log_file_gets_progress_lines_at_a_steady_interval(tmp_path):
    """Not a terminal: a line at least every --progress-interval seconds, also inside one shard whose turns take
    longer than that (nothing printed within a shard before), and a line at each shard's end."""
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in chat_records()))
    said = io.StringIO()
    regenerate(str(path), str(tmp_path / "out"), SlowEchoAnswers, Settings(), target="echo", shard_size=100,
               progress_stream=said, progress_interval=0.1)
    lines = [line for line in said.getvalue().splitlines() if "records/s" in line]
    turns = max(len(conversation_turns(r["messages"])) for r in chat_records())
    assert len(lines) >= 2 * turns, said.getvalue()  # one shard: heartbeats inside it, then its end
    total = re.search(r" 0/(\d+) records ", lines[0]).group(1)
    assert "elapsed" in lines[0] and f" {total}/{total} records " in lines[-1]
    quiet = io.StringIO()
    regenerate(str(path), str(tmp_path / "out2"), SlowEchoAnswers, Settings(), target="echo", shard_size=100,
               progress_stream=quiet, progress_interval=60)
    assert len([line for line in quiet.getvalue().splitlines() if "records/s" in line]) == 1  # the shard's end
    with pytest.raises(ValueError, match="progress interval must be > 0"):
        Progress(1, "", io.StringIO(), interval=0)


def test_bad_and_text_records_fail_or_are_skipped_named(tmp_path):
    lines = [json.dumps(r) for r in chat_records()]
    lines.insert(3, json.dumps({"text": "no turns here"}))
    lines.insert(6, json.dumps({"messages": [{"content": "no role"}]}))
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=rf"^{path}:4: a text record has no turns to regenerate"):
        regenerate(str(path), str(tmp_path / "a"), EchoAnswers, Settings(), target="echo")
    with pytest.raises(DataError, match=r"2 of 12 records are bad .*more than --max-bad-fraction 0.1"):
        regenerate(str(path), str(tmp_path / "b"), EchoAnswers, Settings(), target="echo",
                   bad_records=BadRecords("skip", 0.1), progress_stream=io.StringIO())
    said = io.StringIO()
    summary = regenerate(str(path), str(tmp_path / "c"), EchoAnswers, Settings(), target="echo",
                         bad_records=BadRecords("skip", 0.2), progress_stream=said)
    assert summary.records_written == len(chat_records())
    assert f"[data] skipped: {path}:4: a text record" in said.getvalue()
    assert f"[data] skipped: {path}:7: message 0 must be an object with a 'role'" in said.getvalue()
    ids = [r.get("id") for r in output_records(tmp_path / "c")]
    assert ids == [r.get("id") for r in chat_records()]


def test_a_directory_inputs_fingerprint_covers_each_of_its_files(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    for name, part in (("a.jsonl", chat_records()[:5]), ("b.jsonl", chat_records()[5:])):
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    out = str(tmp_path / "out")
    regenerate(str(folder), out, EchoAnswers, Settings(), target="echo", shard_size=3)
    regenerate(str(folder), out, EchoAnswers, Settings(), target="echo", shard_size=3)  # the same: resumes
    records = chat_records()[5:]
    records[-1] = {**records[-1], "source": "edited"}
    (folder / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))  # same count, other bytes
    with pytest.raises(DataError, match="another input fingerprint"):
        regenerate(str(folder), out, EchoAnswers, Settings(), target="echo", shard_size=3)


# ------------------------------------------------------------------------------ within the target's limits


def test_a_prompt_past_the_targets_context_is_named_before_any_generation(tmp_path):
    """The tiny target has 512 positions: a 3,000-word prompt, or a 1 MB one, is no record it can answer. It
    stops the run naming its line (--bad-records fail) or is skipped, named; nothing is generated for it."""
    import time

    words = " ".join(["white"] * 3000)
    records = chat_records()[:3]
    records.insert(1, {"messages": [{"role": "user", "content": "repeat " + words}]})
    records.insert(3, {"messages": [{"role": "user", "content": "x " * 500_000}]})  # 1 MB
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    settings = Settings(max_new_tokens=MAX_NEW)
    start = time.monotonic()
    with pytest.raises(DataError, match=rf"^{path}:2: its prompt \(the turns without the answers\) is (more than )?\d+ "
                       r"tokens; with --max-new-tokens 12 it does not fit the target's context of 512 positions "
                       r".*; --bad-records skip leaves such records out\.$"):
        regenerate(str(path), str(tmp_path / "a"), local(settings, 4), settings, target="tiny", shard_size=5)
    said = io.StringIO()
    summary = regenerate(str(path), str(tmp_path / "b"), local(settings, 4), settings, target="tiny", shard_size=5,
                         truncated="drop-rest", bad_records=BadRecords("skip", 0.5), progress_stream=said)
    assert time.monotonic() - start < 30
    assert summary.records_written == 3 and len(summary.skipped) == 2
    assert f"[data] skipped: {path}:2: its prompt" in said.getvalue()
    assert re.search(rf"\[data\] skipped: {path}:4: its prompt \(the turns without the answers\) is (more than )?\d+ "
                     "tokens; with --max-new-tokens 12 it does not fit", said.getvalue())
    assert [r["messages"][0] for r in output_records(tmp_path / "b")] == [r["messages"][0] for r in chat_records()[:3]]


class CuttingAnswers:
    """Echoes each request's last message, cut ("length") when it holds "cut"."""

    def __init__(self):
        self.requests = []

    def answer(self, requests):
        from megatron_dflash.decoding.regenerate import Answer

        self.requests += requests
        return [Answer("echo " + q.messages[-1]["content"], "length" if "cut" in q.messages[-1]["content"] else "stop",
                       2) for q in requests]


def two_turn_records(tmp_path) -> str:
    turns = lambda a, b: [{"role": "user", "content": a}, {"role": "assistant", "content": "old"},  # noqa: E731
                          {"role": "user", "content": b}, {"role": "assistant", "content": "old"}]
    records = [{"id": "whole", "messages": turns("q1", "q2")}, {"id": "first cut", "messages": turns("cut q1", "q2")},
               {"id": "last cut", "messages": turns("q1", "cut q2")}]
    path = tmp_path / "two_turns.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.mark.parametrize("policy, kept", [
    ("skip-record", {"whole": 4}),
    ("drop-rest", {"whole": 4, "first cut": 2, "last cut": 4}),
    ("continue", {"whole": 4, "first cut": 4, "last cut": 4}),
])
def test_the_cut_answer_policy_says_what_becomes_of_the_rest_of_the_conversation(tmp_path, policy, kept):
    backend = CuttingAnswers()
    summary = regenerate(two_turn_records(tmp_path), str(tmp_path / "out"), lambda: backend, Settings(), target="echo",
                         truncated=policy)
    rows = output_records(tmp_path / "out")
    assert {r["id"]: len(r["messages"]) for r in rows} == kept
    assert {r["id"]: r["finish_reason"] for r in rows} == {k: "stop" if k == "whole" else "length" for k in kept}
    assert summary.truncated == 2 and summary.dropped_turns == (1 if policy == "drop-rest" else 0)
    assert json.load(open(tmp_path / "out" / "_manifest.json"))["truncated"] == policy
    if policy == "continue":  # the later turn is asked after the cut answer
        first_cut = [q.messages for q in backend.requests if q.name == "record first cut turn 1"]
        assert first_cut[0][1] == {"role": "assistant", "content": "echo cut q1"}


def test_the_target_is_one_target_however_its_path_is_spelled(tmp_path, monkeypatch, chats):
    (tmp_path / "models" / "t").mkdir(parents=True)
    (tmp_path / "models" / "link").symlink_to(tmp_path / "models" / "t")
    monkeypatch.chdir(tmp_path / "models")
    out = str(tmp_path / "out")
    regenerate(chats, out, EchoAnswers, Settings(), target="t", shard_size=4)
    for spelling in ("./t/", str(tmp_path / "models" / "t"), "link", "../models/t"):
        summary = regenerate(chats, out, EchoAnswers, Settings(), target=spelling, shard_size=4)
        assert summary.shards_skipped == 3 and summary.shards_written == 0
    (tmp_path / "models" / "u").mkdir()
    with pytest.raises(DataError, match="another target"):
        regenerate(chats, out, EchoAnswers, Settings(), target="u", shard_size=4)


def test_one_regeneration_at_a_time_per_output_directory(chats, tmp_path, monkeypatch):
    """A second run on an output directory is refused in one line naming the holder, whatever the ranks; the
    ranks of one launch (one torchrun run id) share it."""
    import socket

    from megatron_dflash.common.errors import RunError
    from megatron_dflash.decoding.output_lock import lock_output

    out = str(tmp_path / "out")
    holder = lock_output(out)
    with pytest.raises(RunError, match=rf"^--output={out} is in use by another run \(host {socket.gethostname()}, "
                       rf"pid {os.getpid()}, started .*\); two regenerations into one directory"):
        regenerate(chats, out, EchoAnswers, Settings(), target="echo")
    holder.release()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-a")
    regenerate(chats, out, EchoAnswers, Settings(), target="echo", shard_size=2, rank=0, world_size=2)
    holder = lock_output(out, rank=0)  # launch a's rank 0, still running
    summary = regenerate(chats, out, EchoAnswers, Settings(), target="echo", shard_size=2, rank=1, world_size=2)
    assert summary.shards_written == 2  # its own launch's rank 1 goes on
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-b")
    with pytest.raises(RunError, match="is in use by another run"):
        regenerate(chats, out, EchoAnswers, Settings(), target="echo", shard_size=2, rank=1, world_size=2)
    holder.release()
    holder = lock_output(out, rank=1)  # launch b's rank 1 alone: launch a's rank 0 may not start under it
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-a")
    with pytest.raises(RunError, match=r"is in use by another run .*rank-00001\.lock"):
        regenerate(chats, out, EchoAnswers, Settings(), target="echo", shard_size=2, rank=0, world_size=2)
    holder.release()
    assert sorted(os.listdir(out)) == ["_manifest.json"] + [f"shard-0000{k}.jsonl" for k in range(5)]


def test_records_the_template_refuses_or_with_nothing_to_answer_are_bad_records(tmp_path):
    """A template's raise_exception (here: a second user turn in a row) and a record of assistant turns only
    are named before any generation, as the training job names them."""
    from megatron_dflash.decoding.prompt_limits import PromptLimits
    from megatron_dflash.embedded_job.synthetic_corpus import CHAT_TEMPLATE

    class Strict(EchoAnswers):
        def __init__(self):
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(SHIPPED_TARGET_DIR)
            tok.chat_template = ("{% for m in messages %}{% if loop.index0 > 0 and "
                                 "m['role'] == messages[loop.index0 - 1]['role'] %}"
                                 "{{ raise_exception('roles must alternate') }}{% endif %}{% endfor %}" + CHAT_TEMPLATE)
            self.check_record = PromptLimits(tok, 512, 8).check_record

    records = chat_records()[:3]
    records.insert(1, {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]})
    records.insert(2, {"messages": [{"role": "assistant", "content": "only me"}]})
    path = tmp_path / "odd.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    said = io.StringIO()
    summary = regenerate(str(path), str(tmp_path / "out"), Strict, Settings(), target="echo",
                         bad_records=BadRecords("skip", 0.5), progress_stream=said)
    assert summary.records_written == 3
    assert f"[data] skipped: {path}:3: no turn to answer (every message is the assistant's)." in said.getvalue()
    assert f"[data] skipped: {path}:2: the chat template refuses its prompt (the turns without the answers) " \
        "(TemplateError: roles must alternate)." in said.getvalue()


def test_a_lone_surrogate_in_a_records_other_fields_is_a_bad_record_named_before_any_answer(tmp_path):
    """The record's other fields are written back with its answers: one no shard can hold (a lone surrogate in
    its id) is named as a bad record up front, failing or skipped, instead of failing the shard's write."""
    lines = [json.dumps(r) for r in chat_records()]
    lines[2] = json.dumps({**chat_records()[2], "id": "\ud800"})  # JSON escapes make the lone surrogate
    path = tmp_path / "ids.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=rf"^{path}:3: field 'id' is not valid Unicode \(a lone surrogate"):
        regenerate(str(path), str(tmp_path / "a"), EchoAnswers, Settings(), target="echo")
    said = io.StringIO()
    summary = regenerate(str(path), str(tmp_path / "b"), EchoAnswers, Settings(), target="echo",
                         bad_records=BadRecords("skip", 0.2), progress_stream=said)
    assert summary.records_written == len(chat_records()) - 1
    assert f"[data] skipped: {path}:3: field 'id' is not valid Unicode" in said.getvalue()
