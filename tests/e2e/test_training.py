"""The training entry point: arguments, end to end at TP=1 and TP=2, resume, crash safety, normalisation.

Every run here is tiny (a 20-step tiny target in a temporary cache, 4-row micro-batches of 48 tokens,
a handful of steps) so the file stays well under a few minutes on a loaded 2-core machine.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import subprocess
import sys

import pytest
import torch

from megatron_dflash.training.arguments import ArgumentError, parse_args, validate_args
from megatron_dflash.training.job import prepare_job
from entry_points import child_env, evaluate_module
from repo_paths import REPO_ROOT
from training_runs import TINY_DRAFT, run_training, safetensors_of, training_argv

pytestmark = pytest.mark.usefixtures("one_thread")

# ------------------------------------------------------------------------------------------ arguments


VALIDATION_CASES = [
    (["--tensor-model-parallel-size", "0"], 1, "--tensor-model-parallel-size=0 must be an integer >= 1"),
    (["--tensor-model-parallel-size", "2"], 3, "world size 3 is not divisible"),
    (["--tensor-model-parallel-size", "2"], 2, "--target-backend hf runs the target as one transformers model"),
    (["--pipeline-model-parallel-size", "2"], 2, "(got TP=1, PP=2); use --target-backend megatron"),
    (["--pipeline-model-parallel-size", "2", "--target-backend", "megatron", "--dflash-pipeline-stage", "2"], 2,
     "--dflash-pipeline-stage=2 is outside the 2 pipeline stage(s)"),
    (["--dflash-pipeline-stage", "1"], 1, "--dflash-pipeline-stage=1 is outside the 1 pipeline stage"),
    (["--dflash-pipeline-stage", "-2"], 1, "--dflash-pipeline-stage=-2 is outside"),
    (["--micro-batch-size", "4", "--global-batch-size", "10"], 1, "--global-batch-size=10 must be divisible"),
    (["--micro-batch-size", "4", "--global-batch-size", "4"], 2, "must be divisible by --micro-batch-size x data-parallel"),
    (["--lr", "1e-3", "--min-lr", "1e-2"], 1, "--min-lr=0.01 must not exceed --lr=0.001"),
    (["--lr", "0"], 1, "--lr=0.0 must be > 0"),
    (["--lr-warmup-iters", "10", "--train-iters", "5"], 1, "--lr-warmup-iters=10 must be smaller"),
    (["--adam-beta2", "1.0"], 1, "--adam-beta2=1.0 must be in"),
    (["--save-interval", "5"], 1, "--save-interval needs --save"),
    (["--data-format", "chat"], 1, "--data-format chat needs --train-data"),
    (["--train-data", "/nonexistent.jsonl"], 1, "--data-format is required"),
    (["--data-format", "synthetic", "--train-data", "x.jsonl"], 1, "--data-format synthetic generates its own data"),
    (["--data-path", "a", "b", "--data-format", "text"], 1, "dataset blending is not supported"),
    (["--data-format", "indexed", "--data-path", "/nonexistent/prefix"], 1, "expects the Megatron indexed dataset"),
    (["--dflash-variable-prefix", "0.8", "--dflash-variant", "dflash2"], 1, "--dflash-variable-prefix (D2SD) is supported"),
    (["--dflash-variable-prefix", "-1"], 1, "must be a positive number"),
    (["--dflash-block-size", "1"], 1, "--dflash-block-size=1 must be >= 2"),
    (["--dflash-target-layer-ids", "1,x"], 1, "expected comma-separated integers"),
    (["--dflash-attention-backend", "flex"], 1, "flex needs CUDA"),
    (["--wandb-exp-name", "x"], 1, "--wandb-exp-name needs --wandb-project"),
    (["--dflash-eval-prompts", "/nonexistent.jsonl"], 1, "--dflash-eval-prompts /nonexistent.jsonl: no such JSONL prompt file."),
    (["--target", "/nonexistent-target", "--data-format", "synthetic"], 1, "--target /nonexistent-target: no such HF model directory."),
    (["--load", __file__], 1, f"--load {__file__}: not a directory."),  # absent: from scratch, see below
    (["--data-format", "chat", "--train-data", "/nonexistent-dir"], 1,
     "--train-data /nonexistent-dir: no such data file or directory."),
    (["--chat-template", "/nonexistent.jinja"], 1, "--chat-template /nonexistent.jinja: no such chat template file."),
    (["--chat-template-kwargs", "{enable_thinking: false}"], 1, "--chat-template-kwargs is not JSON"),
    (["--chat-template-kwargs", "[1]"], 1, "--chat-template-kwargs must be a JSON object, got list;"),
    (["--max-bad-fraction", "2"], 1, "--max-bad-fraction must be in [0, 1], got 2.0."),
]


@pytest.mark.parametrize("argv, world, message", VALIDATION_CASES, ids=[c[2][:40] for c in VALIDATION_CASES])
def test_argument_validation_errors(argv, world, message):
    args = parse_args(argv)
    with pytest.raises(ArgumentError) as info:
        validate_args(args, world, env={}, cuda=False)
    assert message in str(info.value)
    assert "\n" not in str(info.value)  # one clear message


def test_argument_defaults_are_the_embedded_job():
    args = validate_args(parse_args([]), 1, env={}, cuda=False)
    assert args.data_format == "synthetic" and args.target is None
    assert args.global_batch_size == args.micro_batch_size and args.num_micro_batches == 1
    assert args.lr_decay_iters == args.train_iters and args.lr_warmup_iters < args.train_iters
    args = validate_args(parse_args(["--micro-batch-size", "2", "--global-batch-size", "16"]), 2, env={}, cuda=False)
    assert (args.data_parallel_size, args.num_micro_batches) == (2, 4)


def _without_mask_token(tiny_target, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target)
    tok.mask_token = None
    out = tmp_path / "tok"
    tok.save_pretrained(str(out))
    return str(out)


def test_job_errors_need_the_target(tiny_target, tmp_path):
    def err(*argv, world=1):
        with pytest.raises(ArgumentError) as info:
            prepare_job(parse_args(["--target", tiny_target, "--data-format", "synthetic", *TINY_DRAFT, *argv]),
                        world, env={}, cuda=False)
        return str(info.value)

    assert "is not a row of the target embedding" in err("--dflash-mask-token-id", "100000")
    assert "includes the target's last layer 5" in err("--dflash-target-layer-ids", "1,5")
    assert "has duplicates" in err("--dflash-target-layer-ids", "1,1")
    assert "must divide num_key_value_heads=2" in err("--tensor-model-parallel-size", "4", "--target-backend",
                                                      "megatron", world=4)
    assert "exceeds --seq-length" in err("--dflash-anchors-per-sample", "64", "--seq-length", "48")
    # a drafter to start from must fit the run
    from megatron_dflash.checkpoint.hf import save_hf_checkpoint
    from megatron_dflash.draft.body import DFlashBody

    job = prepare_job(parse_args(["--target", tiny_target, "--data-format", "synthetic", *TINY_DRAFT]), 1, env={},
                      cuda=False)
    save_hf_checkpoint(DFlashBody(job.draft_config), str(tmp_path / "drafter"))
    assert "--dflash-block-size=4 but the drafter has 8" in err("--dflash-init-from", str(tmp_path / "drafter"),
                                                                "--dflash-block-size", "4")
    # the same job resolves without errors: the MASK token comes from the tokenizer
    assert job.draft_config.mask_token_id == job.tokenizer.mask_token_id
    # a tokenizer without one: the first embedding row past its ids, said in the log and kept in the draft config
    lines = []
    masked = prepare_job(parse_args(["--target", tiny_target, "--data-format", "synthetic", *TINY_DRAFT, "--tokenizer",
                                     _without_mask_token(tiny_target, tmp_path)]), 1, env={}, cuda=False, log=lines.append)
    assert masked.draft_config.mask_token_id == len(masked.tokenizer) == 315
    assert any(line.startswith("[draft] MASK token id 315: the tokenizer has no mask token") for line in lines), lines
    assert job.draft_config.hidden_size == 128 and job.decay_gamma == 4.0  # the recipe's value for block 8


def _rank_errors(rank, world_size, target):
    """Every rank validates the same bad launches; returns the messages it raised."""
    cases = [
        ["--micro-batch-size", "4", "--global-batch-size", "6"],
        ["--tensor-model-parallel-size", "2"],
        ["--target", target, "--data-format", "synthetic", *TINY_DRAFT, "--dflash-mask-token-id", "100000"],
        ["--target", target, "--data-format", "synthetic", "--tensor-model-parallel-size", "2", "--target-backend",
         "megatron", "--dflash-num-layers", "0"],
    ]
    out = []
    for argv in cases:
        try:
            prepare_job(parse_args(argv), world_size, cuda=False)
            out.append(None)
        except ArgumentError as err:
            out.append(str(err))
    return out


def test_all_ranks_raise_the_same_error(tp_pool, tiny_target):
    results = tp_pool(2).run(_rank_errors, tiny_target, tp=None)
    assert results[0] == results[1]
    assert all(message for message in results[0]), results[0]


# ------------------------------------------------------------------------------------------ end to end


def test_end_to_end_tp1(tiny_target, tmp_path, capsys):
    from megatron_dflash.checkpoint.hf import load_hf_checkpoint
    from megatron_dflash.training.checkpointing import read_latest_iteration

    save = tmp_path / "ckpt"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"messages": [{"role": "user", "content": "count from 3 to 9"},
                                 {"role": "assistant", "content": "3 4 5 6 7 8 9"}]}) + "\n"
        + json.dumps({"prompt": "<|user|> spell the word fox <|end|> <|assistant|>"}) + "\n\n"
        + json.dumps({"input_ids": [3, 10, 20]}) + "\n"
    )
    result = run_training(training_argv(tiny_target, tmp_path, "--train-iters", "4", "--micro-batch-size", "4",
                                        "--global-batch-size", "8", "--save", str(save), "--save-interval", "2",
                                        "--eval-interval", "2", "--dflash-eval-prompts", str(prompts),
                                        "--dflash-eval-max-new-tokens", "8", "--dflash-eval-ignore-eos", "--tensorboard-dir", str(tmp_path / "tb"),
                                        "--log-interval", "2"))
    assert result.iterations == 4 and len(result.losses) == 4
    assert all(math.isfinite(x) for x in result.losses)
    assert read_latest_iteration(str(save)) == 4
    assert sorted(p for p in os.listdir(save) if p.startswith("iter_")) == ["iter_0000002", "iter_0000004"]
    with open(save / "iter_0000004" / "dflash_config.json") as f:
        assert json.load(f)["architectures"] == ["DFlashDraftModel"]
    body = load_hf_checkpoint(str(tmp_path / "hf"))
    assert body.config.block_size == 8 and body.config.num_target_layers == 6
    final = result.final_acceptance
    assert final is not None and 1.0 <= final["acceptance_length"] <= 8.0 and final["prompts"] == 3
    assert [i for i, _ in result.acceptance] == [2, 4] and [i for i, _ in result.validation] == [2, 4]
    out = capsys.readouterr().out
    assert "(autoregressive baseline 1.0)" in out and "loss:" in out and "grad norm:" in out
    assert "tokens per second:" in out and "learning rate:" in out and "accuracy:" in out
    # one label per acceptance figure, on the console and in the run directory
    assert "train acceptance (teacher-forced):" in out and "valid acceptance (teacher-forced):" in out
    assert "[final] decode acceptance length (speculative decoding) " in out
    assert " acceptance:" not in out and "acceptance length 1" not in out
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["split"], r["iteration"]) for r in records if r["split"] != "train"] == [
        ("valid", 2), ("decode", 2), ("valid", 4), ("decode", 4)]
    train = [r for r in records if r["split"] == "train"]
    assert [r["iteration"] for r in train] == [2, 4]  # means over each log interval, as on the console
    losses = result.losses
    assert [r["loss"] for r in train] == pytest.approx([(losses[0] + losses[1]) / 2, (losses[2] + losses[3]) / 2])
    assert [r["learning rate"] for r in train] == pytest.approx([result.learning_rates[1], result.learning_rates[3]])
    assert {"train acceptance (teacher-forced)", "accuracy", "tokens per second", "learning rate",
            "grad norm"} <= set(train[0])
    assert records[-1]["decode acceptance length (speculative decoding)"] == pytest.approx(final["acceptance_length"])
    args = json.loads((tmp_path / "args.json").read_text())
    assert args["train_iters"] == 4 and args["global_batch_size"] == 8 and args["save"] == str(save)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_acceptance"]["acceptance_length"] == pytest.approx(final["acceptance_length"])
    assert summary["checkpoint"] == str(save) and summary["hf_export"] == str(tmp_path / "hf")
    assert out.rstrip().splitlines()[-len(summary["next_steps"]) * 2 - 1].startswith("[result] decode acceptance")
    if summary["plot"] is not None:
        assert (tmp_path / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the printed next steps run as they are: the conversion (a subprocess, like a user's shell) ...
    commands = [step["command"] for step in summary["next_steps"]]
    assert [c for c in out.splitlines() if c.startswith("    python ")] == [f"    {c}" for c in commands]
    convert_cmd, check_cmd, evaluate_cmd = commands
    done = subprocess.run(convert_cmd, shell=True, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "validated: every tensor identical" in done.stdout, done.stderr
    assert safetensors_of(str(tmp_path / "converted-hf")).keys() == safetensors_of(str(tmp_path / "hf")).keys()
    # ... the serving check of the export (a plain DFlash draft of a Qwen3 target: both runtimes serve it) ...
    done = subprocess.run(check_cmd, shell=True, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "vLLM 0.34.0: loads\n" in done.stdout and "SGLang 0.5.23: loads\n" in done.stdout, done.stdout
    assert shlex.split(check_cmd)[-2] == "--target" and os.path.samefile(shlex.split(check_cmd)[-1], tiny_target)
    # ... and the evaluation's command line is complete and names existing files
    evaluate_acceptance = evaluate_module()
    words = shlex.split(evaluate_cmd)
    assert words[0] == "python" and os.path.samefile(words[1], evaluate_acceptance.__file__)
    parsed = evaluate_acceptance.parse_args(words[2:])
    assert parsed.prompts == str(prompts) and parsed.draft == str(tmp_path / "hf")
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        assert "TensorBoard logging is skipped" in out
    else:
        assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "tb"))


def _tp_run(rank, world_size, target, out_dir, save):
    import pathlib

    argv = training_argv(target, pathlib.Path(out_dir), "--train-iters", "4", "--micro-batch-size", "4",
                         "--global-batch-size", "4", "--dflash-eval-prompts", "0", "--tensor-model-parallel-size",
                         str(world_size), "--target-backend", "megatron", "--save", save, "--exit-interval", "2")
    torch.set_num_threads(1)
    result = run_training(argv)
    return result.losses, result.grad_norms


def test_tensor_parallel_2_matches_tp1(tp_pool, tiny_target, tmp_path):
    """TP=2 (megatron target, vocab-parallel head, sharded draft) reproduces TP=1's losses, and its
    checkpoint (draft and Adam moments sharded over TP) resumes at TP=1 where TP=1 would be."""
    common = ["--train-iters", "4", "--micro-batch-size", "4", "--global-batch-size", "4", "--dflash-eval-prompts", "0"]
    reference = run_training(training_argv(tiny_target, tmp_path / "tp1", *common))
    save = str(tmp_path / "ckpt")
    results = tp_pool(2).run(_tp_run, tiny_target, str(tmp_path / "tp2"), save, tp=2)
    (losses0, norms0), (losses1, norms1) = results
    assert losses0 == losses1 and len(losses0) == 2
    resumed = run_training(training_argv(tiny_target, tmp_path / "resumed", *common, "--load", save))
    assert resumed.start_iteration == 2
    losses = losses0 + resumed.losses
    norms = norms0 + resumed.grad_norms
    for a, b in zip(reference.losses, losses):
        assert abs(a - b) < 1e-5, (reference.losses, losses)
    for a, b in zip(reference.grad_norms, norms):
        assert abs(a - b) < 1e-4 * max(1.0, a), (reference.grad_norms, norms)
    exported = safetensors_of(str(tmp_path / "resumed" / "hf"))
    expected = safetensors_of(str(tmp_path / "tp1" / "hf"))
    assert exported.keys() == expected.keys()
    for key in expected:
        assert torch.allclose(exported[key], expected[key], atol=1e-4, rtol=0), key


def _pp_run(rank, world_size, target, out_dir, *extra):
    import pathlib

    argv = training_argv(target, pathlib.Path(out_dir), "--train-iters", "3", "--micro-batch-size", "4",
                         "--global-batch-size", "4", "--dflash-eval-prompts", "0", "--tensor-model-parallel-size", "2",
                         "--pipeline-model-parallel-size", "2", "--target-backend", "megatron", *extra)
    torch.set_num_threads(1)
    result = run_training(argv)
    return result.losses, result.grad_norms, result.learning_rates


def test_pipeline_2_x_tensor_parallel_2_matches_tp1(tp_pool, tiny_target, tmp_path):
    """TP=2 x PP=2 (the target split over two stages, the draft on the last one, taps, embedding and tied
    output layer routed there) reproduces TP=1 x PP=1's losses on every rank (the statistics are reduced
    over the pipeline); its checkpoint (written by all stages, the draft by the last) resumes at TP=1 and at
    TP=2 x PP=2, and the pipeline run's HF export matches TP=1's."""
    common = ["--train-iters", "3", "--micro-batch-size", "4", "--global-batch-size", "4", "--dflash-eval-prompts", "0"]
    reference = run_training(training_argv(tiny_target, tmp_path / "ref", *common))
    save = str(tmp_path / "ckpt")
    pool = tp_pool(4)
    results = pool.run(_pp_run, tiny_target, str(tmp_path / "pp2"), "--save", save, "--exit-interval", "2", tp=None)
    assert all(r == results[0] for r in results), results  # rank 0 (first stage) logs the draft's numbers
    losses, norms, lrs = results[0]
    assert len(losses) == 2
    resumed = run_training(training_argv(tiny_target, tmp_path / "resumed", *common, "--load", save))
    assert resumed.start_iteration == 2
    for a, b in zip(reference.losses, losses + resumed.losses):
        assert abs(a - b) < 1e-5, (reference.losses, losses + resumed.losses)
    for a, b in zip(reference.grad_norms, norms):
        assert abs(a - b) < 1e-4 * max(1.0, a), (reference.grad_norms, norms)
    assert lrs == reference.learning_rates[:2]
    # resume in the pipeline layout: every stage joins the collective load, the draft's stage restores
    again = pool.run(_pp_run, tiny_target, str(tmp_path / "pp2"), "--load", save, tp=None)
    assert all(r == again[0] for r in again) and len(again[0][0]) == 1
    assert abs(again[0][0][0] - reference.losses[2]) < 1e-5, (reference.losses, again[0][0])
    exported = safetensors_of(str(tmp_path / "pp2" / "hf"))
    expected = safetensors_of(str(tmp_path / "ref" / "hf"))
    assert exported.keys() == expected.keys()
    for key in expected:
        assert torch.allclose(exported[key], expected[key], atol=1e-4, rtol=0), key


# ------------------------------------------------------------------------------------------ torchrun on CPU ranks

PRETRAIN = os.path.join(REPO_ROOT, "pretrain_dflash.py")
LAUNCH_ARGS = ["--train-iters", "2", "--micro-batch-size", "4", "--global-batch-size", "4", "--dflash-eval-prompts", "0"]


@pytest.fixture(scope="module")
def hf_backend_losses(tiny_target, tmp_path_factory):
    """The losses of the launch below with the transformers target, in this process (TP = PP = 1)."""
    return run_training(training_argv(tiny_target, tmp_path_factory.mktemp("hf_backend"), *LAUNCH_ARGS)).losses


@pytest.mark.parametrize("layout, grid", [(["--tensor-model-parallel-size", "2"], "TP 2 x PP 1"),
                                          (["--pipeline-model-parallel-size", "2"], "TP 1 x PP 2")], ids=["tp2", "pp2"])
def test_torchrun_with_a_megatron_target_on_cpu_ranks(tiny_target, tmp_path, hf_backend_losses, layout, grid):
    """`torchrun --nproc-per-node 2 pretrain_dflash.py --target-backend megatron` at TP=2 or PP=2 without CUDA:
    two gloo ranks, the target under the product's device shim; the losses (metrics.jsonl, logged every
    iteration) are the transformers target's."""
    argv = training_argv(tiny_target, tmp_path, *LAUNCH_ARGS, "--target-backend", "megatron", *layout, "--run-dir", str(tmp_path))
    env = child_env(OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           PRETRAIN, *argv], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"(megatron); world 2 = {grid} x DP 1;" in done.stdout and "device cpu" in done.stdout, done.stdout
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["split"] == "train"]
    assert [r["iteration"] for r in records if r["split"] == "train"] == [1, 2]
    print(f"torchrun {' '.join(layout)} vs HF losses, max relative difference",
          max(abs(a - b) / abs(b) for a, b in zip(losses, hf_backend_losses)))
    assert losses == pytest.approx(hf_backend_losses, rel=1e-5, abs=0), (losses, hf_backend_losses)


