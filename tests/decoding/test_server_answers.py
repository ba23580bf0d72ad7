"""Regeneration through an OpenAI-compatible server (`decoding/server_answers.py`): a real HTTP server on
127.0.0.1 answering from the tiny target gives the records of the in-process back end at temperature 0;
dropped connections and 5xx answers are retried; a record that keeps failing is reported, never lost."""

from __future__ import annotations

import json
import os
import time

import pytest

from chat_server import ChatServer, load_tiny_target
from megatron_dflash.decoding.local_answers import LocalAnswers
from megatron_dflash.decoding.regenerate import Request, RequestFailed, Settings, regenerate, shard_path
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
               target="tiny", shard_size=3, truncated="drop-rest")
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
        summary = regenerate(chats, str(tmp_path), server_backend(server.url), SETTINGS, target="tiny", shard_size=3,
                             truncated="drop-rest")
    assert not summary.failed and summary.records_written == 8
    assert shards(tmp_path) == shards(in_process)
    assert {r["seed"] for r in server.requests} and all(r["temperature"] == 0.0 for r in server.requests)


def test_dropped_connections_and_500s_are_retried(target, chats, in_process, tmp_path):
    def faults(body, count):  # two of every three requests fail, one way or the other
        return {1: "drop", 2: 500}.get(count % 3)

    with ChatServer(*target, faults=faults) as server:
        summary = regenerate(chats, str(tmp_path), server_backend(server.url), SETTINGS, target="tiny", shard_size=3,
                             truncated="drop-rest")
    assert not summary.failed and server.count > 2 * 9
    assert shards(tmp_path) == shards(in_process)


def test_a_record_that_keeps_failing_is_reported_and_retried_by_a_rerun(target, chats, in_process, tmp_path,
                                                                         capsys):
    poison = json.loads(open(chats).readlines()[4])["messages"][0]["content"]

    def faults(body, count):
        return 503 if body["messages"][0]["content"] == poison else None

    regen = regenerate_module()
    argv = ["--input", chats, "--output", str(tmp_path), "--model", "tiny", "--max-new-tokens", str(MAX_NEW),
            "--shard-size", "3", "--retries", "2", "--concurrency", "2", "--backoff", "0.01",
            "--on-truncated", "drop-rest"]
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
        summary = regenerate(chats, str(tmp_path), server_backend(server.url), SETTINGS, target="tiny", shard_size=3,
                             truncated="drop-rest")
    assert len(summary.failed) == 8 and server.count == 8
    assert all("HTTP 400" in reason for _, reason in summary.failed)


def test_the_request_carries_the_settings_and_thinking_mode():
    settings = Settings(max_new_tokens=7, temperature=0.6, top_p=0.9, seed=1, chat_template_kwargs={"enable_thinking": True})
    body = ServerAnswers("http://h:1", "m", settings).body(Request([{"role": "user", "content": "q"}], 42, "r"))
    assert body == {"model": "m", "messages": [{"role": "user", "content": "q"}], "max_tokens": 7, "temperature": 0.6,
                    "top_p": 0.9, "seed": 42, "n": 1, "chat_template_kwargs": {"enable_thinking": True}}


# ------------------------------------------------------------------------------ what a server may send back


