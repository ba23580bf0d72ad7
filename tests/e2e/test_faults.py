"""The fault suite: nothing lost, nothing hung, every failure explained.

Outputs that would replace what the run did not write, `--load` at the wrong kind of directory,
trackers naming missing checkpoints, ranks launched with different arguments or seeing different
trackers, resumes with another draft, data with nothing to learn, damaged checkpoints, stale
temporaries, a diverging loss, two runs on one save directory, SIGTERM / SIGINT (real processes of
pretrain_dflash.py where the behaviour is the process's: its exit status, its lock, its signals).
Multi-rank cases run on the gloo pool with a timeout, so a hang fails the test.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest
import torch

from megatron_dflash.training.arguments import ArgumentError, parse_args
from megatron_dflash.common.errors import CheckpointError, DataError, RunError
from megatron_dflash.training.job import prepare_job
from entry_points import cache_states_module, child_env, regenerate_module
from training_runs import (
    MULTI_RANK_TIMEOUT_S,
    SHORT,
    STEPS_ARGS,
    TINY_DRAFT,
    copy_save,
    run_main,
    run_training,
    safetensors_of,
    training_argv,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _job_error(tiny_target, tmp_path, *argv):
    with pytest.raises(ArgumentError) as info:
        prepare_job(parse_args(["--target", tiny_target, "--data-format", "synthetic", *TINY_DRAFT, *argv]), 1, env={}, cuda=False)
    message = str(info.value)
    assert "\n" not in message
    return message


# ------------------------------------------------------------------------------------------ 1. data loss


def test_export_never_replaces_the_checkpoints_or_foreign_files(tiny_target, tmp_path, trained):
    save = copy_save(trained, tmp_path)
    before = sorted(os.listdir(save))
    # the export directory may not be the --save directory, nor contain it or any input
    assert "is or contains --save" in _job_error(tiny_target, tmp_path, "--save", str(save),
                                                 "--dflash-export", str(save))
    assert "is or contains --save" in _job_error(tiny_target, tmp_path, "--save", str(save),
                                                 "--dflash-export", str(tmp_path))
    assert "is or contains --load" in _job_error(tiny_target, tmp_path, "--load", str(save),
                                                 "--dflash-export", str(save))
    assert "is or contains --target" in _job_error(tiny_target, tmp_path, "--dflash-export", tiny_target)
    # a directory with files the run did not write is never replaced
    foreign = tmp_path / "results"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert "holds files this run did not write" in _job_error(tiny_target, tmp_path, "--dflash-export", str(foreign))
    # an output path under a regular file fails before training, not after it
    (tmp_path / "file").write_text("x")
    assert "is a file, not a directory" in _job_error(tiny_target, tmp_path, "--dflash-export",
                                                      str(tmp_path / "file" / "hf"))
    assert "is a file, not a directory" in _job_error(tiny_target, tmp_path, "--save", str(tmp_path / "file" / "c"))
    assert sorted(os.listdir(save)) == before and (foreign / "notes.txt").read_text() == "mine"


def test_export_replaces_only_its_own_runs_export(tiny_target, tmp_path):
    save, export = tmp_path / "ckpt", tmp_path / "export"
    argv = ["--target", tiny_target, *STEPS_ARGS, *SHORT, "--save", str(save), "--dflash-export", str(export)]
    run_training(argv)
    mode = stat.S_IMODE(os.stat(export / "model.safetensors").st_mode)
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o666 & ~umask  # readable by the cluster (0644 with the usual umask), not 0600
    # the same run, restarted for more steps: its own export is replaced
    again = run_training(argv[:argv.index("--train-iters")] + ["--train-iters", "3"] + argv[argv.index("--train-iters") + 2:]
                         + ["--load", str(save)])
    assert again.start_iteration == 2 and again.export_dir == str(export)
    # another run (another --save) may not replace it
    other = ["--target", tiny_target, *STEPS_ARGS, *SHORT, "--save", str(tmp_path / "other"),
             "--dflash-export", str(export)]
    with pytest.raises(ArgumentError, match=r"holds the export of another run \(--save "):
        run_training(other)


class _Killed(BaseException):
    """A process killed at this point (nothing after it runs, no `except Exception` catches it)."""


def test_an_export_is_published_with_its_marker(tiny_target, tmp_path, monkeypatch):
    """The run's marker is inside the export's staged directory before the rename: a kill right after the
    rename leaves an export that the rerun of the same run accepts (and replaces), never a foreign-looking one."""
    from megatron_dflash.common import atomic
    from megatron_dflash.training.outputs import EXPORT_MARKER

    save, export = tmp_path / "ckpt", tmp_path / "export"
    argv = ["--target", tiny_target, *STEPS_ARGS, *SHORT, "--save", str(save), "--dflash-export", str(export)]
    real_publish, published_files = atomic.publish_directory, []

    def publish_then_die(staged, output, *, replace):
        real_publish(staged, output, replace=replace)
        if os.path.abspath(output) == str(export):
            published_files.append(sorted(os.listdir(output)))  # what the rename made visible
            raise _Killed()  # killed right after the export's rename

    monkeypatch.setattr(atomic, "publish_directory", publish_then_die)
    with pytest.raises(_Killed):
        run_training(argv)
    monkeypatch.setattr(atomic, "publish_directory", real_publish)
    again = run_training(argv + ["--load", str(save)])  # the restart: its own export, replaced (not refused as foreign)
    assert again.start_iteration == 2 and again.export_dir == str(export)
    assert published_files and EXPORT_MARKER in published_files[0], published_files
    assert json.loads((export / EXPORT_MARKER).read_text())["run"] == os.path.realpath(save)


def test_load_layouts_are_recognised(tiny_target, tmp_path, trained):
    from megatron_dflash.training.resume import find_resume_point

    assert find_resume_point(str(tmp_path / "absent")) is None
    (tmp_path / "empty").mkdir()
    assert find_resume_point(str(tmp_path / "empty")) is None
    point = find_resume_point(str(trained))
    assert point.iteration == 2 and point.directory.endswith("iter_0000002")

    def refused(path, *expected):
        with pytest.raises(CheckpointError) as info:
            find_resume_point(str(path))
        for text in expected:
            assert text in str(info.value), str(info.value)
        assert "\n" not in str(info.value)

    refused(trained / "iter_0000002", "is one checkpoint, not a save directory", f"--load {trained}")
    no_tracker = copy_save(trained, tmp_path, "no_tracker")
    os.remove(no_tracker / "latest_checkpointed_iteration.txt")
    refused(no_tracker, "no latest_checkpointed_iteration.txt", "complete checkpoints are [1, 2]", "echo 2 >")
    hf = tmp_path / "hf"
    run_training(training_argv(tiny_target, tmp_path, *SHORT))
    refused(hf, "is a HF drafter directory", f"--dflash-init-from {hf}")
    (tmp_path / "typo").mkdir()
    (tmp_path / "typo" / "data.bin").write_text("x")
    refused(tmp_path / "typo", "holds no checkpoint (data.bin)")
    # a tracker naming a missing or incomplete checkpoint is an error, never an older one or scratch
    missing = copy_save(trained, tmp_path, "missing")
    shutil.rmtree(missing / "iter_0000002")
    refused(missing, "names iteration 2 but", "does not exist", "complete checkpoints are [1]")
    incomplete = copy_save(trained, tmp_path, "incomplete")
    os.remove(incomplete / "iter_0000002" / "common.pt")
    refused(incomplete, "is incomplete")
    only = copy_save(trained, tmp_path, "only")
    shutil.rmtree(only / "iter_0000001")
    shutil.rmtree(only / "iter_0000002")
    refused(only, "names iteration 2 but", "holds no complete checkpoint")
    binary = copy_save(trained, tmp_path, "binary")
    (binary / "latest_checkpointed_iteration.txt").write_bytes(b"\xff\xfe\x00garbage")
    refused(binary, "is not a text file")
    # the temporaries of an interrupted first save do not count as content
    first = tmp_path / "first"
    (first / ".iter_0000001.tmp").mkdir(parents=True)
    assert find_resume_point(str(first)) is None


def test_load_at_a_wrong_directory_never_overwrites_the_checkpoints(tiny_target, tmp_path, trained):
    """--load at an iter_* directory with --save on the real directory: refused, nothing rewound."""
    save = copy_save(trained, tmp_path)
    tracker = (save / "latest_checkpointed_iteration.txt").read_text()
    listing = sorted(os.listdir(save))
    with pytest.raises(CheckpointError, match="is one checkpoint, not a save directory"):
        run_training(training_argv(tiny_target, tmp_path, *SHORT, "--save", str(save), "--load", str(save / "iter_0000001")))
    assert (save / "latest_checkpointed_iteration.txt").read_text() == tracker
    assert sorted(os.listdir(save)) == listing


def test_load_of_an_absent_directory_trains_from_scratch_loudly(tiny_target, tmp_path, capsys):
    result = run_training(training_argv(tiny_target, tmp_path, *SHORT, "--load", str(tmp_path / "new"), "--save",
                                        str(tmp_path / "new")))
    assert result.start_iteration == 0 and result.iterations == 2
    assert "TRAINING FROM SCRATCH" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------ 3. draft config


def test_resume_refuses_a_different_draft(tiny_target, tmp_path, trained):
    save = copy_save(trained, tmp_path)
    more = [a if a != "2" else "3" for a in SHORT]  # --train-iters 3
    mask = prepare_job(parse_args(["--target", tiny_target, "--data-format", "synthetic", *TINY_DRAFT]), 1, env={},
                       cuda=False).draft_config.mask_token_id
    for flag, value, field in (("--dflash-target-layer-ids", "1,2", "target_layer_ids"),
                               ("--dflash-mask-token-id", str(mask - 1), "mask_token_id"),
                               ("--dflash-block-size", "4", "block_size")):
        with pytest.raises(CheckpointError) as info:
            run_training(training_argv(tiny_target, tmp_path, *more, "--load", str(save), flag, value))
        message = str(info.value)
        assert f"{field}: checkpoint" in message and "--dflash-override-checkpoint-config" in message, message
        assert "was None in the checkpoint" not in message
    # the explicit override resumes (the weights' shapes do not depend on the MASK token)
    result = run_training(training_argv(tiny_target, tmp_path, *more, "--load", str(save), "--dflash-mask-token-id", str(mask - 1),
                                        "--dflash-override-checkpoint-config"))
    assert result.start_iteration == 2 and result.iterations == 3


# ------------------------------------------------------------------------------------------ 2. ranks agree


def _rank_run(rank, world_size, target, out_dir, per_rank: dict, patch_rank=None):
    """One DP rank of a launch; `per_rank[rank]` extra arguments; returns the error line or the result."""
    import pathlib

    from megatron_dflash.training import checkpointing, resume

    torch.set_num_threads(1)
    if rank == patch_rank:
        # this rank would see no checkpoint (a stale view of a shared file system): it must not matter,
        # the tracker is read on rank 0 only
        checkpointing.read_latest_iteration = lambda *a, **k: None
        resume.find_resume_point = lambda *a, **k: (_ for _ in ()).throw(AssertionError("rank 1 read the tracker"))
    argv = training_argv(target, pathlib.Path(out_dir), "--micro-batch-size", "4", "--global-batch-size", "8",
                         "--dflash-eval-prompts", "0", *per_rank.get(rank, []))
    try:
        result = run_training(argv)
    except RunError as err:
        return "error", str(err)
    return "ok", (result.start_iteration, result.iterations, result.losses)


def test_ranks_launched_with_different_arguments_stop_alike(tp_pool, tiny_target, tmp_path):
    pool = tp_pool(2)
    results = pool.run(_rank_run, tiny_target, str(tmp_path / "a"),
                       {0: ["--train-iters", "2"], 1: ["--train-iters", "2", "--lr", "3e-3", "--seed", "7"]},
                       tp=1, timeout=MULTI_RANK_TIMEOUT_S)
    assert results[0] == results[1] and results[0][0] == "error", results
    message = results[0][1]
    assert "--lr (rank 0: 0.002; rank 1: 0.003)" in message and "--seed (rank 0: 1234; rank 1: 7)" in message
    # a shape-changing difference (block size) is caught the same way, before any collective of the model
    results = pool.run(_rank_run, tiny_target, str(tmp_path / "b"),
                       {0: ["--train-iters", "2"], 1: ["--train-iters", "2", "--dflash-block-size", "4"]},
                       tp=1, timeout=MULTI_RANK_TIMEOUT_S)
    assert results[0] == results[1] and results[0][0] == "error"
    assert "draft config block_size (rank 0: 8; rank 1: 4)" in results[0][1]


def test_resume_iteration_is_read_once_and_shared(tp_pool, tiny_target, tmp_path, trained):
    """Rank 1 sees no checkpoint; both ranks still resume at iteration 2 (rank 0's reading)."""
    save = copy_save(trained, tmp_path)
    extra = ["--train-iters", "3", "--load", str(save)]
    results = tp_pool(2).run(_rank_run, tiny_target, str(tmp_path / "r"), {0: extra, 1: extra}, 1,
                             tp=1, timeout=MULTI_RANK_TIMEOUT_S)
    assert results[0] == results[1], results
    assert results[0][0] == "ok" and results[0][1][:2] == (2, 3)
    # an unusable checkpoint: the same one-line error on every rank, no hang
    missing = copy_save(trained, tmp_path, "missing")
    shutil.rmtree(missing / "iter_0000002")
    extra = ["--train-iters", "3", "--load", str(missing)]
    results = tp_pool(2).run(_rank_run, tiny_target, str(tmp_path / "m"), {0: extra, 1: extra},
                             tp=1, timeout=MULTI_RANK_TIMEOUT_S)
    assert results[0] == results[1] and results[0][0] == "error" and "names iteration 2 but" in results[0][1]


# ------------------------------------------------------------------------------------------ 7. explained


def test_damaged_checkpoints_end_in_one_line(tiny_target, tmp_path, trained, capsys, monkeypatch):
    """Zero-length shard, missing common.pt, binary tracker, garbage shard: one line naming the file, exit 1."""
    zero = copy_save(trained, tmp_path, "zero")
    shard = next(p for p in sorted(os.listdir(zero / "iter_0000002")) if p.endswith(".distcp"))
    (zero / "iter_0000002" / shard).write_bytes(b"")
    common = copy_save(trained, tmp_path, "common")
    os.remove(common / "iter_0000002" / "common.pt")
    binary = copy_save(trained, tmp_path, "binary")
    (binary / "latest_checkpointed_iteration.txt").write_bytes(b"\x80\x81\x82")
    bad = copy_save(trained, tmp_path, "bad")
    (bad / "iter_0000002" / shard).write_bytes(b"not a torch file")
    for directory, expected in ((zero, f"{shard} is empty"), (common, "is incomplete"), (binary, "not a text file"),
                                (bad, f"cannot load {bad / 'iter_0000002'}: ValueError: {bad / 'iter_0000002' / shard} "
                                      "cannot be read (UnpicklingError: not tensor data")):
        status, err = run_main(training_argv(tiny_target, tmp_path, *SHORT, "--load", str(directory)), capsys, monkeypatch)
        lines = err.strip().splitlines()
        assert status == 1 and "Traceback" not in err, err[-2000:]
        assert lines[-1].startswith("pretrain_dflash.py: error:") and expected in lines[-1], err[-2000:]
    # --debug (or MEGATRON_DFLASH_DEBUG=1) shows the traceback as well
    status, err = run_main(training_argv(tiny_target, tmp_path, *SHORT, "--load", str(bad)), capsys, monkeypatch, debug=True)
    assert status == 1 and "Traceback" in err and "UnpicklingError" in err


def test_a_diverging_loss_ends_in_one_line_on_every_rank(tp_pool, tiny_target, tmp_path, capsys, monkeypatch):
    """--lr 1e9: non-finite gradients stop the run in one line naming the iteration and the fix (exit 1), on
    every rank alike."""
    argv = ["--train-iters", "6", "--micro-batch-size", "4", "--global-batch-size", "4", "--dflash-eval-prompts",
            "0", "--lr", "1e9", "--save", str(tmp_path / "ckpt"), "--save-interval", "2"]
    status, err = run_main(training_argv(tiny_target, tmp_path, *argv), capsys, monkeypatch)
    line = err.strip().splitlines()[-1]
    assert status == 1 and "Traceback" not in err and err.count("pretrain_dflash.py:") == 1, err[-2000:]
    assert line.startswith("pretrain_dflash.py: error: iteration ") and "non-finite gradients" in line
    assert "lower --lr" in line and "The last checkpoint (iteration 2) is in --save" in line
    dp2 = ["--train-iters", "6", "--lr", "1e9"]
    results = tp_pool(2).run(_rank_run, tiny_target, str(tmp_path / "dp2"), {0: dp2, 1: dp2},
                             tp=1, timeout=MULTI_RANK_TIMEOUT_S)
    assert results[0] == results[1] and results[0][0] == "error" and "non-finite gradients" in results[0][1]


# ------------------------------------------------------------------------------------------ 8. housekeeping


def test_the_next_save_removes_stale_temporaries(tiny_target, tmp_path, trained):
    save = copy_save(trained, tmp_path)
    (save / ".latest_checkpointed_iteration.txt.tmp-abc123").write_text("3")
    (save / ".iter_0000003.tmp").mkdir()
    stale_export = tmp_path / ".hf.tmp-xyz"
    stale_export.mkdir()
    (stale_export / "model.safetensors").write_bytes(b"partial")
    more = [a if a != "2" else "3" for a in SHORT]
    run_training(training_argv(tiny_target, tmp_path, *more, "--load", str(save), "--save", str(save)))
    assert sorted(p for p in os.listdir(save) if p.startswith(".")) == []
    assert not stale_export.exists()


# ------------------------------------------------------------------------------------------ 4. nothing to learn


def _chats(path, with_answer: list):
    from megatron_dflash.embedded_job.synthetic_corpus import conversations

    chats = list(conversations(7, len(with_answer)))
    with open(path, "w") as f:
        for chat, answer in zip(chats, with_answer):
            f.write(json.dumps({"messages": chat if answer else chat[:1]}) + "\n")


def _chat_args(tiny_target, tmp_path, data, *extra):
    return ["--target", tiny_target, *TINY_DRAFT, "--no-progress-bar", "--seq-length", "48", "--dflash-anchors-per-sample", "4",
            "--lr-warmup-iters", "1", "--dflash-eval-prompts", "0", "--data-format", "chat", "--train-data", str(data),
            "--dflash-export", str(tmp_path / "hf"), *extra]


def test_nothing_to_learn_fails_before_training(tiny_target, tmp_path):
    _chats(tmp_path / "prompts_only.jsonl", [False] * 6)
    with pytest.raises(DataError, match="has nothing to learn: none of its 6 samples"):
        run_training(_chat_args(tiny_target, tmp_path, tmp_path / "prompts_only.jsonl", "--train-iters", "2",
                                "--micro-batch-size", "2"))
    # packed documents all shorter than a block
    (tmp_path / "short.jsonl").write_text("".join(json.dumps({"text": "a b"}) + "\n" for _ in range(4)))
    argv = _chat_args(tiny_target, tmp_path, tmp_path / "short.jsonl", "--train-iters", "2", "--micro-batch-size", "2",
                      "--pack-sequences")
    argv[argv.index("chat")] = "text"
    with pytest.raises(DataError, match="in its own document"):
        run_training(argv)
    # texts that tokenise to (almost) nothing: refused before training, naming the file
    (tmp_path / "blank.jsonl").write_text("".join(json.dumps({"text": " "}) + "\n" for _ in range(4)))
    argv[argv.index(str(tmp_path / "short.jsonl"))] = str(tmp_path / "blank.jsonl")
    with pytest.raises(RunError, match=r"blank.jsonl\) has nothing to learn"):
        run_training(argv)
    assert not (tmp_path / "hf").exists()  # no export of an untrained draft


def test_global_batch_without_supervised_slot_does_not_step(tiny_target, tmp_path):
    """Micro-batches without a supervised slot are counted; a global batch of only those does not step the
    optimizer: the weights and the learning-rate schedule stay where they were."""
    _chats(tmp_path / "mixed.jsonl", [True, False, False, True, False, False, True, False])
    snapshots = []

    def on_step(iteration, values, body):
        snapshots.append({k: v.detach().clone() for k, v in body.state_dict().items() if torch.is_tensor(v)})

    result = run_training(_chat_args(tiny_target, tmp_path, tmp_path / "mixed.jsonl", "--train-iters", "8",
                                     "--micro-batch-size", "1", "--lr-decay-style", "linear"), hooks={"on_step": on_step})
    skipped = [i for i, loss in enumerate(result.losses) if loss != loss]  # nan: no supervised slot
    assert 0 < len(skipped) < 8 and result.skipped_steps == len(skipped) == result.empty_micro_batches
    stepped = [i for i in range(8) if i not in skipped]
    for i in skipped:
        before = snapshots[i - 1] if i > 0 else None
        if before is not None:
            assert all(torch.equal(before[k], snapshots[i][k]) for k in before)  # no update
    for i in stepped[1:]:
        assert any(not torch.equal(snapshots[i - 1][k], snapshots[i][k]) for k in snapshots[i])
    # the learning rate (read before each step) moves after a real step and only then
    lrs = result.learning_rates
    assert [lrs[i] != lrs[i - 1] for i in range(1, 8)] == [i - 1 in stepped for i in range(1, 8)], (lrs, skipped)


_UNREADABLE = "<a record the tokenizer cannot render>"


_TOKENIZER_TYPE_ERROR = "TextEncodeInput must be Union[TextInputSequence, Tuple[InputSequence, InputSequence]]"


def _dp_rank_meeting_an_unreadable_record(rank, world_size, target, data, out_dir, *extra, raises=False):
    """A DP=2 rank training on `data` (and `extra`); the record `_UNREADABLE` renders to no tokens (as a chat
    template can for a malformed chat), or with `raises` makes the tokenizer raise its own `TypeError` (as it
    does on text it cannot encode), and only DP rank 1 reads it."""
    import pathlib

    from megatron_dflash.data import datasets as data_module

    torch.set_num_threads(1)
    real = data_module.tokenize_chat  # patched where the chat dataset looks it up

    def tokenize(tokenizer, messages, **kwargs):
        if messages[0]["content"] != _UNREADABLE:
            return real(tokenizer, messages, **kwargs)
        if raises:
            raise TypeError(_TOKENIZER_TYPE_ERROR)
        return [], []

    data_module.tokenize_chat = tokenize
    out = pathlib.Path(out_dir)
    try:
        run_training(_chat_args(target, out, data, "--train-iters", "3", "--micro-batch-size", "2", "--global-batch-size", "4",
                                "--save", str(out / "ckpt"), "--save-interval", "1", *extra))
    except DataError as err:
        return str(err)
    finally:
        data_module.tokenize_chat = real
    return None


def _with_unreadable_record(tmp_path, name, step, seed, content=_UNREADABLE):
    """A copy of `tmp_path / "chats.jsonl"` whose record read first by DP rank 1 (of 2) in `step` (micro-batch 2,
    global batch 4) has `content` as its first message; (its path, its line number)."""
    from megatron_dflash.data.batching import MicroBatchIterator

    lines = (tmp_path / "chats.jsonl").read_text().splitlines()
    order = MicroBatchIterator(list(range(len(lines))), micro_batch_size=2, global_batch_size=4, dp_rank=1,
                               dp_size=2, seed=seed)
    bad = next(i for i in order.micro_batch_indices(step, 0) if i != 0)  # index 0: read by the up-front check
    chat = json.loads(lines[bad])
    chat["messages"][0]["content"] = content
    lines[bad] = json.dumps(chat)
    (tmp_path / name).write_text("\n".join(lines) + "\n")
    return str(tmp_path / name), bad + 1


def test_a_record_unreadable_on_one_data_parallel_rank_stops_every_rank(tp_pool, tiny_target, tmp_path):
    samples = 16
    _chats(tmp_path / "chats.jsonl", [True] * samples)

    def with_unreadable_record(name, step, seed):
        """A copy of the chats whose record read first by DP rank 1 (of 2) in `step` is unreadable."""
        path, line = _with_unreadable_record(tmp_path, name, step, seed)
        return path, f"{path}:{line}: the chat renders to no tokens."

    pool = tp_pool(2)
    train, expected = with_unreadable_record("train.jsonl", step=1, seed=1234)
    results = pool.run(_dp_rank_meeting_an_unreadable_record, tiny_target, train, str(tmp_path / "a"), tp=1,
                       timeout=MULTI_RANK_TIMEOUT_S)
    assert results == [expected, expected], results  # the same line on both ranks, no hang
    # the failing step is neither saved nor exported: the last checkpoint is the step before
    assert (tmp_path / "a" / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert not (tmp_path / "a" / "hf").exists()
    # the same in the validation data (read at seed + 1 from step 0 at every evaluation), after training
    valid, expected = with_unreadable_record("valid.jsonl", step=0, seed=1235)
    results = pool.run(_dp_rank_meeting_an_unreadable_record, tiny_target, str(tmp_path / "chats.jsonl"),
                       str(tmp_path / "b"), "--train-iters", "2", "--valid-data", valid, tp=1,
                       timeout=MULTI_RANK_TIMEOUT_S)
    assert results == [expected, expected], results
    assert not (tmp_path / "b" / "hf").exists()



def test_a_record_the_tokenizer_refuses_on_one_data_parallel_rank_stops_every_rank(tp_pool, tiny_target, tmp_path):
    """Whatever the tokenizer raises on a record read by one DP rank only is the same one-line `DataError` on
    every rank, naming the file and line (not the tokenizer's bare `TypeError` on one rank and a closed
    connection on the other); a record the scan already refuses (a lone surrogate) stops every rank alike
    before training."""
    _chats(tmp_path / "chats.jsonl", [True] * 16)
    pool = tp_pool(2)
    train, line = _with_unreadable_record(tmp_path, "train.jsonl", step=1, seed=1234)
    results = pool.run(_dp_rank_meeting_an_unreadable_record, tiny_target, train, str(tmp_path / "a"), raises=True,
                       tp=1, timeout=MULTI_RANK_TIMEOUT_S)
    expected = f"{train}:{line}: cannot tokenise the record (TypeError: {_TOKENIZER_TYPE_ERROR})."
    assert results == [expected, expected], results
    assert (tmp_path / "a" / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    surrogate, line = _with_unreadable_record(tmp_path, "surrogate.jsonl", step=1, seed=1234, content="3 \ud800 4")
    results = pool.run(_dp_rank_meeting_an_unreadable_record, tiny_target, surrogate, str(tmp_path / "b"), tp=1,
                       timeout=MULTI_RANK_TIMEOUT_S)
    expected = (f"{surrogate}:{line} ('messages'): message 0 (user): the content is not valid Unicode (a lone "
                "surrogate \\ud800 at character 2; the file was written by a broken encoder).")
    assert results == [expected, expected], results
    assert not (tmp_path / "b" / "ckpt").exists()

# ------------------------------------------------------------------------------------------ 5. vocabulary


def test_token_ids_are_checked_against_the_vocabulary(tiny_target, tmp_path):
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target)
    vocab = json.load(open(os.path.join(tiny_target, "config.json")))["vocab_size"]
    # a tokenizer larger than the target's vocabulary
    big = AutoTokenizer.from_pretrained(tiny_target)
    big.add_tokens([f"<extra_{i}>" for i in range(vocab - len(tok) + 1)])
    big.save_pretrained(str(tmp_path / "big"))
    assert f"but the target's vocabulary has {vocab} rows" in _job_error(tiny_target, tmp_path, "--tokenizer",
                                                                         str(tmp_path / "big"))
    # evaluation prompts
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"input_ids": [3, vocab + 5]}) + "\n")
    assert f"prompt 1 has token id {vocab + 5}, outside the target's vocabulary" in _job_error(
        tiny_target, tmp_path, "--dflash-eval-prompts", str(tmp_path / "prompts.jsonl"))
    # pre-tokenised (indexed) data: refused before training, naming the file and the token
    prefix = str(tmp_path / "indexed")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for n in range(4):
        ids = list(range(3, 40)) + ([vocab] if n == 2 else [])
        builder.add_document(torch.tensor(ids, dtype=torch.int32), [len(ids)])
    builder.finalize(prefix + ".idx")
    argv = ["--target", tiny_target, *TINY_DRAFT, "--no-progress-bar", "--seq-length", "48", "--train-iters", "1",
            "--micro-batch-size", "2", "--dflash-eval-prompts", "0", "--data-format", "indexed", "--data-path", prefix,
            "--dflash-export", str(tmp_path / "hf")]
    with pytest.raises(DataError, match=rf"indexed.bin: token \d+ has id {vocab}, outside the target's vocabulary"):
        run_training(argv)