# ------------------------------------------------------------------------------------------ checkpoints


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_resume_is_exact(tiny_target, tmp_path, precision):
    """6 steps straight == 3 steps, exit, resume, 3 steps: same losses, learning rates and final weights
    (bf16: the fp32 master weights and the Adam moments travel through the checkpoint)."""
    common = ["--train-iters", "6", "--micro-batch-size", "4", "--global-batch-size", "4",
              "--dflash-eval-prompts", "0", "--lr-decay-style", "cosine"] + (["--bf16"] if precision == "bf16" else [])
    straight = run_training(training_argv(tiny_target, tmp_path / "a", *common))
    save = str(tmp_path / "ckpt")
    first = run_training(training_argv(tiny_target, tmp_path / "b", *common, "--save", save, "--exit-interval", "3"))
    assert first.exited_early and first.iterations == 3 and first.export_dir is None
    second = run_training(training_argv(tiny_target, tmp_path / "b", *common, "--save", save, "--load", save))
    assert second.start_iteration == 3 and second.iterations == 6
    assert first.losses + second.losses == straight.losses  # bitwise
    assert first.learning_rates + second.learning_rates == straight.learning_rates
    a, b = safetensors_of(str(tmp_path / "a" / "hf")), safetensors_of(str(tmp_path / "b" / "hf"))
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_crash_in_the_middle_of_a_save_keeps_the_previous_checkpoint(tiny_target, tmp_path, monkeypatch):
    from megatron.core import dist_checkpointing

    from megatron_dflash.training.checkpointing import read_latest_iteration

    real_save = dist_checkpointing.save
    calls = []

    def crashing_save(state, directory, *args, **kwargs):
        calls.append(directory)
        real_save(state, directory, *args, **kwargs)  # the shards are on disk...
        if len(calls) == 2:
            raise OSError("disk full (simulated crash in the middle of the save)")  # ...but never published

    monkeypatch.setattr(dist_checkpointing, "save", crashing_save)
    save = tmp_path / "ckpt"
    common = ["--train-iters", "4", "--micro-batch-size", "4", "--global-batch-size", "4", "--dflash-eval-prompts",
              "0", "--save", str(save), "--save-interval", "2"]
    with pytest.raises(OSError, match="simulated crash"):
        run_training(training_argv(tiny_target, tmp_path, *common))
    assert read_latest_iteration(str(save)) == 2
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert not (save / "iter_0000004").exists()
    monkeypatch.setattr(dist_checkpointing, "save", real_save)
    resumed = run_training(training_argv(tiny_target, tmp_path, *common, "--load", str(save)))
    assert resumed.start_iteration == 2 and resumed.iterations == 4
    assert read_latest_iteration(str(save)) == 4
    assert not any(".tmp" in name for name in os.listdir(save))  # the stale partial save is gone


