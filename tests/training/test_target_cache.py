"""Training from cached target states (`training/target_cache.py`) against training with the target online:
the same losses, gradients and weights bitwise from an fp32 cache (DFlash, JetSpec, DSpark), an exact resume, the
same at DP=2 (a cache written at DP=1) and TP=2 (megatron target), a bf16 cache within its rounding in an fp32
run and bitwise in a bf16 run, the hybrid mode (bitwise as online over epochs, resumed in its first epoch), and the
refusals (a differing manifest names the field, a corrupt shard is named)."""

from __future__ import annotations

import pathlib

import pytest
import torch

from megatron_dflash.common.errors import DataError
from training_runs import MULTI_RANK_TIMEOUT_S, TINY_DRAFT, run_main, run_training, safetensors_of, training_argv

pytestmark = pytest.mark.usefixtures("one_thread")

RUN = ["--train-iters", "3", "--micro-batch-size", "4", "--global-batch-size", "8", "--dflash-eval-prompts", "0"]
VARIANTS = ["dflash", "jetspec", "dspark"]


def cache_args(directory, mode="read", *extra):
    return ["--dflash-target-cache", str(directory), "--dflash-target-cache-mode", mode, *extra]


def recorded_run(argv) -> list:
    """Per optimizer step: the loss, the body's gradients (megatron DDP's main_grad) and weights after it."""
    steps = []

    def on_step(iteration, values, body):
        grads, weights = {}, {}
        for name, p in body.named_parameters():
            grad = getattr(p, "main_grad", None)
            grads[name] = (grad if grad is not None else p.grad).detach().clone()
            weights[name] = p.detach().clone()
        steps.append({"loss": values["loss"], "grad norm": values["grad norm"], "grads": grads, "weights": weights})

    run_training(argv, hooks={"on_step": on_step})
    return steps


@pytest.fixture(scope="module")
def runs(tiny_target, tmp_path_factory):
    """Per variant: an online run, and a run that writes its fp32 cache first and then trains reading it."""
    out = {}
    for variant in VARIANTS:
        root = tmp_path_factory.mktemp(variant)
        args = [*RUN, "--dflash-variant", variant]
        online = recorded_run(training_argv(tiny_target, root / "online", *args))
        cached = recorded_run(training_argv(tiny_target, root / "cached", *args,
                                            *cache_args(root / "cache", "write")))
        out[variant] = {"online": online, "cached": cached, "cache": root / "cache", "root": root}
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_an_fp32_cache_trains_bitwise_as_the_online_target(runs, variant):
    online, cached = runs[variant]["online"], runs[variant]["cached"]
    assert len(online) == len(cached) == 3
    for step, (a, b) in enumerate(zip(online, cached)):
        assert a["loss"] == b["loss"] and a["grad norm"] == b["grad norm"], (variant, step)
        for name in a["grads"]:
            assert torch.equal(a["grads"][name], b["grads"][name]), (variant, step, "grad", name)
            assert torch.equal(a["weights"][name], b["weights"][name]), (variant, step, "weight", name)


def test_a_resumed_run_reading_the_cache_continues_exactly(runs, tiny_target, tmp_path):
    whole = runs["dflash"]
    save = tmp_path / "ckpt"
    args = [*RUN[2:], "--dflash-variant", "dflash", *cache_args(whole["cache"]), "--save", str(save)]
    first = run_training(training_argv(tiny_target, tmp_path / "first", "--train-iters", "2", *args))
    rest = run_training(training_argv(tiny_target, tmp_path / "rest", "--train-iters", "3", *args, "--load", str(save)))
    assert rest.start_iteration == 2
    assert first.losses + rest.losses == [s["loss"] for s in whole["cached"]]
    uninterrupted = safetensors_of(whole["root"] / "cached" / "hf")
    resumed = safetensors_of(tmp_path / "rest" / "hf")
    assert uninterrupted.keys() == resumed.keys()
    assert all(torch.equal(uninterrupted[k], resumed[k]) for k in resumed)