def test_megatron_target_without_cuda_runs_on_the_cpu(tiny_target, tmp_path):
    """No CUDA: the megatron target runs under the product's device shim (command-line runs at TP / PP:
    tests/test_training.py) and trains as the transformers target does."""
    megatron = run_training(training_argv(tiny_target, tmp_path / "megatron", *SHORT, "--target-backend", "megatron"))
    hf = run_training(training_argv(tiny_target, tmp_path / "hf", *SHORT))
    assert len(megatron.losses) == len(hf.losses) == 2
    for a, b in zip(megatron.losses, hf.losses):
        assert abs(a - b) < 1e-5, (megatron.losses, hf.losses)


# ------------------------------------------------------------------------------------------ 6. decoding inputs


def test_spec_generate_inputs_and_cache_growth(monkeypatch):
    from tiny_decoding import PROMPTS, make_draft, qwen3_target

    from megatron_dflash.decoding import generate
    from megatron_dflash.decoding.generate import spec_generate

    vocab = 96
    target, draft = qwen3_target(vocab=vocab), make_draft(vocab, backend="chunked")
    greedy = spec_generate(target, draft, PROMPTS, max_new_tokens=12)
    # the draft KV cache follows what is generated: a huge budget that stops after one token allocates little
    sizes = []
    real = generate.DraftKVCache.__init__

    def record(self, draft, batch_size, capacity, *args, **kwargs):
        sizes.append(capacity)
        real(self, draft, batch_size, capacity, *args, **kwargs)

    monkeypatch.setattr(generate.DraftKVCache, "__init__", record)
    first = int(greedy.tokens[0, len(PROMPTS[0])])
    out = spec_generate(target, draft, PROMPTS[:1], max_new_tokens=10**8, stop_token_ids=first)  # one id: accepted
    assert out.lengths.tolist() == [len(PROMPTS[0]) + 1] and sizes[-1] < 64
    # and grows past its first size without changing the result
    long = spec_generate(target, draft, PROMPTS, max_new_tokens=40)
    for b, n in enumerate(greedy.lengths.tolist()):
        assert torch.equal(long.tokens[b, :n], greedy.tokens[b, :n])
    # 0 < temperature < 1e-5 decodes greedily (softmax(logits / T) would overflow)
    tiny = spec_generate(target, draft, PROMPTS, max_new_tokens=12, temperature=1e-7)
    assert torch.equal(tiny.tokens, greedy.tokens)
    for kwargs, message in (
        (dict(temperature=float("inf")), "temperature=inf must be a finite number"),
        (dict(temperature=float("nan")), "temperature=nan must be a finite number"),
        (dict(stop_token_ids="5"), "must hold integer token ids"),
        (dict(stop_token_ids=2.5), "must be a token id or a sequence"),
    ):
        with pytest.raises(ValueError, match=message):
            spec_generate(target, draft, PROMPTS, max_new_tokens=4, **kwargs)
    with pytest.raises(ValueError, match=rf"prompt 1 has token id {vocab}, outside the target's vocabulary"):
        spec_generate(target, draft, [[1, 2], [3, vocab]], max_new_tokens=4)
    with pytest.raises(ValueError, match="prompt 0 has 512 tokens, but the model has 512 positions"):
        spec_generate(target, draft, [[1] * 512], max_new_tokens=4)
    small = make_draft(vocab - 8, backend="chunked")
    with pytest.raises(ValueError, match=f"the draft's vocab_size={vocab - 8} differs from the target's {vocab}"):
        spec_generate(target, small, PROMPTS, max_new_tokens=4)