# ------------------------------------------------------------------------------------------ normalisation


def _dp_run(rank, world_size, target, out_dir):
    import pathlib

    torch.set_num_threads(1)
    result = run_training(training_argv(target, pathlib.Path(out_dir), "--train-iters", "2", "--micro-batch-size", "4",
                                        "--global-batch-size", "8", "--dflash-eval-prompts", "0"))
    return result.losses, result.grad_norms


def test_update_does_not_depend_on_the_micro_batch_split(tiny_target, tmp_path, tp_pool):
    """Global 8 rows as 1 x 8, 4 x 2 (accumulation) and DP 2 x 4: the same losses and weights."""
    common = ["--train-iters", "2", "--global-batch-size", "8", "--dflash-eval-prompts", "0"]
    whole = run_training(training_argv(tiny_target, tmp_path / "m8", *common, "--micro-batch-size", "8"))
    split = run_training(training_argv(tiny_target, tmp_path / "m2", *common, "--micro-batch-size", "2"))
    (dp_losses, dp_norms), _ = tp_pool(2).run(_dp_run, tiny_target, str(tmp_path / "dp2"), tp=1)
    for other_losses, other_norms in ((split.losses, split.grad_norms), (dp_losses, dp_norms)):
        for a, b in zip(whole.losses, other_losses):
            assert abs(a - b) < 1e-6 * max(1.0, abs(a)), (whole.losses, other_losses)
        for a, b in zip(whole.grad_norms, other_norms):
            assert abs(a - b) < 1e-5 * max(1.0, a), (whole.grad_norms, other_norms)
    reference = safetensors_of(str(tmp_path / "m8" / "hf"))
    for name in ("m2", "dp2"):
        other = safetensors_of(str(tmp_path / name / "hf"))
        for key in reference:
            assert torch.allclose(reference[key], other[key], atol=1e-6, rtol=0), (name, key)


