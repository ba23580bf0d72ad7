"""A training run with a reduced draft vocabulary (docs/design.md §20), end to end: the counting tool's file read
back by the run (and refused when it does not fit), the share of labels outside in the metrics, the export in
the serving layout, the head's rows frozen copies of the target's unless trained."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from megatron_dflash.training.arguments import ArgumentError
from entry_points import child_env, tool_module
from repo_paths import REPO_ROOT
from training_runs import SHORT, STEPS_ARGS, run_main, run_training, safetensors_of, training_argv

K = 60


def _target_rows(target_dir: str, ids: list) -> torch.Tensor:
    weights = safetensors_of(target_dir)
    head = weights.get("lm_head.weight", weights.get("model.embed_tokens.weight"))
    return head[torch.tensor(ids)].float()


def test_counted_vocabulary_trains_exports_and_is_checked(tiny_target, tmp_path):
    vocab_file = tmp_path / "vocab.json"
    tool = [sys.executable, os.path.join(REPO_ROOT, "tools", "count_draft_vocab.py"), "--output", str(vocab_file),
            "--target", tiny_target, *STEPS_ARGS, "--dflash-draft-vocab-size", str(K)]
    done = subprocess.run(tool, capture_output=True, text=True, env=child_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    chosen = json.loads(vocab_file.read_text())
    assert len(chosen["ids"]) == K and 0 < chosen["covered_tokens"] < chosen["label_tokens"]
    again = subprocess.run(tool[:3] + [str(tmp_path / "again.json")] + tool[4:], capture_output=True, text=True,
                           env=child_env(), timeout=600)
    assert again.returncode == 0 and (tmp_path / "again.json").read_text() == vocab_file.read_text()

    run = run_training(training_argv(tiny_target, tmp_path / "run", *SHORT, "--dflash-draft-vocab-size", str(K),
                                     "--dflash-draft-vocab", str(vocab_file)))
    assert run.iterations == 2 and all(math.isfinite(x) for x in run.losses)
    assert all(0.0 < m["out_of_draft_vocab"] < 1.0 for m in run.metrics)
    config = json.loads((tmp_path / "run" / "hf" / "config.json").read_text())
    tensors = safetensors_of(str(tmp_path / "run" / "hf"))
    assert config["draft_vocab_size"] == K
    ids = (tensors["d2t"] + torch.arange(K)).tolist()
    assert ids == chosen["ids"] and torch.nonzero(tensors["t2d"]).view(-1).tolist() == ids
    assert torch.equal(tensors["lm_head.weight"].float(), _target_rows(tiny_target, ids))  # frozen copies

    trained = run_training(training_argv(tiny_target, tmp_path / "trained", *SHORT, "--dflash-draft-vocab-size", str(K),
                                         "--dflash-train-draft-head"))
    assert trained.iterations == 2
    rows = safetensors_of(str(tmp_path / "trained" / "hf"))["lm_head.weight"].float()
    assert not torch.equal(rows, _target_rows(tiny_target, ids))

    with pytest.raises(ArgumentError, match="draft_vocab_size is 60 but this run.s is 50"):
        run_training(training_argv(tiny_target, tmp_path / "bad", *SHORT, "--dflash-draft-vocab-size", "50",
                                   "--dflash-draft-vocab", str(vocab_file)))


def _count(tiny_target, output, capsys, monkeypatch):
    """`tools/count_draft_vocab.py --output OUTPUT ...` in this process: (exit status, stderr)."""
    monkeypatch.setenv("MEGATRON_DFLASH_DEBUG", "0")
    capsys.readouterr()
    try:
        status = tool_module("count_draft_vocab").main(["--output", str(output), "--target", tiny_target, *STEPS_ARGS,
                                                        "--dflash-draft-vocab-size", str(K)])
    except SystemExit as stop:
        status = stop.code
    return status, capsys.readouterr().err


def _one_line(err: str) -> str:
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err[-3000:]
    return err.strip()


BAD_FILES = {  # name: (what is changed in the tool's file, what the run's one line says of it)
    "fractional-id": (lambda d: d["ids"].__setitem__(7, d["ids"][7] + 0.5), "ids[7] is {value}, not an integer token id"),
    "string-id": (lambda d: d["ids"].__setitem__(7, str(d["ids"][7])), "ids[7] is '{value}', not an integer token id"),
    "out-of-range-id": (lambda d: d["ids"].__setitem__(-1, d["target_vocab_size"]),
                        "ids[59] is {vocab}, outside [0, {vocab}) (the target vocabulary)"),
    "no-ids": (lambda d: d.pop("ids"), "no ids field"),
}


def test_the_tools_output_is_checked_before_counting_and_a_missing_folder_made(tiny_target, tmp_path, capsys, monkeypatch):
    (tmp_path / "taken").mkdir()
    (tmp_path / "a-file").write_text("x")
    for output, said in ((tmp_path / "taken", f"--output {tmp_path / 'taken'} is a directory; give a file name"),
                         (tmp_path / "a-file" / "vocab.json", f"{tmp_path / 'a-file'} is a file, not a directory")):
        status, err = _count(tiny_target, output, capsys, monkeypatch)  # refused before anything is counted
        assert status == 2 and said in _one_line(err), err
    assert os.listdir(tmp_path / "taken") == [] and (tmp_path / "a-file").read_text() == "x"
    good = tmp_path / "new" / "folder" / "vocab.json"  # a missing folder is made
    status, err = _count(tiny_target, good, capsys, monkeypatch)
    assert status == 0 and "Traceback" not in err, err
    assert os.listdir(good.parent) == ["vocab.json"]


def test_a_vocabulary_file_with_a_bad_id_stops_the_run_in_one_line(tiny_target, tmp_path, capsys, monkeypatch):
    good = tmp_path / "vocab.json"
    assert _count(tiny_target, good, capsys, monkeypatch)[0] == 0
    chosen = json.loads(good.read_text())
    for case, (change, said) in BAD_FILES.items():
        data = json.loads(good.read_text())
        change(data)
        bad = tmp_path / f"{case}.json"
        bad.write_text(json.dumps(data))
        status, err = run_main(training_argv(tiny_target, tmp_path / case, *SHORT, "--dflash-draft-vocab-size", str(K),
                                             "--dflash-draft-vocab", str(bad)), capsys, monkeypatch)
        expected = said.format(value=chosen["ids"][7] + (0.5 if case.startswith("fractional") else 0),
                               vocab=chosen["target_vocab_size"])
        line = _one_line(err)
        assert status != 0 and f"--dflash-draft-vocab: {bad}: {expected}" in line, (case, line)
        assert not (tmp_path / case / "hf").exists()