# ------------------------------------------------------------------------------------------ 7. HF drafters


def test_bad_hf_drafters_are_explained(tmp_path):
    from builders import tiny_draft_kwargs
    from safetensors.torch import load_file, save_file

    from megatron_dflash.draft.body import DFlashBody
    from megatron_dflash.checkpoint.hf import load_hf_checkpoint, save_hf_checkpoint
    from megatron_dflash.draft.config import DFlashConfig

    good = tmp_path / "good"
    save_hf_checkpoint(DFlashBody(DFlashConfig(**tiny_draft_kwargs())), str(good))

    def variant(name, edit_config=None, edit_weights=None):
        out = tmp_path / name
        shutil.copytree(good, out)
        if edit_config is not None:
            data = json.load(open(out / "config.json"))
            edit_config(data)
            (out / "config.json").write_text(json.dumps(data))
        if edit_weights is not None:
            edit_weights(out / "model.safetensors")
        return str(out)

    def truncate(path):
        path.write_bytes(path.read_bytes()[:100])

    def poison(path):
        tensors = load_file(str(path))
        name = sorted(tensors)[0]
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[0] = float("nan")
        save_file(tensors, str(path))

    cases = [
        (variant("truncated", edit_weights=truncate), "model.safetensors is not a readable safetensors file"),
        (variant("nan", edit_weights=poison), "holds NaN or inf values"),
        (variant("unknown", lambda d: d.update(architectures=["LlamaForCausalLM"])),
         "has architectures=['LlamaForCausalLM'], not a draft model"),
        (variant("malformed", lambda d: d.update(dflash_config="oops")), "config.json: dflash_config is \"oops\"; it must be a JSON object"),
    ]
    for directory, message in cases:
        with pytest.raises(ValueError) as info:
            load_hf_checkpoint(directory)
        assert message in str(info.value), str(info.value)
        assert directory in str(info.value)