def small_input(tmp_path, n=4, style="messages") -> str:
    convs = list(sc.conversations(29, n))
    if style == "conversations":
        records = [{"conversations": [{"from": {"user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]}
                                      for m in c]} for c in convs]
    else:
        records = [{"messages": c} for c in convs]
    path = tmp_path / f"in-{style}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def written(out) -> list:
    return [json.loads(line) for n in sorted(os.listdir(out)) if n.startswith("shard-")
            for line in open(os.path.join(out, n), encoding="utf-8")]


@pytest.mark.parametrize("style, key", [("messages", "reasoning_content"), ("conversations", "reasoning")])
def test_a_reasoning_parsers_thinking_is_kept_in_the_records_own_style(target, tmp_path, style, key):
    def edit(body, reply):
        reply["choices"][0]["message"][key] = "thought: " + body["messages"][-1]["content"]
        return reply

    path = small_input(tmp_path, style=style)
    with ChatServer(*target, edit=edit) as server:
        summary = regenerate(path, str(tmp_path / "out"), server_backend(server.url), SETTINGS, target="tiny",
                             truncated="continue")
    assert not summary.failed and summary.records_written == 4
    for row in written(tmp_path / "out"):
        turns = row[style]
        answers = [t for t in turns if t.get("role", t.get("from")) in ("assistant", "gpt")]
        questions = [t for t in turns if t.get("role", t.get("from")) in ("user", "human")]
        assert [a["reasoning_content"] for a in answers] == \
            ["thought: " + q.get("content", q.get("value")) for q in questions]
    for request in server.requests:  # the earlier answers' thinking is not sent back
        assert all(set(m) == {"role", "content"} for m in request["messages"])


def test_a_reply_cut_inside_the_thinking_is_an_empty_answer_with_its_thinking(target, tmp_path):
    def edit(body, reply):
        reply["choices"][0]["message"].update(content=None, reasoning_content="still thinking")
        reply["choices"][0]["finish_reason"] = "length"
        return reply

    path = small_input(tmp_path)
    with ChatServer(*target, edit=edit) as server:
        summary = regenerate(path, str(tmp_path / "out"), server_backend(server.url), SETTINGS, target="tiny",
                         truncated="drop-rest")
    assert not summary.failed and summary.records_written == 4 and summary.truncated == 4
    for row in written(tmp_path / "out"):
        assert row["finish_reason"] == "length"
        assert row["messages"][-1] == {"role": "assistant", "content": "", "reasoning_content": "still thinking"}


def test_a_silent_or_trickling_server_is_bounded_by_the_whole_request_timeout(target, tmp_path):
    """A reply that trickles a byte every 0.1 s (for 4 s at most, so that a client without a deadline ends
    too) is given up after --timeout, retried, and said while it waits; the record is named."""
    def trickle(handler, body):
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.end_headers()
        try:
            for _ in range(40):
                handler.wfile.write(b" ")
                handler.wfile.flush()
                time.sleep(0.1)
        except (BrokenPipeError, ConnectionResetError):
            pass

    lines = []
    request = Request([{"role": "user", "content": "count from 1 to 3"}], 1, "record r turn 0")
    with ChatServer(*target, send=trickle) as server:
        start = time.monotonic()
        backend = ServerAnswers(server.url, "tiny", SETTINGS, retries=1, backoff=0.05, timeout=0.6,
                                report_every=0.25, log=lines.append)
        [result] = backend.answer([request])
        took = time.monotonic() - start
    assert isinstance(result, RequestFailed) and not result.bad_answer, result
    assert result.reason == "2 tries failed, the last with: no whole reply within --timeout 0.6 s"
    assert took < 2.5 and server.count == 2
    assert any(line.startswith("[regenerate] record r turn 0: no whole reply within --timeout 0.6 s; try 2 of 2")
               for line in lines), lines
    assert any("waiting for" in line and "1 of 1 requests unanswered" in line for line in lines), lines


def hostile(tmp_path, target, edit, *extra):
    """The tool's run against a server whose replies `edit` spoils: (exit status, output directory)."""
    tmp_path.mkdir(exist_ok=True)
    path = small_input(tmp_path)
    out = tmp_path / "out"
    argv = ["--input", path, "--output", str(out), "--model", "tiny", "--max-new-tokens", "8", "--shard-size", "2",
            "--retries", "0", "--on-truncated", "continue", *extra]
    with ChatServer(*target, edit=edit) as server:
        status = regenerate_module().main(argv + ["--server", server.url])
    return status, out


def poison_second_record(payload):
    """An `edit` that spoils the reply to the second record's first question."""
    second = list(sc.conversations(29, 4))[1][0]["content"]
    return lambda body, reply: payload(reply) if body["messages"][-1]["content"] == second else reply


def lone_surrogate(reply):
    text = json.dumps(reply).replace('"content": "', '"content": "\\ud800', 1)
    return text.encode()


def a_mebibyte_answer(reply):
    reply["choices"][0]["message"]["content"] = "x" * (1 << 21)
    return reply


@pytest.mark.parametrize("payload, reason", [
    (lone_surrogate, "the answer is not valid Unicode (a lone surrogate \\ud800 at character 0"),
    (a_mebibyte_answer, "the server's reply is over 77824 bytes, far beyond what --max-new-tokens 8 allows"),
])
def test_a_bad_answer_names_its_record_and_the_other_shards_finish(target, tmp_path, capsys, payload, reason):
    status, out = hostile(tmp_path, target, poison_second_record(payload))
    err = capsys.readouterr().err
    assert status == 1 and "Traceback" not in err
    assert f"record 1 failed: {tmp_path / 'in-messages.jsonl'}:2: turn 0: {reason}" in err, err
    assert "--bad-records skip leaves the record out" in err
    assert sorted(n for n in os.listdir(out) if not n.startswith(".")) == \
        ["_manifest.json", "_shard-00000.failed.json", "shard-00001.jsonl"]
    assert os.path.getsize(out / "shard-00001.jsonl") < 10_000
    status, out = hostile(tmp_path / "skip", target, poison_second_record(payload), "--bad-records", "skip",
                          "--max-bad-fraction", "0.5")
    err = capsys.readouterr().err
    assert status == 0 and f"[data] skipped: record 1: {tmp_path / 'skip' / 'in-messages.jsonl'}:2: turn 0: " \
        f"{reason}" in err, err
    assert [len(r["messages"]) for r in written(out)] == [2, 2, 2] and "1 bad records left out" in err


def test_with_a_tokenizer_records_are_checked_before_they_are_sent(target, tmp_path, capsys):
    """--tokenizer: the roles of the training job and the target's context are checked before a request is sent
    (a system turn, which the tiny target's template supervises as the assistant's, and a 3,000-word prompt)."""
    convs = list(sc.conversations(29, 3))
    records = [{"messages": convs[0]}, {"messages": [{"role": "system", "content": "be brief"}] + convs[1]},
               {"messages": [{"role": "user", "content": "repeat " + " ".join(["white"] * 3000)}]},
               {"messages": convs[2]}]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    argv = ["--input", str(path), "--output", str(tmp_path / "out"), "--model", "tiny", "--max-new-tokens", "8",
            "--tokenizer", SHIPPED_TARGET_DIR, "--on-truncated", "continue", "--bad-records", "skip",
            "--max-bad-fraction", "0.5"]
    with ChatServer(*target) as server:
        assert regenerate_module().main(argv + ["--server", server.url]) == 0
    err = capsys.readouterr().err
    assert f'[data] skipped: {path}:2: message 0: role is "system", not one of the roles the chat template renders ' \
        "(user, assistant)" in err
    assert f"[data] skipped: {path}:3: its prompt (the turns without the answers) is " in err
    assert [r["messages"][0] for r in written(tmp_path / "out")] == [convs[0][0], convs[2][0]]
    assert all(r["messages"][0]["role"] == "user" and len(r["messages"]) == 1 for r in server.requests)
    assert len(server.requests) == 2