# ------------------------------------------------------------------------------------------ data formats


def test_chat_text_and_indexed_data(tiny_target, tmp_path):
    """The JSONL (chat, text) and Megatron indexed formats train, with packing and a validation split."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from transformers import AutoTokenizer

    from megatron_dflash.embedded_job.synthetic_corpus import conversations

    chats = list(conversations(7, 24))
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    (tmp_path / "text.jsonl").write_text("".join(json.dumps({"text": c[1]["content"]}) + "\n" for c in chats))
    tok = AutoTokenizer.from_pretrained(tiny_target)
    prefix = str(tmp_path / "indexed")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for c in chats:
        builder.add_document(torch.tensor(tok(c[1]["content"])["input_ids"], dtype=torch.int32), [len(tok(c[1]["content"])["input_ids"])])
    builder.finalize(prefix + ".idx")
    common = ["--target", tiny_target, *TINY_DRAFT, "--no-progress-bar", "--seq-length", "64", "--train-iters", "2",
              "--micro-batch-size", "4", "--dflash-anchors-per-sample", "4", "--eval-iters", "1", "--lr-warmup-iters", "0",
              "--dflash-eval-max-new-tokens", "4", "--dflash-eval-ignore-eos"]
    for name, extra in (("chat", ["--data-format", "chat", "--train-data", str(tmp_path / "chat.jsonl"),
                                  "--valid-data", str(tmp_path / "chat.jsonl"), "--pack-sequences"]),
                        ("text", ["--data-format", "text", "--data-path", str(tmp_path / "text.jsonl")]),
                        ("indexed", ["--data-format", "indexed", "--data-path", prefix])):
        result = run_training(common + extra + ["--dflash-export", str(tmp_path / name / "hf")])
        assert result.iterations == 2 and all(math.isfinite(x) for x in result.losses), name
        # chat with --valid-data: validation loss, and acceptance on the held-out chats' prompts
        assert (len(result.validation) == 1) == (name == "chat")
        assert (result.final_acceptance is not None) == (name == "chat")
        assert os.path.isfile(tmp_path / name / "hf" / "model.safetensors")


def test_sharegpt_data_with_the_chat_options(tiny_target, tmp_path):
    """A ShareGPT JSON-array file with a bad record trains 2 steps with --bad-records skip, a chat template given
    by file, template kwargs, --reasoning and --loss-turns, and validates on it (loss and the acceptance of its
    prompts); args.json records the chat options."""
    from megatron_dflash.common.errors import DataError
    from megatron_dflash.embedded_job.synthetic_corpus import conversations

    sharegpt = {"user": "human", "assistant": "gpt"}
    records = [{"conversations": [{"from": sharegpt[m["role"]], "value": m["content"]} for m in c]}
               for c in conversations(7, 24)]
    records.insert(5, {"conversations": [{"from": "narrator", "value": "count"}]})  # skipped, named
    (tmp_path / "sharegpt.json").write_text(json.dumps(records))
    template = tmp_path / "template.jinja"  # the target's own template, refusing to render unless thinking is off
    with open(os.path.join(tiny_target, "chat_template.jinja")) as f:
        template.write_text("{% if enable_thinking is not defined or enable_thinking %}"
                            "{{ raise_exception('thinking is not off') }}{% endif %}" + f.read())
    run_dir = tmp_path / "run"
    argv = ["--target", tiny_target, *TINY_DRAFT, "--no-progress-bar", "--seq-length", "64", "--train-iters", "2",
            "--micro-batch-size", "4", "--dflash-anchors-per-sample", "4", "--lr-warmup-iters", "0",
            "--eval-iters", "1", "--dflash-eval-max-new-tokens", "4", "--dflash-eval-ignore-eos",
            "--data-format", "chat", "--train-data", str(tmp_path / "sharegpt.json"),
            "--valid-data", str(tmp_path / "sharegpt.json"),
            "--bad-records", "skip", "--max-bad-fraction", "0.1", "--chat-template", str(template),
            "--chat-template-kwargs", '{"enable_thinking": false}', "--reasoning", "drop", "--loss-turns", "last",
            "--dflash-export", str(run_dir / "hf")]
    result = run_training(argv)
    assert result.iterations == 2 and all(math.isfinite(x) for x in result.losses)
    # validation loss, and acceptance on the held-out chats' prompts (rendered with the kwargs too)
    assert len(result.validation) == 1 and result.final_acceptance is not None
    args = json.loads((run_dir / "args.json").read_text())
    assert (args["chat_template"], args["chat_template_kwargs"], args["reasoning"], args["loss_turns"],
            args["bad_records"], args["max_bad_fraction"]) == (str(template), '{"enable_thinking": false}', "drop",
                                                               "last", "skip", 0.1)
    # the kwarg reached the template, of the prompts and of the data: without it the template refuses them
    k = argv.index("--chat-template-kwargs")
    bad = argv[:k] + argv[k + 2:-1] + [str(tmp_path / "run2" / "hf"), "--bad-records", "fail"]
    with pytest.raises(ArgumentError, match=r"--valid-data: .*sharegpt\.json\[0\]: cannot tokenise the prompt "
                                            r"\(TemplateError: thinking is not off\)"):
        run_training(bad)
    v = bad.index("--valid-data")
    with pytest.raises(DataError, match=r"sharegpt\.json\[0\]: the chat template refuses the conversation "
                                        r"\(TemplateError: thinking is not off\)"):
        run_training(bad[:v] + bad[v + 2:] + ["--dflash-eval-prompts", "0"])


def test_start_from_a_drafter_or_a_release_checkpoint(tiny_target, tmp_path):
    """--dflash-init-from HF_DIR and --load of a converted 'release' checkpoint start the same run:
    the drafter's weights, a fresh optimizer, iteration 0."""
    from megatron_dflash.checkpoint.conversion import convert_hf_to_megatron

    common = ["--train-iters", "2", "--micro-batch-size", "4", "--global-batch-size", "4", "--dflash-eval-prompts", "0"]
    run_training(training_argv(tiny_target, tmp_path / "first", *common))
    drafter = str(tmp_path / "first" / "hf")
    convert_hf_to_megatron(drafter, str(tmp_path / "release"))
    from_hf = run_training(training_argv(tiny_target, tmp_path / "from_hf", *common, "--dflash-init-from", drafter))
    from_release = run_training(training_argv(tiny_target, tmp_path / "from_release", *common, "--load", str(tmp_path / "release")))
    assert from_release.start_iteration == 0 and from_release.iterations == 2
    assert from_hf.losses == from_release.losses
    first = run_training(training_argv(tiny_target, tmp_path / "again", *common))
    assert from_hf.losses[0] != first.losses[0]  # the drafter's weights were really used