# ------------------------------------------------------------------------------------------ plan bounds


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from repo_paths import REPO_ROOT

_HUGE = st.one_of(st.integers(-(2**63), 2**63 - 1), st.sampled_from([2**62, 2**63 - 1, 2**40, -(2**63)]))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.integers(1, 3), seq_length=st.integers(1, 40),
       block_size=st.one_of(st.integers(-2, 48), st.sampled_from([2**12, 2**12 + 1, 2**40])),
       anchors_per_sample=st.one_of(st.integers(0, 48), st.sampled_from([2**20, 2**20 + 1, 2**40])),
       step=st.integers(0, 2**64 - 1), seed=st.integers(-(2**63), 2**64 - 1), data=st.data())
def test_plan_fuzz_with_upper_bounds(batch, seq_length, block_size, anchors_per_sample, step, seed, data):
    """Any input gives a plan that keeps the invariants or a ValueError, never an allocation failure or an
    overflow; `from_anchors` refuses anchors out of range however large."""
    from megatron_dflash.plan.batch_plan import (
        MAX_BLOCK_SIZE,
        MAX_BLOCKS_PER_ROW,
        MAX_PLAN_SLOTS,
        DFlashBatchPlan,
        build_dflash_batch_plan,
    )

    mask = torch.tensor(data.draw(st.lists(st.booleans(), min_size=batch * seq_length, max_size=batch * seq_length)))
    mask = mask.reshape(batch, seq_length)
    sids = torch.arange(batch, dtype=torch.int64) * 7919
    bad = (not (2 <= block_size <= MAX_BLOCK_SIZE) or not (1 <= anchors_per_sample <= MAX_BLOCKS_PER_ROW)
           or batch * anchors_per_sample * block_size > MAX_PLAN_SLOTS)
    if bad:
        with pytest.raises(ValueError):
            build_dflash_batch_plan(mask, sids, anchors_per_sample=anchors_per_sample, block_size=block_size,
                                    optimizer_step=step, seed=seed)
        return
    plan = build_dflash_batch_plan(mask, sids, anchors_per_sample=anchors_per_sample, block_size=block_size,
                                   optimizer_step=step, seed=seed)
    assert tuple(plan.anchor_positions.shape) == (batch, anchors_per_sample)
    valid = plan.block_valid
    anchors = plan.anchor_positions
    assert bool(((anchors >= 0) & (anchors <= seq_length - block_size) | ~valid).all())
    assert not bool(plan.loss_mask[~valid].any())  # invalid blocks supervise nothing
    # from_anchors: an anchor anywhere in the int64 range is either in range or refused
    anchor = data.draw(_HUGE)
    given_anchors = torch.full((batch, 1), anchor, dtype=torch.int64)
    if 0 <= anchor <= seq_length - block_size:
        DFlashBatchPlan.from_anchors(given_anchors, block_size=block_size, input_mask=mask)
    else:
        with pytest.raises(ValueError, match="does not fit"):
            DFlashBatchPlan.from_anchors(given_anchors, block_size=block_size, input_mask=mask)


