"""Every entry point takes the target as a hub id, read from a pre-filled Hugging Face cache offline (no request),
and says the same one line when the id is neither a directory nor in the cache.

The entry points: `pretrain_dflash.py --target` (a short run), `tools/cache_target_states.py --target` (a small
cache), `tools/regenerate_data.py --target` (two answers), `tools/evaluate_acceptance.py --target` (its
argument check) and `tools/check_serving.py --target` (the check of the short run's export)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from entry_points import cache_states_module, child_env, evaluate_module, regenerate_module, tool_module
from hub_cache import HUB_ID, fill_hub_cache, offline_hub_env
from megatron_dflash.embedded_job import synthetic_corpus as sc
from repo_paths import REPO_ROOT
from training_runs import SHORT, STEPS_ARGS, run_training

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """The shipped tiny target as HUB_ID in a hub cache under tmp_path, offline; its snapshot directory."""
    cache = str(tmp_path / "hub")
    snapshot = fill_hub_cache(cache)
    for key, value in offline_hub_env(cache).items():
        monkeypatch.setenv(key, value)
    return snapshot


def test_training_and_the_serving_check_run_on_a_hub_id(hub, tmp_path, capsys):
    result = run_training(["--target", HUB_ID, "--dflash-export", str(tmp_path / "hf"), "--run-dir", str(tmp_path),
                           *STEPS_ARGS, *SHORT])
    args = json.load(open(os.path.join(tmp_path, "args.json")))
    assert args["target"] == hub  # every step after the command line works on the local snapshot
    assert os.path.isfile(os.path.join(tmp_path, "hf", "config.json")) and result.stopped_by is None
    # the serving check reads the target from the same snapshot; its serve commands keep the hub id
    capsys.readouterr()
    tool_module("check_serving").main([str(tmp_path / "hf"), "--target", HUB_ID])
    out = capsys.readouterr().out
    assert f"vllm serve {HUB_ID} --speculative-config" in out and "is not a row" not in out, out


def test_the_target_cache_writer_takes_a_hub_id(hub, tmp_path):
    cache = tmp_path / "states"
    argv = ["--target", HUB_ID, *STEPS_ARGS, "--synthetic-train-samples", "4", "--synthetic-valid-samples", "2",
            "--micro-batch-size", "2", "--global-batch-size", "2", "--dflash-target-cache", str(cache)]
    assert cache_states_module().main(argv) == 0
    assert os.path.isfile(cache / "index.json")


def test_regeneration_and_evaluation_take_a_hub_id(hub, tmp_path):
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": c[:1]}) + "\n" for c in sc.conversations(5, 2)))
    out = tmp_path / "regen"
    assert regenerate_module().main(["--input", str(chats), "--output", str(out), "--target", HUB_ID,
                                     "--dtype", "float32", "--max-new-tokens", "4"]) == 0
    manifest = json.load(open(out / "_manifest.json"))
    assert manifest["target"] == HUB_ID  # the manifest stays valid on a machine whose cache lies elsewhere

    tool = evaluate_module()
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"text": "count from 1 to 5"}\n')
    args = tool.build_parser().parse_args(["--target", HUB_ID, "--tokenizer", HUB_ID, "--draft", str(draft),
                                           "--prompts", str(prompts)])
    tool.check_paths(args)
    assert args.target == hub and args.tokenizer == hub  # the models load from the snapshot, no hub request


ENTRY_POINTS = {
    "pretrain_dflash.py": ["pretrain_dflash.py", "--data-format", "synthetic"],
    "cache_target_states.py": ["tools/cache_target_states.py", "--data-format", "synthetic",
                               "--dflash-target-cache", "states"],
    "regenerate_data.py": ["tools/regenerate_data.py", "--input", "chats.jsonl", "--output", "regen"],
    "evaluate_acceptance.py": ["tools/evaluate_acceptance.py", "--draft", "draft", "--prompts", "prompts.jsonl"],
    "check_serving.py": ["tools/check_serving.py", "draft"],
}


def test_a_missing_hub_id_is_the_same_line_from_every_entry_point(tmp_path):
    """Exit status 2 and one `PROG: error:` line, before torch loads, with the same message after the prefix."""
    cache = tmp_path / "empty-hub"
    cache.mkdir()
    (tmp_path / "chats.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    (tmp_path / "prompts.jsonl").write_text('{"text": "hi"}\n')
    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "config.json").write_text("{}")
    messages = {}
    for prog, words in ENTRY_POINTS.items():
        script = os.path.join(REPO_ROOT, words[0])
        done = subprocess.run([sys.executable, script, *words[1:], "--target", "Org/Absent-8B"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120,
                              env=child_env(OMP_NUM_THREADS="1", **offline_hub_env(str(cache))))
        assert done.returncode == 2, (prog, done.stderr)
        assert done.stderr.count("\n") == 1 and done.stderr.startswith(f"{prog}: error: "), (prog, done.stderr)
        messages[prog] = done.stderr[len(f"{prog}: error: "):]
    assert len(set(messages.values())) == 1, messages
    assert "Org/Absent-8B" in messages[prog] and str(cache) in messages[prog]