def test_soft_targets_for_plain_dflash(tiny_target, tmp_path):
    """--dflash-soft-target kl trains against the target's own distribution: the loop captures the
    target's final hidden states for it (the loss refuses to run without them)."""
    soft = run_training(training_argv(tiny_target, tmp_path / "soft", "--train-iters", "2", "--micro-batch-size", "4",
                                      "--global-batch-size", "4", "--dflash-eval-prompts", "0", "--dflash-soft-target", "kl",
                                      "--dflash-distill-temperature", "2"))
    assert soft.iterations == 2 and all(math.isfinite(x) and x >= 0.0 for x in soft.losses)


def test_dpace_loss_weighting(tiny_target, tmp_path, capsys):
    """--dflash-loss-weighting dpace trains a few steps: the run says which weighting it runs, and the loss
    (normalised by the supervised slots here) stays finite."""
    run = run_training(training_argv(tiny_target, tmp_path / "dpace", "--train-iters", "2", "--micro-batch-size", "2",
                                     "--global-batch-size", "4", "--dflash-eval-prompts", "0", "--dflash-loss-weighting", "dpace",
                                     "--dflash-dpace-alpha", "0.4", "--dflash-dpace-normalization", "supervised"))
    assert run.iterations == 2 and all(math.isfinite(x) and x > 0.0 for x in run.losses)
    assert "loss weights dpace (alpha 0.4, / supervised)" in capsys.readouterr().out