def test_evaluate_acceptance_explains_a_damaged_draft(tmp_path, capsys, monkeypatch):
    sys_path = os.path.join(REPO_ROOT, "tools")
    monkeypatch.syspath_prepend(sys_path)
    import evaluate_acceptance
    from tiny_decoding import write_models

    _, _, target_dir, draft_dir, prompts = write_models(tmp_path, False)
    weights = draft_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:64])
    monkeypatch.setenv("MEGATRON_DFLASH_DEBUG", "0")
    code = evaluate_acceptance.main(["--target", str(target_dir), "--draft", str(draft_dir), "--prompts", str(prompts),
                                     "--max-new-tokens", "4", "--device", "cpu", "--dtype", "float32"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("evaluate_acceptance.py: error: ")
    assert f"{weights} is not a readable safetensors file" in err


def test_an_empty_directory_named_like_a_checkpoint_starts_from_scratch(tmp_path):
    from megatron_dflash.training.resume import find_resume_point

    for name in ("iter_0000005", "release", "iter_runs"):
        (tmp_path / name).mkdir()
        assert find_resume_point(str(tmp_path / name)) is None


def _tp_rank_with_other_data(rank, world_size, target, out_dir):
    """TP=2 ranks of one group; rank 1 reads different tokens (as from another copy of the data)."""
    import pathlib

    from megatron_dflash.data import batching

    torch.set_num_threads(1)
    if rank == 1:
        real = batching.Collator.__call__

        def shifted(self, samples):
            batch = real(self, samples)
            batch["tokens"] = batch["tokens"].roll(1, dims=1)
            return batch

        batching.Collator.__call__ = shifted
    argv = training_argv(target, pathlib.Path(out_dir), "--train-iters", "2", "--micro-batch-size", "4",
                         "--dflash-eval-prompts", "0", "--tensor-model-parallel-size", "2", "--target-backend", "megatron")
    try:
        run_training(argv)
    except DataError as err:
        return str(err)
    finally:
        if rank == 1:
            batching.Collator.__call__ = real
    return None


def test_tensor_parallel_ranks_with_different_data_stop_alike(tp_pool, tiny_target, tmp_path):
    results = tp_pool(2).run(_tp_rank_with_other_data, tiny_target, str(tmp_path), tp=2, timeout=MULTI_RANK_TIMEOUT_S)
    assert results[0] is not None and results[1] is not None, results
    assert all("tokens" in r and "read different data" in r for r in results), results


# ------------------------------------------------------------------------------------------ 9. trust


def _plant(marker, value):
    """What a planted pickle runs when it is unpickled: it writes `marker`, then hands back the real content,
    so that the load would go on as if nothing happened."""
    with open(marker, "w") as f:
        f.write("planted code ran\n")
    return value


class _Planted:
    def __init__(self, marker, value):
        self.marker, self.value = marker, value

    def __reduce__(self):
        return _plant, (str(self.marker), self.value)


def _plant_in_metadata(iteration_dir, marker):
    import pickle

    path = iteration_dir / ".metadata"
    real = pickle.loads(path.read_bytes())
    path.write_bytes(pickle.dumps(_Planted(marker, real)))
    return path


def _plant_in_common(iteration_dir, marker):
    path = iteration_dir / "common.pt"
    real = torch.load(path, weights_only=False)
    torch.save(_Planted(marker, real), path)
    return path


def _rewrite_byte_item(iteration_dir, key_prefix: str, rewrite):
    """Replace the byte item `key_prefix*` of a torch_dist checkpoint by `rewrite(old bytes)`: splice it into its
    `.distcp` file and move the offsets of the items behind it (as someone editing the files would).
    Returns the `.distcp` file."""
    import dataclasses
    import pickle

    meta_path = iteration_dir / ".metadata"
    metadata = pickle.loads(meta_path.read_bytes())
    index, info = next((i, s) for i, s in metadata.storage_data.items() if i.fqn.startswith(key_prefix))
    path = iteration_dir / info.relative_path
    data = path.read_bytes()
    new = rewrite(data[info.offset:info.offset + info.length])
    path.write_bytes(data[:info.offset] + new + data[info.offset + info.length:])
    shift = len(new) - info.length
    for i, s in list(metadata.storage_data.items()):
        if s.relative_path == info.relative_path and s.offset > info.offset:
            metadata.storage_data[i] = dataclasses.replace(s, offset=s.offset + shift)
    metadata.storage_data[index] = dataclasses.replace(info, length=len(new))
    meta_path.write_bytes(pickle.dumps(metadata))
    return path


def _plant_in_rng_item(iteration_dir, marker):
    """The pickled RNG state of a version-2 checkpoint (a byte item of its .distcp) wrapped into a planted pickle."""
    import io

    def planted(old: bytes) -> bytes:
        (state,) = torch.load(io.BytesIO(old), weights_only=False)
        out = io.BytesIO()
        torch.save([_Planted(marker, state)], out)
        return out.getvalue()

    return _rewrite_byte_item(iteration_dir, "rng_state", planted)


@pytest.fixture(scope="module")
def previous_version(tiny_target, tmp_path_factory):
    """A save directory in the layout of checkpoint version 2: the RNG state one pickled object per rank (a byte
    item of the .distcp). Returns (save directory, the RNG state pickled into its checkpoint of iteration 2)."""
    import random

    import numpy as np
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from megatron_dflash.training import checkpointing

    pickled = []

    def pickled_rng(state, legacy=False):
        pickled.append({"random": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()})
        return ShardedObject("rng_state", pickled[-1], (1,), (0,), replica_id=0)

    root = tmp_path_factory.mktemp("previous")
    save = root / "ckpt"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(checkpointing, "CHECKPOINT_VERSION", 2)
        patch.setattr(checkpointing, "_rng_sharded", pickled_rng)
        run_training(training_argv(tiny_target, root, *SHORT, "--save", str(save), "--save-interval", "2"))
    return save, pickled[-1]


def _one_line_refusal(status, err, path, planted="test_faults._plant"):
    lines = err.strip().splitlines()
    assert status == 1 and "Traceback" not in err, err[-3000:]
    assert f"refusing to load {path}" in lines[-1] and f"pickled {planted}," in lines[-1], err[-3000:]


def _convert_to_hf(load, output, capsys):
    from megatron_dflash.checkpoint.convert import main

    capsys.readouterr()
    status = main(["to-hf", "--load", str(load), "--output", str(output)], prog="convert_checkpoint.py")
    return status, capsys.readouterr().err


def _evaluate(tiny_target, draft, tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(REPO_ROOT, "tools"))
    import evaluate_acceptance

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": [1, 2, 3, 4]}) + "\n")
    monkeypatch.setenv("MEGATRON_DFLASH_DEBUG", "0")
    capsys.readouterr()
    status = evaluate_acceptance.main(["--target", tiny_target, "--draft", str(draft), "--prompts", str(prompts),
                                       "--max-new-tokens", "2", "--device", "cpu", "--dtype", "float32"])
    return status, capsys.readouterr().err


def test_planted_pickles_never_run(tiny_target, tmp_path, trained, previous_version, capsys, monkeypatch):
    """A pickle planted in .metadata, common.pt or (version 2) the pickled RNG state of a .distcp would run code on
    load: --load, to-hf and evaluate_acceptance --draft refuse it in one line naming the file and the type, and
    nothing of it runs."""
    marker = tmp_path / "planted-code-ran"
    cases = [("metadata", copy_save(trained, tmp_path, "metadata"), _plant_in_metadata),
             ("common", copy_save(trained, tmp_path, "common"), _plant_in_common),
             ("rng", copy_save(previous_version[0], tmp_path, "rng"), _plant_in_rng_item)]
    for name, save, plant in cases:
        planted = plant(save / "iter_0000002", marker)
        status, err = run_main(training_argv(tiny_target, tmp_path, *SHORT, "--load", str(save)), capsys, monkeypatch)
        _one_line_refusal(status, err, planted)
        assert not marker.exists(), name
        if name == "rng":
            continue  # the weights-only readers never read the training state of a checkpoint
        status, err = _convert_to_hf(save, tmp_path / f"hf-{name}", capsys)
        _one_line_refusal(status, err, planted)
        assert not marker.exists() and not (tmp_path / f"hf-{name}").exists(), name
        status, err = _evaluate(tiny_target, save, tmp_path, capsys, monkeypatch)
        _one_line_refusal(status, err, planted)
        assert not marker.exists(), name


def test_a_pickled_target_is_refused_in_one_line_by_every_entry_point(tiny_target, tmp_path, trained, capsys,
                                                                      monkeypatch):
    """A target whose weights are a `pytorch_model.bin` holding code: training (both backends), the evaluation tool,
    regeneration and the target cache refuse it in one line naming the file and the conversion, and nothing of it
    runs (not even transformers' weights-only unpickler is reached)."""
    import pickle

    marker = tmp_path / "planted-code-ran"
    target = tmp_path / "pickled-target"
    shutil.copytree(tiny_target, target, ignore=shutil.ignore_patterns("*.safetensors"))
    (target / "pytorch_model.bin").write_bytes(pickle.dumps(_Planted(marker, {})))
    refusal = (f"{target / 'pytorch_model.bin'}: the target's weights are a pickle, which is never loaded (unpickling "
               "can run code); convert them to safetensors")
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "hello"}]}) + "\n")
    monkeypatch.setenv("MEGATRON_DFLASH_DEBUG", "0")

    def tool(main, argv):
        capsys.readouterr()
        return main(argv), capsys.readouterr().err

    runs = {backend: run_main(training_argv(str(target), tmp_path, *SHORT, "--target-backend", backend, "--run-dir",
                                            str(tmp_path / "run")), capsys, monkeypatch) for backend in ("hf", "megatron")}
    runs["evaluate"] = _evaluate(str(target), trained, tmp_path, capsys, monkeypatch)
    runs["regenerate"] = tool(regenerate_module().main, ["--input", str(chats), "--output", str(tmp_path / "regen"),
                                                         "--target", str(target)])
    runs["cache"] = tool(cache_states_module().main, ["--target", str(target), *STEPS_ARGS, "--micro-batch-size", "2",
                                                      "--global-batch-size", "2", "--dflash-target-cache",
                                                      str(tmp_path / "states")])
    for name, (status, err) in runs.items():
        errors = [line for line in err.splitlines() if ": error: " in line]
        assert status in (1, 2) and "Traceback" not in err and len(errors) == 1, (name, err[-3000:])
        assert refusal in errors[0], (name, errors[0])
    assert not marker.exists()


