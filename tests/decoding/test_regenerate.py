"""Regeneration in this process (`decoding/regenerate.py` with `decoding/local_answers.py`): the target's own
greedy answers, whatever the batch size and the number of ranks; resumable shards; the manifest's refusals."""

from __future__ import annotations

import io
import json
import os

import pytest

from chat_server import load_tiny_target, reference_messages
from megatron_dflash.common.errors import DataError
from megatron_dflash.decoding.local_answers import LocalAnswers
from megatron_dflash.decoding.regenerate import (Progress, Settings, answer_seed, conversation_turns, read_records,
                                                 regenerate, shard_path)
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
    summary = regenerate(chats, str(tmp_path), local(settings, batch_size), settings, target="tiny", shard_size=3)
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


def test_truncated_answers_dropped_by_flag(chats, reference, tmp_path):
    settings = Settings(max_new_tokens=MAX_NEW)
    summary = regenerate(chats, str(tmp_path), local(settings, 4), settings, target="tiny", shard_size=3,
                         drop_truncated=True)
    kept = [m for m, reason in reference if reason == "stop"]
    assert [r["messages"] for r in output_records(tmp_path)] == kept and len(kept) < len(reference)
    assert summary.truncated == len(reference) - len(kept)


@pytest.mark.parametrize("change, field", [
    (dict(settings=Settings(max_new_tokens=MAX_NEW, temperature=0.7)), "sampling.temperature"),
    (dict(target="other"), "target"),
    (dict(shard_size=4), "shard_size"),
    (dict(drop_truncated=True), "truncated"),
    (dict(input="other"), "input fingerprint"),
])
def test_a_manifest_of_other_settings_is_refused(chats, tmp_path, change, field):
    settings = Settings(max_new_tokens=MAX_NEW)
    regenerate(chats, str(tmp_path), local(settings, 4), settings, target="tiny", shard_size=3)
    args = dict(input=chats, settings=settings, target="tiny", shard_size=3, drop_truncated=False)
    args.update(change)
    if args["input"] == "other":
        records = read_records(chats)[:-1]
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