def test_dspark_trains_and_starts_from_a_nemo_drafter_with_the_target_copies(tiny_target, tmp_path):
    """DSpark trains (the final hidden state captured, its metrics logged); a drafter that carries NeMo
    AutoModel's copies of the target's embedding and LM head starts a run when they are the target's, and is
    refused in one line naming the tensor when one differs (trained against another target)."""
    from safetensors.torch import save_file

    common = ["--train-iters", "1", "--lr-warmup-iters", "0", "--micro-batch-size", "4", "--global-batch-size", "4",
              "--dflash-eval-prompts", "0", "--dflash-variant", "dspark", "--dflash-markov-rank", "8",
              "--dflash-markov-head-type", "rnn"]
    first = run_training(training_argv(tiny_target, tmp_path / "first", *common))
    assert first.iterations == 1 and math.isfinite(first.losses[0])
    target = safetensors_of(tiny_target)
    embedding = target["model.embed_tokens.weight"]
    head = target.get("lm_head.weight", embedding)  # tied: the head is the embedding
    drafter = safetensors_of(tmp_path / "first" / "hf")

    def with_copies(name, lm_head):
        directory = tmp_path / name
        shutil.copytree(tmp_path / "first" / "hf", directory)
        save_file({**drafter, "embed_tokens.weight": embedding.clone(), "lm_head.weight": lm_head.contiguous()},
                  str(directory / "model.safetensors"))
        return str(directory)

    wrong = head.clone()
    wrong[5, 3] += 0.5
    with pytest.raises(ArgumentError) as info:
        run_training(training_argv(tiny_target, tmp_path / "wrong", *common, "--dflash-init-from", with_copies("nemo_wrong", wrong)))
    message = str(info.value)
    assert "the drafter's lm_head.weight" in message and "is not the target's own" in message and "\n" not in message
    same = run_training(training_argv(tiny_target, tmp_path / "same", *common, "--dflash-init-from", with_copies("nemo", head)))
    assert same.iterations == 1 and math.isfinite(same.losses[0])