def test_checkpoint_metadata_may_name_only_its_own_files(tiny_target, tmp_path, trained, capsys, monkeypatch):
    """The storage files that .metadata names are files of the checkpoint directory, never paths out of it."""
    import dataclasses
    import pickle

    for name, outside in (("dotdot", "../outside.distcp"), ("absolute", str(tmp_path / "outside.distcp"))):
        save = copy_save(trained, tmp_path, name)
        meta_path = save / "iter_0000002" / ".metadata"
        metadata = pickle.loads(meta_path.read_bytes())
        for index, info in list(metadata.storage_data.items()):
            metadata.storage_data[index] = dataclasses.replace(info, relative_path=outside)
        meta_path.write_bytes(pickle.dumps(metadata))
        status, err = run_main(training_argv(tiny_target, tmp_path, *SHORT, "--load", str(save)), capsys, monkeypatch)
        assert status == 1 and "Traceback" not in err, err[-3000:]
        assert f"names the storage file {outside!r}" in err.strip().splitlines()[-1], err[-3000:]


def test_rng_state_is_saved_as_tensors_and_restored(tiny_target, tmp_path, trained):
    """The checkpoint holds no pickled object but common.pt: the RNG states are tensors (one row per rank),
    restored on resume."""
    import pickle

    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from megatron_dflash.checkpoint.torch_dist import single_process_group
    from megatron_dflash.checkpoint.torch_dist_load import load

    iteration_dir = trained / "iter_0000002"
    metadata = pickle.loads((iteration_dir / ".metadata").read_bytes())
    assert not [k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]
    rng_keys = sorted(k for k in metadata.state_dict_metadata if k.startswith("rng_state."))
    assert {"rng_state.python", "rng_state.numpy", "rng_state.torch"} <= set(rng_keys)
    size = metadata.state_dict_metadata["rng_state.torch"].size
    assert size[0] == 1  # (world size, n)
    with single_process_group():
        stored = load({"torch": ShardedTensor.from_rank_offsets(
            "rng_state.torch", torch.empty(size[1:], dtype=torch.uint8), (0, 0, 1), replica_id=0, prepend_axis_num=1)},
            str(iteration_dir))["torch"]
    torch.manual_seed(1234)  # anything else: the resume must restore the stored state
    resumed = run_training(training_argv(tiny_target, tmp_path, *SHORT, "--load", str(copy_save(trained, tmp_path))))
    assert resumed.start_iteration == 2
    assert torch.equal(torch.get_rng_state(), stored)


