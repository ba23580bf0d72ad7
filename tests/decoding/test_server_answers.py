"""Regeneration through an OpenAI-compatible server (`decoding/server_answers.py`): a real HTTP server on
127.0.0.1 answering from the tiny target gives the records of the in-process back end at temperature 0;
dropped connections and 5xx answers are retried; a record that keeps failing is reported, never lost."""

from __future__ import annotations

import json
import os

import pytest

from chat_server import ChatServer, load_tiny_target
from megatron_dflash.decoding.local_answers import LocalAnswers
from megatron_dflash.decoding.regenerate import Request, Settings, regenerate, shard_path
from megatron_dflash.decoding.server_answers import ServerAnswers, chat_completions_url
from megatron_dflash.embedded_job import synthetic_corpus as sc
from megatron_dflash.embedded_job.tiny_target import SHIPPED_TARGET_DIR
from entry_points import regenerate_module

MAX_NEW = 10
SETTINGS = Settings(max_new_tokens=MAX_NEW)


@pytest.fixture(scope="module")
def target():
    return load_tiny_target()


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    convs = list(sc.conversations(23, 9))
    records = [{"messages": c} for c in convs[:7]] + [{"id": "two-turn", "messages": convs[7] + convs[8]}]
    path = tmp_path_factory.mktemp("input") / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture(scope="module")
def in_process(chats, tmp_path_factory):
    out = tmp_path_factory.mktemp("local") / "out"
    regenerate(chats, str(out), lambda: LocalAnswers(SHIPPED_TARGET_DIR, SETTINGS, batch_size=4), SETTINGS,
               target="tiny", shard_size=3)
    return out


def shards(out) -> dict:
    return {n: open(os.path.join(out, n), "rb").read() for n in sorted(os.listdir(out)) if n.startswith(("shard-", "_shard-"))}


def server_backend(url, **kw):
    kw = {"concurrency": 3, "retries": 4, "backoff": 0.01, **kw}
    return lambda: ServerAnswers(url, "tiny", SETTINGS, **kw)


def test_endpoint_from_any_form_of_the_url():
    for url in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/chat/completions"):
        assert chat_completions_url(url) == "http://h:1/v1/chat/completions"


def test_server_gives_the_in_process_records_at_temperature_0(target, chats, in_process, tmp_path):
    with ChatServer(*target) as server:
        summary = regenerate(chats, str(tmp_path), server_backend(server.url), SETTINGS, target="tiny", shard_size=3)
    assert not summary.failed and summary.records_written == 8
    assert shards(tmp_path) == shards(in_process)
    assert {r["seed"] for r in server.requests} and all(r["temperature"] == 0.0 for r in server.requests)


def test_dropped_connections_and_500s_are_retried(target, chats, in_process, tmp_path):
    def faults(body, count):  # two of every three requests fail, one way or the other
        return {1: "drop", 2: 500}.get(count % 3)

    with ChatServer(*target, faults=faults) as server:
        summary = regenerate(chats, str(tmp_path), server_backend(server.url), SETTINGS, target="tiny", shard_size=3)
    assert not summary.failed and server.count > 2 * 9
    assert shards(tmp_path) == shards(in_process)


def test_a_record_that_keeps_failing_is_reported_and_retried_by_a_rerun(target, chats, in_process, tmp_path,
                                                                         capsys):
    poison = json.loads(open(chats).readlines()[4])["messages"][0]["content"]

    def faults(body, count):
        return 503 if body["messages"][0]["content"] == poison else None

    regen = regenerate_module()
    argv = ["--input", chats, "--output", str(tmp_path), "--model", "tiny", "--max-new-tokens", str(MAX_NEW),
            "--shard-size", "3", "--retries", "2", "--concurrency", "2"]
    with ChatServer(*target, faults=faults) as server:
        assert regen.main(argv + ["--server", server.url]) == 1
    err = capsys.readouterr().err
    assert "record 4 failed: 3 tries failed, the last with: HTTP 503" in err and "1 failed" in err
    assert not os.path.exists(shard_path(str(tmp_path), 1))  # record 4's shard is not written
    assert json.load(open(tmp_path / "_shard-00001.failed.json"))[0]["id"] == "4"
    assert set(shards(tmp_path)) == {"shard-00000.jsonl", "_shard-00001.failed.json", "shard-00002.jsonl"}
    with ChatServer(*target) as server:  # the server recovered: a rerun does the missing shard only
        assert regen.main(argv + ["--server", server.url]) == 0
    assert len(server.requests) == 3
    assert shards(tmp_path) == shards(in_process)


def test_a_refused_request_is_not_retried(target, chats, tmp_path):
    with ChatServer(*target, faults=lambda body, count: 400) as server:
        summary = regenerate(chats, str(tmp_path), server_backend(server.url), SETTINGS, target="tiny", shard_size=3)
    assert len(summary.failed) == 8 and server.count == 8
    assert all("HTTP 400" in reason for _, reason in summary.failed)


def test_the_request_carries_the_settings_and_thinking_mode():
    settings = Settings(max_new_tokens=7, temperature=0.6, top_p=0.9, seed=1, chat_template_kwargs={"enable_thinking": True})
    body = ServerAnswers("http://h:1", "m", settings).body(Request([{"role": "user", "content": "q"}], 42, "r"))
    assert body == {"model": "m", "messages": [{"role": "user", "content": "q"}], "max_tokens": 7, "temperature": 0.6,
                    "top_p": 0.9, "seed": 42, "n": 1, "chat_template_kwargs": {"enable_thinking": True}}
