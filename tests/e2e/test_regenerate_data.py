"""`tools/regenerate_data.py` end to end: killed (SIGKILL) at random points and rerun, its output equals an
uninterrupted run byte for byte; under `torchrun` with two ranks it writes what one rank writes."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from chat_server import ChatServer, load_tiny_target
from entry_points import child_env, regenerate_module
from megatron_dflash.embedded_job import synthetic_corpus as sc
from megatron_dflash.embedded_job.tiny_target import SHIPPED_TARGET_DIR
from repo_paths import REPO_ROOT

TOOL = os.path.join(REPO_ROOT, "tools", "regenerate_data.py")
KILLS = 10
RECORDS = 24  # one per shard: a kill lands in a shard, between two, or while one is written


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    convs = list(sc.conversations(31, RECORDS + 1))
    records = [{"messages": c} for c in convs[:RECORDS - 1]] + [{"messages": convs[-2] + convs[-1]}]
    path = tmp_path_factory.mktemp("input") / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def every_file(out) -> dict:
    """Every entry of the output directory (hidden leftovers too) and its bytes."""
    return {n: open(os.path.join(out, n), "rb").read() for n in sorted(os.listdir(out))}


def server_command(chats, out, url) -> list:
    return [sys.executable, TOOL, "--input", chats, "--output", str(out), "--server", url, "--model", "tiny",
            "--max-new-tokens", "10", "--shard-size", "1", "--concurrency", "2", "--seed", "3"]


def shards_done(out) -> int:
    return sum(n.startswith("shard-") for n in os.listdir(out)) if os.path.isdir(out) else 0


def kill_at_random(command, out, env, rng, per_shard: float) -> bool:
    """Run `command`, SIGKILL it after a random part of its next shard (or two); whether it was still running."""
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for = shards_done(out) + rng.randrange(2)
    while proc.poll() is None and shards_done(out) < wait_for:
        time.sleep(0.005)
    time.sleep(rng.uniform(0.0, per_shard))
    alive = proc.poll() is None
    if alive:
        proc.send_signal(signal.SIGKILL)
    proc.wait()
    return alive


def test_killed_at_random_points_and_rerun_equals_an_uninterrupted_run(chats, tmp_path):
    env = child_env(OMP_NUM_THREADS="1")
    rng = random.Random(0)
    with ChatServer(*load_tiny_target()) as server:
        start = time.monotonic()
        subprocess.run(server_command(chats, tmp_path / "whole", server.url), env=env, check=True,
                       capture_output=True)
        per_shard = (time.monotonic() - start) / RECORDS
        out, killed = tmp_path / "killed", 0
        while killed < KILLS and shards_done(out) < RECORDS:
            killed += kill_at_random(server_command(chats, out, server.url), out, env, rng, per_shard)
        done = subprocess.run(server_command(chats, out, server.url), env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert killed == KILLS
    assert every_file(out) == every_file(tmp_path / "whole")


def test_two_torchrun_ranks_write_what_one_rank_writes(chats, tmp_path):
    env = child_env(OMP_NUM_THREADS="1")
    args = ["--input", chats, "--target", SHIPPED_TARGET_DIR, "--dtype", "float32", "--max-new-tokens", "8",
            "--shard-size", "4", "--batch-size", "3", "--on-truncated", "drop-rest"]
    one = subprocess.run([sys.executable, TOOL, *args, "--output", str(tmp_path / "one")], env=env,
                         capture_output=True, text=True)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", TOOL, *args,
                          "--output", str(tmp_path / "two")], env=env, capture_output=True, text=True)
    assert two.returncode == 0, two.stderr
    assert "rank 0: 12 records in 3 new shards" in two.stderr and "rank 1: 12 records in 3 new shards" in two.stderr
    assert every_file(tmp_path / "two") == every_file(tmp_path / "one")


def test_the_output_directory_is_train_data_as_it_is(chats, tmp_path, capsys, monkeypatch):
    """Regenerate, then `pretrain_dflash.py --train-data OUT`: the shards are read, the manifest and a failed
    shard's record (names starting with '_') are not data. A record with a role the training job refuses (a
    system turn: the tiny target's template supervises it as the assistant's) is refused by regeneration
    too, by the same rule: named (fail), or left out (skip), so training reads every record written."""
    from training_runs import SHORT, TINY_DRAFT, run_main

    from megatron_dflash.data.datasets import ChatDataset
    from megatron_dflash.embedded_job.synthetic_corpus import build_tokenizer

    lines = open(chats).readlines()
    system = json.loads(lines[12])
    system["messages"].insert(0, {"role": "system", "content": "be brief"})
    lines.insert(13, json.dumps(system) + "\n")
    with_system = tmp_path / "with_system.jsonl"
    with_system.write_text("".join(lines))
    out = tmp_path / "regen"
    args = ["--input", str(with_system), "--output", str(out), "--target", SHIPPED_TARGET_DIR, "--dtype", "float32",
            "--max-new-tokens", "8", "--shard-size", "10", "--batch-size", "8", "--on-truncated", "continue"]
    assert regenerate_module().main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"regenerate_data.py: error: {with_system}:14: message 0: role is \"system\", not one of the "
                       "roles the chat template renders (user, assistant); --bad-records skip leaves such records out.")
    assert sorted(os.listdir(out)) == ["_manifest.json", "shard-00000.jsonl"]  # the shard before it is done
    assert regenerate_module().main(args + ["--bad-records", "skip", "--max-bad-fraction", "0.1"]) == 2
    assert "another bad_records" in capsys.readouterr().err  # the policy is the manifest's: a new directory
    out = tmp_path / "regen_skip"
    args[3] = str(out)
    assert regenerate_module().main(args + ["--bad-records", "skip", "--max-bad-fraction", "0.1"]) == 0
    assert f"[data] skipped: {with_system}:14: message 0: role is \"system\"" in capsys.readouterr().err
    (out / "_shard-00009.failed.json").write_text('[{"id": "x", "error": "an old failure"}]\n')
    assert sorted(os.listdir(out)) == ["_manifest.json", "_shard-00009.failed.json", "shard-00000.jsonl",
                                       "shard-00001.jsonl", "shard-00002.jsonl"]
    assert len(ChatDataset(str(out), build_tokenizer(), 48, log=lambda s: None)) == RECORDS
    status, err = run_main(["--target", SHIPPED_TARGET_DIR, "--data-format", "chat", "--train-data", str(out),
                            "--run-dir", str(tmp_path / "run"), *TINY_DRAFT, "--no-progress-bar", "--seq-length",
                            "48", "--dflash-anchors-per-sample", "4", *SHORT], capsys, monkeypatch)
    assert status == 0, err
    assert os.path.isfile(tmp_path / "run" / "hf" / "model.safetensors")


@pytest.mark.parametrize("extra, message", [
    (["--target", "t", "--server", "http://h:1", "--model", "m"], "pass exactly one of --target"),
    (["--server", "http://h:1", "--model", "m", "--chat-template", "t.jinja"], "--chat-template is for --target"),
    (["--target", SHIPPED_TARGET_DIR, "--chat-template", "missing.jinja"], "--chat-template missing.jinja: no such"),
    (["--server", "http://h:1", "--model", "m", "--timeout", "0"], "--timeout must be > 0"),
    (["--server", "127.0.0.1:8000", "--model", "m"], "--server 127.0.0.1:8000: not an http:// or https:// URL"),
    (["--target", "t", "--on-truncated", "keep"], "argument --on-truncated: invalid choice: 'keep'"),
    (["--server", "http://h:1"], "--server needs --model"),
    (["--target", "t", "--chat-template-kwargs", "[1]"], "--chat-template-kwargs must be a JSON object"),
    (["--target", "t", "--shard-size", "0"], "--shard-size must be at least 1"),
])
def test_a_bad_command_line_is_one_line_and_status_2(chats, tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as stop:
        regenerate_module().main(["--input", chats, "--output", str(tmp_path / "out"), *extra])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and message in err and not (tmp_path / "out").exists()


def test_chat_template_renders_the_prompts_and_is_the_manifests(chats, tmp_path, capsys):
    """--chat-template FILE, as in training and evaluation: the prompts are rendered with it (here a template
    that asks for "think" after the assistant header, so the answers differ), and a rerun with another
    template is refused."""
    from megatron_dflash.embedded_job.synthetic_corpus import CHAT_TEMPLATE

    template = tmp_path / "thinking.jinja"
    template.write_text(CHAT_TEMPLATE.replace("<|assistant|> {% endif %}", "<|assistant|> think {% endif %}"))
    assert template.read_text() != CHAT_TEMPLATE
    args = ["--input", chats, "--target", SHIPPED_TARGET_DIR, "--dtype", "float32", "--max-new-tokens", "6",
            "--shard-size", "100", "--on-truncated", "continue"]
    assert regenerate_module().main(args + ["--output", str(tmp_path / "plain")]) == 0
    assert regenerate_module().main(args + ["--output", str(tmp_path / "think"), "--chat-template", str(template)]) == 0
    plain, think = (open(tmp_path / d / "shard-00000.jsonl").read() for d in ("plain", "think"))
    assert plain != think
    manifest = json.load(open(tmp_path / "think" / "_manifest.json"))
    assert manifest["chat_template_sha256"] == hashlib.sha256(template.read_bytes()).hexdigest()
    capsys.readouterr()
    assert regenerate_module().main(args + ["--output", str(tmp_path / "think")]) == 2
    assert "another chat_template_sha256" in capsys.readouterr().err


def test_a_second_run_on_one_output_directory_is_refused_while_the_first_goes_on(chats, tmp_path):
    """Two runs of other settings on one --output: the second is refused in one line naming the first, whose
    manifest stays its own; stopped, it releases the lock."""
    import socket

    env = child_env(OMP_NUM_THREADS="1")
    out = tmp_path / "out"

    def slow(body, count):  # a slow server: the first run is still going when the second starts
        time.sleep(0.05)

    with ChatServer(*load_tiny_target(), faults=slow) as server:
        first = subprocess.Popen(server_command(chats, out, server.url), env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True)
        try:
            while not (out / "_manifest.json").exists() and first.poll() is None:
                time.sleep(0.01)
            second = subprocess.run([*server_command(chats, out, server.url), "--seed", "4"], env=env,
                                    capture_output=True, text=True)
            assert first.poll() is None, "the first run ended before the second one started"
            first.send_signal(signal.SIGINT)  # the first run stops here as after a Ctrl-C: its shards stay
        finally:
            first_status = first.wait(timeout=300)
    assert second.returncode == 2 and second.stderr.count("\n") == 1, second.stderr
    assert second.stderr.startswith(f"regenerate_data.py: error: --output={out} is in use by another run (host "
                                    f"{socket.gethostname()}, pid {first.pid}, started ")
    assert first_status == 130, first.stderr.read()
    assert json.load(open(out / "_manifest.json"))["sampling"]["seed"] == 3
    assert not [n for n in os.listdir(out) if n.startswith(".")]  # its lock released, nothing staged left