def test_a_checkpoint_of_the_previous_version_resumes(tiny_target, tmp_path, previous_version):
    """Version 2 pickled the RNG state into the .distcp: it still resumes, that object read through the allow-list."""
    import random

    import numpy as np

    save, pickled = previous_version
    random.seed(99)
    np.random.seed(99)
    more = [a if a != "2" else "3" for a in SHORT]
    resumed = run_training(training_argv(tiny_target, tmp_path, *more, "--load", str(copy_save(save, tmp_path))))
    assert resumed.start_iteration == 2 and resumed.iterations == 3
    assert random.getstate() == pickled["random"]
    assert np.array_equal(np.random.get_state()[1], pickled["numpy"][1])


# ------------------------------------------------------------------------------------------ 10. output paths


def test_an_output_that_is_a_symbolic_link_is_refused_before_any_work(tiny_target, tmp_path, trained, capsys):
    """The export (and to-hf's --output) is renamed onto its path: a symbolic link there is refused up front."""
    real = tmp_path / "real-export"
    real.mkdir()
    link = tmp_path / "export-link"
    link.symlink_to(real)
    message = _job_error(tiny_target, tmp_path, "--dflash-export", str(link))
    assert f"--dflash-export={link} is a symbolic link" in message
    started = []
    with pytest.raises(ArgumentError, match="is a symbolic link"):
        run_training(training_argv(tiny_target, tmp_path, *SHORT, "--dflash-export", str(link)),
                     hooks={"on_step": lambda *a, **k: started.append(1)})
    assert started == [] and os.listdir(real) == []
    status, err = _convert_to_hf(trained, link, capsys)
    assert status == 2 and f"{link} is a symbolic link" in err.strip().splitlines()[-1], err
    assert os.listdir(real) == [] and not [n for n in os.listdir(tmp_path) if n.startswith(".export-link")]
# ------------------------------------------------------------------------------------------ 9. one run per --save


_REPO = REPO_ROOT
_PRETRAIN = os.path.join(_REPO, "pretrain_dflash.py")
_CHILD_ENV = dict(OMP_NUM_THREADS="1", MEGATRON_DFLASH_DEBUG="0")


def _start_pretrain(argv, out_dir):
    """`pretrain_dflash.py ARGV` as a real process; stdout and stderr into files of `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stdout, stderr = open(out_dir / "stdout", "w"), open(out_dir / "stderr", "w")
    process = subprocess.Popen([sys.executable, _PRETRAIN, *argv], stdout=stdout, stderr=stderr, env=child_env(**_CHILD_ENV),
                               cwd=str(out_dir))
    stdout.close()
    stderr.close()
    return process


def _wait_for(path, text, process, timeout=240.0):
    """Wait until the file `path` contains `text` (the process still running)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and text in path.read_text():
            return
        assert process.poll() is None, f"exited with {process.returncode}: {path.read_text()[-2000:]}"
        time.sleep(0.05)
    process.kill()
    raise AssertionError(f"{text!r} never appeared in {path}")


def _assert_loadable(save):
    """Every `iter_*` of `save` is complete: its draft tensors and its common state read back."""
    from megatron.core import dist_checkpointing

    from megatron_dflash.checkpoint.torch_dist import list_iterations, read_megatron_draft_state, single_process_group

    iterations = list_iterations(str(save))
    with single_process_group():
        for iteration in iterations:
            directory = str(save / f"iter_{iteration:07d}")
            assert read_megatron_draft_state(directory), directory
            assert dist_checkpointing.load_common_state_dict(directory)["iteration"] == iteration
    return iterations


LONG = ["--train-iters", "400", "--micro-batch-size", "4", "--global-batch-size", "4", "--dflash-eval-prompts", "0"]


def test_a_second_run_on_one_save_directory_is_refused(tiny_target, tmp_path, capsys, monkeypatch):
    """Two runs with the same command line, the first a real process: the second is refused in one line naming
    the first (host, pid, start time) while the first keeps saving; every checkpoint the first published loads."""
    save = tmp_path / "ckpt"
    argv = training_argv(tiny_target, tmp_path, *LONG, "--save", str(save), "--save-interval", "5", "--run-dir",
                         str(tmp_path / "run"))
    first = _start_pretrain(argv, tmp_path / "first")
    try:
        _wait_for(tmp_path / "first" / "stdout", "[checkpoint] saved iteration 5", first)
        status, err = run_main(argv, capsys, monkeypatch)  # the second run (in this process: no start-up cost)
        assert first.poll() is None, "the first run ended before the second one started; make it longer"
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=120) == 75
    finally:
        first.kill()
    assert status == 1 and "Traceback" not in err and err.count("pretrain_dflash.py:") == 1, err[-3000:]
    assert err.strip().splitlines()[-1].startswith(
        f"pretrain_dflash.py: error: --save={save} is in use by another run (host {socket.gethostname()}, "
        f"pid {first.pid}, started ")
    iterations = _assert_loadable(save)
    assert len(iterations) >= 2 and iterations[:-1] == list(range(5, iterations[-2] + 1, 5))
    assert sorted(os.listdir(save)) == [f"iter_{i:07d}" for i in iterations] + ["latest_checkpointed_iteration.txt"]