def test_a_bf16_cache_follows_the_online_loss_curve(runs, tiny_target, tmp_path):
    """An fp32 run reading states stored in bf16: each state is rounded to 8 significant bits (relative error at
    most 2^-9 = 0.2 %). The loss is a smooth function of the states through RMSNorm and a few layers, so its
    relative change stays of that order; 1 % per step over three steps allows for the optimizer's amplification
    (Adam normalises the step size, so a gradient's 0.2 % change moves the weights by well under 1 % of a step),
    while a wrong state (another sample's, an unshifted tap) moves the loss by tens of percent."""
    online = [s["loss"] for s in runs["dflash"]["online"]]
    cached = run_training(training_argv(tiny_target, tmp_path / "bf16", *RUN, *cache_args(
        tmp_path / "cache", "write", "--dflash-target-cache-dtype", "bfloat16"))).losses
    assert len(cached) == len(online)
    for a, b in zip(online, cached):
        assert abs(a - b) <= 0.01 * abs(a), (online, cached)
    assert cached != online  # the states really were rounded
    size = lambda d: sum(p.stat().st_size for p in pathlib.Path(d).glob("train-*.safetensors"))  # noqa: E731
    assert size(tmp_path / "cache") < 0.6 * size(runs["dflash"]["cache"])


def test_a_cache_of_another_run_is_refused_naming_the_field(runs, tiny_target, tmp_path, capsys, monkeypatch):
    cache = runs["dflash"]["cache"]
    for extra, field in ((["--seq-length", "40"], "seq_length: cache 48, run 40"),
                         (["--dflash-target-layer-ids", "1,4"], "target_layer_ids: cache (1, 3), run (1, 4)"),
                         (["--dflash-target-cache-dtype", "bfloat16"], "dtype: cache 'float32', run 'bfloat16'")):
        status, err = run_main(training_argv(tiny_target, tmp_path / field[:6], *RUN, *extra, *cache_args(cache)),
                               capsys, monkeypatch)
        assert status == 1 and field in err and len(err.strip().splitlines()) == 1, err


def test_a_corrupt_shard_is_named(runs, tiny_target, tmp_path):
    import shutil

    cache = tmp_path / "cache"
    shutil.copytree(runs["dflash"]["cache"], cache)
    shard = cache / "train-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x40  # a bit of the last tensor's data
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"shard train-00000.safetensors of the target-state cache .* is corrupt: its "
                                        "sha256 differs"):
        run_training(training_argv(tiny_target, tmp_path / "run", *RUN, *cache_args(cache)))


def test_a_fine_tuned_target_with_the_same_config_is_refused_naming_the_field(runs, tiny_target, tmp_path, capsys,
                                                                             monkeypatch):
    """The target's copy with one tapped layer's weights changed (same config.json, names, dtypes and shapes: the
    same safetensors header) made other states: its run is refused before the first step, naming the manifest's
    target field, in one line."""
    import shutil

    from safetensors.torch import load_file, save_file

    tuned = tmp_path / "tuned"
    shutil.copytree(tiny_target, tuned)
    weights = load_file(str(tuned / "model.safetensors"))
    name = next(n for n in weights if ".layers.1." in n and n.endswith("mlp.down_proj.weight"))
    weights[name] = weights[name] * 1.01
    save_file(weights, str(tuned / "model.safetensors"), metadata={"format": "pt"})
    status, err = run_main(training_argv(str(tuned), tmp_path / "run", *RUN, *cache_args(runs["dflash"]["cache"])),
                           capsys, monkeypatch)
    assert status == 1 and len(err.strip().splitlines()) == 1, err
    assert "does not match this run (target: cache '" in err and "the target's config or weights differ" in err, err
    assert not (tmp_path / "run" / "hf").exists()


def chat_argv(target, out, data, *extra):
    return ["--target", str(target), *TINY_DRAFT, "--no-progress-bar", "--seq-length", "64", "--train-iters", "1",
            "--micro-batch-size", "4", "--global-batch-size", "4", "--dflash-anchors-per-sample", "4",
            "--lr-warmup-iters", "0", "--dflash-eval-prompts", "0", "--data-format", "chat", "--train-data", str(data),
            "--dflash-export", str(out / "hf"), "--run-dir", str(out), *extra]


def test_a_changed_record_anywhere_in_the_data_is_refused_before_training(tiny_target, tmp_path, capsys,
                                                                          monkeypatch):
    """The cache records the whole data file's digest: a record changed in the middle of the file (none of the
    first, middle and last samples, which the manifest also fingerprints) is refused at the start, naming the data
    field, not at the step that reads its sample."""
    import json

    from megatron_dflash.embedded_job.synthetic_corpus import conversations

    chats = [{"messages": c} for c in conversations(7, 24)]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in chats))
    cache = tmp_path / "cache"
    run_training(chat_argv(tiny_target, tmp_path / "write", data, *cache_args(cache, "write")))
    chats[3]["messages"][1]["content"], chats[5]["messages"][1]["content"] = (chats[5]["messages"][1]["content"],
                                                                              chats[3]["messages"][1]["content"])
    data.write_text("".join(json.dumps(c) + "\n" for c in chats))
    status, err = run_main(chat_argv(tiny_target, tmp_path / "read", data, *cache_args(cache)), capsys, monkeypatch)
    assert status == 1 and len(err.strip().splitlines()) == 1, err
    assert "does not match this run (data: cache '" in err, err