def test_dspark_trains_with_dpace(tiny_target, tmp_path, capsys):
    """--dflash-loss-weighting dpace reaches DSpark's loss (the recipe's decay is not applied with it)."""
    run = run_training(training_argv(tiny_target, tmp_path / "dpace", "--train-iters", "2", "--micro-batch-size", "2",
                     "--global-batch-size", "4", "--dflash-eval-prompts", "0", "--dflash-variant", "dspark",
                     "--dflash-markov-rank", "8", "--dflash-loss-weighting", "dpace"))
    assert run.iterations == 2 and all(math.isfinite(x) and x > 0.0 for x in run.losses)
    assert "loss weights dpace (alpha 0.5, / weight_sum)" in capsys.readouterr().out


def test_a_dspark_run_decodes_in_training_and_in_the_evaluation_tool(tiny_target, tmp_path, monkeypatch):
    """A DSpark run with --dflash-confidence-threshold: its decode evaluation passes the run's threshold to
    `spec_generate`, and the tool decodes its HF export and its torch_dist checkpoint alike, every slot
    proposing (a cycle commits up to block size + 1), losslessly (the target's own greedy output)."""
    from megatron_dflash.decoding import generate

    thresholds = []
    spec_generate = generate.spec_generate

    def recording(*args, **kwargs):
        thresholds.append(kwargs.get("confidence_threshold"))
        return spec_generate(*args, **kwargs)

    monkeypatch.setattr("megatron_dflash.training.evaluation.spec_generate", recording)
    save, prompts = tmp_path / "ckpt", tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in ([3, 10, 20], [5, 6], [7, 8, 9, 11])))
    result = run_training(training_argv(tiny_target, tmp_path, "--dflash-variant", "dspark", "--train-iters", "2",
                        "--micro-batch-size", "4", "--global-batch-size", "4", "--save", str(save),
                        "--dflash-confidence-threshold", "0.05", "--dflash-eval-prompts", str(prompts),
                        "--dflash-eval-max-new-tokens", "8", "--dflash-eval-ignore-eos"))
    assert result.final_acceptance is not None and thresholds and set(thresholds) == {0.05}
    evaluate_acceptance = evaluate_module()
    reports = []
    for draft in (tmp_path / "hf", save):
        out = tmp_path / f"report-{len(reports)}.json"
        assert evaluate_acceptance.main([
            "--target", tiny_target, "--draft", str(draft), "--prompts", str(prompts), "--max-new-tokens", "12",
            "--batch-size", "2", "--ignore-eos", "--device", "cpu", "--confidence-threshold", "0.05",
            "--output", str(out)]) == 0
        reports.append(json.loads(out.read_text()))
    for report in reports:
        assert report["settings"]["proposals_per_block"] == report["settings"]["block_size"] == 8
        assert report["summary"]["greedy_outputs_identical_fraction"] == 1.0
        assert all(1 <= a <= 9 for p in report["prompts"] for a in p["acceptance_lengths"])
    assert [p["generated_ids"] for p in reports[0]["prompts"]] == [p["generated_ids"] for p in reports[1]["prompts"]]
    assert reports[0]["summary"]["mean_acceptance_length"] == reports[1]["summary"]["mean_acceptance_length"]
    with pytest.raises(ArgumentError, match="this draft has no confidence head"):
        prepare_job(parse_args(training_argv(tiny_target, tmp_path / "no-head", "--dflash-variant", "dspark",
                                     "--no-dflash-confidence-head", "--dflash-confidence-threshold", "0.5")),
                    1, cuda=False)