def _hold_lock_and_sleep(save):
    code = ("import sys, time\nfrom megatron_dflash.training.savelock import acquire_save_lock\n"
            f"acquire_save_lock({str(save)!r})\nprint('held', flush=True)\ntime.sleep(600)\n")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=child_env(**_CHILD_ENV))
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_the_lock_of_a_dead_run_is_taken_over(tiny_target, tmp_path, capsys):
    save = tmp_path / "ckpt"
    holder = _hold_lock_and_sleep(save)
    holder.kill()  # SIGKILL: no release, its record stays in the lock file
    holder.wait()
    capsys.readouterr()
    result = run_training(training_argv(tiny_target, tmp_path, *SHORT, "--save", str(save)))
    assert result.iterations == 2
    out = capsys.readouterr().out
    assert f"took over the lock of --save={save} from a run that ended without releasing it (host " \
           f"{socket.gethostname()}, pid {holder.pid}, started " in out, out[-3000:]
    assert sorted(os.listdir(save)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]  # released at the end


def test_the_lock_is_one_per_run_and_refuses_on_every_rank_alike(tp_pool, tiny_target, tmp_path):
    """A launch of two ranks on a save directory that another run holds: both ranks raise the same line before
    any model is built; once the holder is gone, the two ranks share one lock (rank 0's) and train."""
    save = tmp_path / "ckpt"
    holder = _hold_lock_and_sleep(save)
    extra = ["--train-iters", "2", "--save", str(save)]
    try:
        results = tp_pool(2).run(_rank_run, tiny_target, str(tmp_path / "refused"), {0: extra, 1: extra},
                                 tp=1, timeout=MULTI_RANK_TIMEOUT_S)
    finally:
        holder.kill()
        holder.wait()
    assert results[0] == results[1] and results[0][0] == "error", results
    assert f"is in use by another run (host {socket.gethostname()}, pid {holder.pid}, started " in results[0][1]
    results = tp_pool(2).run(_rank_run, tiny_target, str(tmp_path / "ok"), {0: extra, 1: extra},
                             tp=1, timeout=MULTI_RANK_TIMEOUT_S)
    assert results[0] == results[1] and results[0][0] == "ok" and results[0][1][1] == 2, results


# ------------------------------------------------------------------------------------------ 10. preemption


def test_sigterm_saves_and_the_run_resumes_exactly(tiny_target, tmp_path):
    """SIGTERM to a real run (how SLURM and Kubernetes preempt): it finishes the step, saves it, exits 75 with one
    line, leaves no staged directory; --load continues exactly as the uninterrupted run (losses, weights)."""

    common = ["--train-iters", "20", "--micro-batch-size", "4", "--global-batch-size", "4", "--dflash-eval-prompts",
              "0", "--lr-decay-style", "cosine"]
    straight = run_training(training_argv(tiny_target, tmp_path / "a", *common))
    save = tmp_path / "b" / "ckpt"
    argv = training_argv(tiny_target, tmp_path / "b", *common, "--save", str(save), "--save-interval", "1",
                         "--run-dir", str(tmp_path / "b"))
    process = _start_pretrain(argv, tmp_path / "b" / "process")
    try:
        _wait_for(tmp_path / "b" / "process" / "stdout", "[checkpoint] saved iteration 3", process)
        process.send_signal(signal.SIGTERM)
        status = process.wait(timeout=120)
    finally:
        process.kill()
    err = (tmp_path / "b" / "process" / "stderr").read_text()
    lines = [line for line in err.splitlines() if "pretrain_dflash.py" in line]
    assert status == 75 and "Traceback" not in err and len(lines) == 1, err[-3000:]
    stopped = int(lines[0].split("stopped by SIGTERM at iteration ")[1].split(";")[0])
    assert 3 <= stopped < 20 and f"resume with --load {save}" in lines[0]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == str(stopped)
    assert not [p for p in os.listdir(save) if p.startswith(".")]  # no staged directory, no lock left
    assert not [p for p in os.listdir(tmp_path / "b") if p.startswith(".")]
    with open(tmp_path / "b" / "metrics.jsonl") as f:
        before = [r["loss"] for r in map(json.loads, f) if r["split"] == "train"]
    resumed = run_training(argv + ["--load", str(save)])
    assert resumed.start_iteration == stopped and resumed.iterations == 20
    assert before + resumed.losses == straight.losses  # bitwise
    a, b = safetensors_of(str(tmp_path / "a" / "hf")), safetensors_of(str(tmp_path / "b" / "hf"))
    for key in a:
        assert torch.equal(a[key], b[key]), key


def _signal_on_rank_1(rank, world_size, target, out_dir, save):
    """A DP=2 run where only rank 1 gets SIGTERM, during its iteration 2."""
    import pathlib

    torch.set_num_threads(1)

    def on_step(iteration, values, body):
        if rank == 1 and iteration == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    argv = training_argv(target, pathlib.Path(out_dir), "--train-iters", "6", "--micro-batch-size", "4", "--global-batch-size",
                         "8", "--dflash-eval-prompts", "0", "--save", save)
    result = run_training(argv, hooks={"on_step": on_step})
    return result.stopped_by, result.iterations, result.checkpoint_dir, result.stop_message


def test_a_signal_on_one_rank_stops_every_rank_at_the_same_step(tp_pool, tiny_target, tmp_path):
    from megatron_dflash.training.resume import find_resume_point

    save = str(tmp_path / "ckpt")
    results = tp_pool(2).run(_signal_on_rank_1, tiny_target, str(tmp_path / "run"), save, tp=1,
                             timeout=MULTI_RANK_TIMEOUT_S)
    assert results[0] == results[1], results
    assert results[0][:3] == ("SIGTERM", 2, os.path.join(save, "iter_0000002"))
    assert find_resume_point(save).iteration == 2 and _assert_loadable(tmp_path / "ckpt") == [2]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_exits_at_once(signum):
    """The first signal is noted (the step finishes, then the run saves); a second one ends the process at once."""
    code = ("import os, signal\nfrom megatron_dflash.training.signals import StopSignals\n"
            "stop = StopSignals().install()\n"
            f"os.kill(os.getpid(), {int(signum)})\nprint('noted', stop.received, flush=True)\n"
            f"os.kill(os.getpid(), {int(signum)})\nprint('still running', flush=True)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env(**_CHILD_ENV),
                          timeout=60)
    assert done.returncode == -signum, (done.returncode, done.stdout, done.stderr)
    assert f"noted {int(signum)}" in done.stdout and "still running" not in done.stdout
    assert "send it again to exit at once" in done.stdout


def test_sigint_outside_the_steps_ends_in_one_line(tiny_target, tmp_path, capsys, monkeypatch):
    """Ctrl-C while the run loads (before the steps): one line and exit status 130, no traceback."""
    from megatron_dflash.training import loop

    real_build = loop.build_datasets

    def interrupted_while_loading(job):
        os.kill(os.getpid(), signal.SIGINT)  # Python's own handler: KeyboardInterrupt here
        return real_build(job)

    monkeypatch.setattr(loop, "build_datasets", interrupted_while_loading)
    try:
        status, err = run_main(training_argv(tiny_target, tmp_path, *SHORT), capsys, monkeypatch)
    except KeyboardInterrupt:
        pytest.fail("the interrupt escaped pretrain_dflash.py's main as a traceback")
    assert status == 130 and "Traceback" not in err and err.count("pretrain_dflash.py:") == 1, err[-2000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith("pretrain_dflash.py: interrupted (SIGINT) outside the training steps"), line