# ------------------------------------------------------------------------------------------ DP = 2, TP = 2


def _rank_run(rank, world_size, target, out_dir, extra):
    """One rank of a two-rank launch: (losses, exported weights on rank 0)."""
    torch.set_num_threads(1)
    out = pathlib.Path(out_dir)
    result = run_training(training_argv(target, out, *RUN, *extra))
    return result.losses, (safetensors_of(out / "hf") if rank == 0 else None)


def _same(a, b) -> bool:
    return a[0] == b[0] and a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def test_a_cache_written_at_dp1_trains_at_dp2_as_the_online_target(runs, tp_pool, tiny_target, tmp_path):
    pool = tp_pool(2)
    online = pool.run(_rank_run, tiny_target, str(tmp_path / "online"), [], tp=1, timeout=MULTI_RANK_TIMEOUT_S)
    cached = pool.run(_rank_run, tiny_target, str(tmp_path / "cached"), cache_args(runs["dflash"]["cache"]), tp=1,
                      timeout=MULTI_RANK_TIMEOUT_S)
    assert online[0][0] == online[1][0] and len(online[0][0]) == 3
    assert _same(online[0], cached[0]) and cached[1][0] == cached[0][0]


def test_tp2_reads_the_cache_of_a_megatron_target_as_the_online_target(tp_pool, tiny_target, tmp_path):
    """The megatron target at TP=2 writes the cache (TP rank 0 writes), then TP=2 trains from it with the vocab-
    parallel head read from the target's files alone."""
    megatron = ["--target-backend", "megatron", "--tensor-model-parallel-size", "2"]
    pool = tp_pool(2)
    online = pool.run(_rank_run, tiny_target, str(tmp_path / "online"), megatron, tp=2, timeout=MULTI_RANK_TIMEOUT_S)
    cached = pool.run(_rank_run, tiny_target, str(tmp_path / "cached"),
                      [*megatron, *cache_args(tmp_path / "cache", "write")], tp=2, timeout=MULTI_RANK_TIMEOUT_S)
    assert len(online[0][0]) == 3 and _same(online[0], cached[0])


# ------------------------------------------------------------------------------------------ hybrid mode

# 16 training samples in global batches of 8: an epoch is 2 steps, 5 steps cover two and a half epochs; 4-sample
# shards: 4 training and 4 validation shards.
SMALL = ["--synthetic-train-samples", "16", "--micro-batch-size", "4", "--global-batch-size", "8",
         "--dflash-eval-prompts", "0", "--eval-interval", "2", "--dflash-target-cache-shard-size", "4",
         "--lr-decay-iters", "5"]  # the schedule of the 5-step run, also in the shorter runs that resume into it
HYBRID = [*SMALL, "--train-iters", "5"]


def shard_bytes(directory) -> dict:
    return {p.name: p.read_bytes() for p in sorted(pathlib.Path(directory).glob("*-*.safetensors"))}


@pytest.fixture(scope="module")
def hybrid(tiny_target, tmp_path_factory):
    """An online run over two and a half epochs, the same run in hybrid mode, and its log."""
    root = tmp_path_factory.mktemp("hybrid")
    online = recorded_run(training_argv(tiny_target, root / "online", *HYBRID))
    hybrid_run = recorded_run(training_argv(tiny_target, root / "hybrid", *HYBRID,
                                            *cache_args(root / "cache", "hybrid")))
    return {"online": online, "hybrid": hybrid_run, "cache": root / "cache", "root": root}


def test_a_hybrid_run_trains_bitwise_as_the_online_target(hybrid):
    """fp32: the first epoch runs the target online, the later ones read the states it staged; every step's loss,
    gradients and weights equal the online run's, through the switch (step 3) and into the third epoch."""
    online, cached = hybrid["online"], hybrid["hybrid"]
    assert len(online) == len(cached) == 5
    for step, (a, b) in enumerate(zip(online, cached)):
        assert a["loss"] == b["loss"] and a["grad norm"] == b["grad norm"], step
        for name in a["grads"]:
            assert torch.equal(a["grads"][name], b["grads"][name]), (step, "grad", name)
            assert torch.equal(a["weights"][name], b["weights"][name]), (step, "weight", name)


def test_a_hybrid_run_leaves_the_cache_the_write_pass_writes(hybrid, tiny_target, tmp_path):
    """The shards gathered from the staged states are byte for byte those of ``--dflash-target-cache-mode write``
    (which computes every shard in consecutive micro-batches), the index is there and the staging is gone."""
    run_training(training_argv(tiny_target, tmp_path / "write", *SMALL, "--train-iters", "2",
                               *cache_args(tmp_path / "cache", "write")))
    written, gathered = shard_bytes(tmp_path / "cache"), shard_bytes(hybrid["cache"])
    assert len(written) == 8 and written.keys() == gathered.keys()
    assert all(written[k] == gathered[k] for k in written)
    assert (hybrid["cache"] / "index.json").read_bytes() == (tmp_path / "cache" / "index.json").read_bytes()
    assert not (hybrid["cache"] / "staged").exists()


def test_a_hybrid_rerun_with_a_complete_cache_reads_from_the_start(hybrid, tiny_target, tmp_path, capsys):
    capsys.readouterr()
    losses = run_training(training_argv(tiny_target, tmp_path / "rerun", *HYBRID,
                                        *cache_args(hybrid["cache"], "hybrid"))).losses
    out = capsys.readouterr().out
    assert "target states read from" in out and "hybrid:" not in out, out
    assert losses == [s["loss"] for s in hybrid["online"]]


def test_a_hybrid_run_releases_the_decoder_layers_at_the_end_of_the_first_epoch(tiny_target, tmp_path, capsys):
    capsys.readouterr()
    run_training(training_argv(tiny_target, tmp_path / "run", *SMALL, "--train-iters", "3",
                               *cache_args(tmp_path / "cache", "hybrid")))
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "released the target's decoder layers" in x)
    freed = float(line.split("layers: ")[1].split(" MiB")[0])
    assert freed > 0, line


def test_a_hybrid_run_killed_in_its_first_epoch_resumes_exactly(hybrid, tiny_target, tmp_path):
    """Stopped after step 1 of the 2-step first epoch (half of the samples staged, one staged file left half
    written as a kill would leave it, one staged sample lost), the resumed run stages the rest, gathers the cache at
    step 2 (computing the lost sample again) and continues as the uninterrupted run."""
    save, cache = tmp_path / "ckpt", tmp_path / "cache"
    args = [*SMALL, *cache_args(cache, "hybrid"), "--save", str(save)]
    first = run_training(training_argv(tiny_target, tmp_path / "first", *args, "--train-iters", "1"))
    staged = sorted((cache / "staged").glob("*.safetensors"))
    assert len(staged) >= 8 and not (cache / "index.json").exists()  # step 1's samples (and validation's)
    staged[0].unlink()
    (cache / "staged" / f".{staged[1].name}.partial").write_bytes(staged[1].read_bytes()[:100])
    rest = run_training(training_argv(tiny_target, tmp_path / "rest", *args, "--train-iters", "5", "--load",
                                      str(save)))
    assert rest.start_iteration == 1
    assert first.losses + rest.losses == [s["loss"] for s in hybrid["online"]]
    assert shard_bytes(cache) == shard_bytes(hybrid["cache"])
    uninterrupted, resumed = safetensors_of(hybrid["root"] / "hybrid" / "hf"), safetensors_of(tmp_path / "rest" / "hf")
    assert all(torch.equal(uninterrupted[k], resumed[k]) for k in resumed)


def test_a_bf16_run_reading_a_bf16_cache_trains_bitwise_as_the_online_bf16_run(tiny_target, tmp_path):
    """A ``--bf16`` run: the online target's taps and final hidden state are already bf16 tensors, the cache (bf16,
    the default under ``--bf16``) stores them unchanged and the reader's cast to the run's dtype is the identity, so
    the tolerance is zero: every step's loss, gradients and weights equal the online bf16 run's bitwise (measured so
    on the tiny target; rounding happens only where the cache's dtype is narrower than the run's, the fp32 run of
    `test_a_bf16_cache_follows_the_online_loss_curve`)."""
    bf16 = [*RUN, "--bf16"]
    online = recorded_run(training_argv(tiny_target, tmp_path / "online", *bf16))
    cached = recorded_run(training_argv(tiny_target, tmp_path / "cached", *bf16,
                                        *cache_args(tmp_path / "cache", "write")))
    assert '"dtype": "bfloat16"' in (tmp_path / "cache" / "manifest.json").read_text()
    assert len(online) == len(cached) == 3
    for step, (a, b) in enumerate(zip(online, cached)):
        assert a["loss"] == b["loss"] and a["grad norm"] == b["grad norm"], step
        for name in a["grads"]:
            assert torch.equal(a["grads"][name], b["grads"][name]), (step, "grad", name)
            assert torch.equal(a["weights"][name], b["weights"][name]), (step, "weight", name)


def test_a_hybrid_run_at_dp2_trains_as_the_online_target(tp_pool, tiny_target, tmp_path):
    """DP=2: each replica stages the samples it draws, and each writes its own shards from both replicas'
    staging at the end of the first epoch; losses and weights equal the online DP=2 run's."""
    pool = tp_pool(2)
    online = pool.run(_rank_run, tiny_target, str(tmp_path / "online"), HYBRID, tp=1, timeout=MULTI_RANK_TIMEOUT_S)
    cached = pool.run(_rank_run, tiny_target, str(tmp_path / "hybrid"),
                      [*HYBRID, *cache_args(tmp_path / "cache", "hybrid")], tp=1, timeout=MULTI_RANK_TIMEOUT_S)
    assert len(online[0][0]) == 5 and _same(online[0], cached[0]) and cached[1][0] == cached[0][0]
    assert (tmp_path / "cache" / "index.json").exists() and not (tmp_path / "cache" / "staged").exists()


def test_a_hybrid_run_refuses_a_cache_of_another_run_before_training(tiny_target, tmp_path, capsys, monkeypatch):
    """The staged states of a first epoch serve only the run they were made for: a differing field (or shard
    size) is refused at the start, not at the end of the first epoch."""
    cache = tmp_path / "cache"
    run_training(training_argv(tiny_target, tmp_path / "first", *SMALL, "--train-iters", "1",
                               *cache_args(cache, "hybrid")))
    assert not (cache / "index.json").exists()
    for extra, field in ((["--seq-length", "40"], "seq_length: cache 48, run 40"),
                         (["--dflash-target-cache-shard-size", "8"], "shard_size: cache 4, run 8")):
        status, err = run_main(training_argv(tiny_target, tmp_path / field[:6], *HYBRID, *extra,
                                             *cache_args(cache, "hybrid")), capsys, monkeypatch)
        assert status == 1 and field in err and len(err.strip().splitlines()) == 1, err


def test_a_corrupt_staged_sample_is_named_in_one_line(tiny_target, tmp_path, capsys, monkeypatch):
    """A staged sample of an interrupted hybrid run replaced by a pickle, or truncated, is named in one line when the
    run resumes, before the target is loaded (nothing is unpickled: staged samples are read as safetensors only)."""
    import pickle

    save, cache = tmp_path / "ckpt", tmp_path / "cache"
    args = [*SMALL, *cache_args(cache, "hybrid"), "--save", str(save)]
    run_training(training_argv(tiny_target, tmp_path / "first", *args, "--train-iters", "1"))
    victim = sorted((cache / "staged").glob("*.safetensors"))[0]
    good = victim.read_bytes()
    for damage, why in ((pickle.dumps({"input_ids": [1, 2, 3]}), "not a safetensors file"),
                        (good[:-16], "truncated")):
        victim.write_bytes(damage)
        status, err = run_main(training_argv(tiny_target, tmp_path / "rest", *args, "--train-iters", "5", "--load",
                                             str(save)), capsys, monkeypatch)
        assert status == 1 and len(err.strip().splitlines()) == 1, err
        assert err.startswith(f"pretrain_dflash.py: error: {victim}: a staged sample of the target-state cache is "
                              "corrupt (") and why in err and "delete it and rerun" in err, err


def test_the_cache_writer_runs_the_target_on_real_tokens_only(tiny_target, tmp_path, monkeypatch):
    """At rows far shorter than --seq-length the write pass runs the target on each micro-batch's real columns only
    (its samples of similar lengths, the longest rounded up to 16), and the cache it writes still trains bitwise as
    the online target."""
    from megatron_dflash.target.taps import HFTarget

    args = [*RUN, "--seq-length", "128"]
    online = recorded_run(training_argv(tiny_target, tmp_path / "online", *args))
    widths, forward = [], HFTarget.forward

    def spy(self, input_ids, *a, **k):
        widths.append(int(input_ids.shape[1]))
        return forward(self, input_ids, *a, **k)

    monkeypatch.setattr(HFTarget, "forward", spy)
    cached = recorded_run(training_argv(tiny_target, tmp_path / "cached", *args,
                                        *cache_args(tmp_path / "cache", "write")))
    assert widths and max(widths) < 128 and all(w % 16 == 0 for w in widths), widths
    for step, (a, b) in enumerate(zip(online, cached, strict=True)):
        assert a["loss"] == b["loss"], step
        for name in a["grads"]:
            assert torch.equal(a["grads"][name], b["grads"][name]), (step, "grad", name)
            assert torch.equal(a["weights"][name], b["weights"][name]), (step, "weight", name)
