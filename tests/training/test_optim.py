"""The training engine is megatron-core's, for real: DDP, `finalize_model_grads`, `get_megatron_optimizer`.

Every run here trains the tiny embedded job with `MegatronEngine` on gloo CPU ranks (the same code
a GPU launch runs, under `device_shim.cuda_on_cpu()`), and compares it with an independent oracle:

* `reference_engine.ReferenceEngine`, megatron's DDP / clipped-Adam / fp32-master semantics in
  plain torch, on the same run (TP=1 and TP=2 x DP=2; fp32 and bf16; gradient accumulation over
  several micro-batches; clipping active on every step; warm-up + cosine schedule);
* the uninterrupted run, for resume (also with the distributed optimizer, at the same and another
  DP size).
"""

from __future__ import annotations

import os
import pathlib
import shutil

import pytest
import torch

from reference_engine import reference_engine
from training_runs import run_training

pytestmark = pytest.mark.usefixtures("one_thread")

# Small enough to clip on every step of these runs (their grad norms are ~1-10).
CLIP = 0.25
SCHEDULE = ["--train-iters", "5", "--lr", "2e-3", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine",
            "--min-lr", "1e-4", "--clip-grad", str(CLIP), "--weight-decay", "0.1"]
# the tiny target has 6 layers: a small draft instead of the recipe's 5 layers x block 16
DATA = ["--dflash-num-layers", "2", "--dflash-block-size", "8", "--data-format", "synthetic", "--no-progress-bar", "--log-interval", "1", "--seq-length", "48",
        "--synthetic-train-samples", "64", "--synthetic-valid-samples", "8", "--eval-iters", "1",
        "--dflash-anchors-per-sample", "4", "--dflash-eval-prompts", "0"]
# fp32: the engines differ only in the summation order of the grad norm (~1e-7 relative), hence in the
# clip coefficient by as much; the weights then agree to one fp32 ulp.
# bf16: the same fp32 differences in the fp32 main weights occasionally round a bf16 weight to its
# neighbour (one bf16 ulp, 2^-8 relative); the next forward then differs at bf16 precision and the
# difference grows over the steps (measured over 5 steps: losses 1e-4, grad norms 3e-3 relative, weights
# 2 bf16 ulps). A wrong update is far outside: without clipping the reference's losses move by
# 1.2e-2 relative over the same 5 steps.
TOLERANCE = {"fp32": dict(loss=1e-6, norm=1e-6, weight=1e-6), "bf16": dict(loss=1e-3, norm=1e-2, weight=8e-3)}


def _argv(target, out_dir, *extra):
    return ["--target", target, "--dflash-export", str(pathlib.Path(out_dir) / "hf"), *DATA, *extra]


def _run(argv, reference: bool = False):
    """(losses, grad norms, learning rates, exported weights) of one training run in this process."""
    from safetensors.torch import load_file

    if reference:
        with reference_engine():
            result = run_training(argv)
    else:
        result = run_training(argv)
    weights = None
    if result.export_dir is not None and os.path.isfile(os.path.join(result.export_dir, "model.safetensors")):
        weights = load_file(os.path.join(result.export_dir, "model.safetensors"))
    return result.losses, result.grad_norms, result.learning_rates, weights


def _assert_close(a, b, rel: float, what: str):
    assert len(a) == len(b), (what, a, b)
    for x, y in zip(a, b):
        assert abs(x - y) <= rel * max(1.0, abs(x)), (what, a, b)


def _assert_same_run(real, ref, precision: str):
    tol = TOLERANCE[precision]
    _assert_close(real[0], ref[0], tol["loss"], "loss")
    _assert_close(real[1], ref[1], tol["norm"], "grad norm")
    assert real[2] == ref[2]  # the learning rates: the same schedule, driven identically
    assert all(n > CLIP for n in ref[1]), ref[1]  # clipping was active on every step
    assert real[3].keys() == ref[3].keys()
    for key in ref[3]:
        diff = (real[3][key].float() - ref[3][key].float()).abs().max().item()
        scale = max(1.0, ref[3][key].float().abs().max().item())
        assert diff <= tol["weight"] * scale, (key, diff)


def _max_differences(real, ref) -> dict:
    rel = lambda a, b: max(abs(x - y) / max(1e-12, abs(y)) for x, y in zip(a, b))  # noqa: E731
    weight = max((real[3][k].float() - ref[3][k].float()).abs().max().item() for k in ref[3])
    return {"loss": rel(real[0], ref[0]), "grad_norm": rel(real[1], ref[1]), "weight_abs": weight}


# ------------------------------------------------------------------------------------------ device shim


def test_device_shim_maps_cuda_to_the_cpu_and_restores_everything():
    from megatron_dflash.training.device_shim import cuda_on_cpu

    saved = torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.empty_cache
    x = torch.ones(3, dtype=torch.bfloat16)
    with cuda_on_cpu():
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.tensor([1.0], device=torch.device("cuda", 0)).device.type == "cpu"
        assert torch.empty(4, device=torch.cuda.current_device()).device.type == "cpu"
        assert x.cuda() is x and x.to("cuda").device.type == "cpu"
        assert x.type() == "torch.cuda.BFloat16Tensor" and x.float().type() == "torch.cuda.FloatTensor"
        assert x.type(torch.float32).dtype == torch.float32  # a conversion is not a query
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        assert not torch.cuda.is_available()  # code that picks a backend by it is unaffected
    assert (torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.empty_cache) == saved
    assert x.type() == "torch.BFloat16Tensor"


# ------------------------------------------------------------------------------------------ equivalence


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_megatron_engine_matches_the_reference_tp1(tiny_target, tmp_path, precision):
    """TP=1: 4 micro-batches of 2 rows per step (accumulation), clipped Adam, warm-up + cosine."""
    extra = [*SCHEDULE, "--micro-batch-size", "2", "--global-batch-size", "8"]
    extra += ["--bf16"] if precision == "bf16" else []
    real = _run(_argv(tiny_target, tmp_path / "megatron", *extra))
    ref = _run(_argv(tiny_target, tmp_path / "reference", *extra), reference=True)
    print(precision, "TP=1 max differences", _max_differences(real, ref))
    _assert_same_run(real, ref, precision)


def _tp2_dp2(rank, world_size, target, out_dir, precision):
    extra = [*SCHEDULE, "--micro-batch-size", "2", "--global-batch-size", "8", "--tensor-model-parallel-size", "2",
             "--target-backend", "megatron"] + (["--bf16"] if precision == "bf16" else [])
    torch.set_num_threads(1)
    real = _run(_argv(target, pathlib.Path(out_dir) / "megatron", *extra))
    ref = _run(_argv(target, pathlib.Path(out_dir) / "reference", *extra), reference=True)
    return real, ref


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_megatron_engine_matches_the_reference_tp2_dp2(tp_pool, tiny_target, tmp_path, precision):
    """TP=2 x DP=2 (4 gloo ranks): 2 micro-batches of 2 rows per DP rank per step, sharded grad norm."""
    results = tp_pool(4).run(_tp2_dp2, tiny_target, str(tmp_path), precision, tp=2, timeout=400)
    real, ref = results[0]
    assert all(r[0][:3] == real[:3] and r[1][:3] == ref[:3] for r in results)  # every rank logs the same
    print(precision, "TP=2 x DP=2 max differences", _max_differences(real, ref))
    _assert_same_run(real, ref, precision)


# ------------------------------------------------------------------------------------------ distributed optimizer

DISTRIBUTED = ["--train-iters", "4", "--lr", "2e-3", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine",
               "--clip-grad", str(CLIP), "--micro-batch-size", "2", "--global-batch-size", "8"]


def _checkpoint_keys(directory: str) -> list:
    from torch.distributed.checkpoint import FileSystemReader

    return list(FileSystemReader(directory).read_metadata().state_dict_metadata)


def _dp_run(rank, world_size, target, out_dir, *extra):
    torch.set_num_threads(1)
    return _run(_argv(target, out_dir, *DISTRIBUTED, *extra))


def test_distributed_optimizer_resumes_exactly(tp_pool, tiny_target, tmp_path):
    """DP=2 with megatron's DistributedOptimizer (Adam state and fp32 main weights sharded over DP):
    4 steps straight == 2 steps, exit, resume, 2 steps (bitwise); it equals the replicated optimizer;
    its checkpoint resumes at DP=1 where the DP=2 run would be (as does the replicated optimizer's; switching
    between the two is refused), and converts to HF."""
    from safetensors.torch import load_file

    from megatron_dflash.checkpoint.conversion import convert_megatron_to_hf

    pool = tp_pool(2)
    save = str(tmp_path / "ckpt")
    dist_opt = ["--use-distributed-optimizer"]
    straight = pool.run(_dp_run, tiny_target, str(tmp_path / "straight"), *dist_opt, tp=1, timeout=300)[0]
    save_replicated = str(tmp_path / "ckpt-replicated")
    replicated = pool.run(_dp_run, tiny_target, str(tmp_path / "replicated"), "--save", save_replicated,
                          "--save-interval", "2", tp=1, timeout=300)[0]
    first = pool.run(_dp_run, tiny_target, str(tmp_path / "resumed"), *dist_opt, "--save", save,
                     "--exit-interval", "2", tp=1, timeout=300)[0]
    second = pool.run(_dp_run, tiny_target, str(tmp_path / "resumed"), *dist_opt, "--save", save, "--load", save,
                      tp=1, timeout=300)[0]
    assert len(first[0]) == 2 and len(second[0]) == 2
    assert first[0] + second[0] == straight[0]  # bitwise
    assert first[2] + second[2] == straight[2]
    for key in straight[3]:
        assert torch.equal(second[3][key], straight[3][key]), key
    # sharded over DP or replicated: the same update (the reduce-scatter sums what the all-reduce sums)
    _assert_close(replicated[0], straight[0], 1e-6, "loss, replicated vs distributed")
    # the checkpoint of iteration 2 at DP=1 (the same global batch as 4 micro-batches per step)
    ckpt = str(tmp_path / "ckpt-iter2")
    shutil.copytree(save, ckpt)
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2")
    resumed = _run(_argv(tiny_target, tmp_path / "dp1", *DISTRIBUTED, *dist_opt, "--load", ckpt))
    _assert_close(resumed[0], straight[0][2:], 1e-6, "loss, DP=2 -> DP=1")
    _assert_close(resumed[1], straight[1][2:], 1e-5, "grad norm, DP=2 -> DP=1")
    for key in straight[3]:
        assert torch.allclose(resumed[3][key], straight[3][key], atol=1e-6, rtol=0), key
    # the replicated optimizer's checkpoint too (its state is sharded like the parameters)
    with open(os.path.join(save_replicated, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2")
    resumed = _run(_argv(tiny_target, tmp_path / "dp1-replicated", *DISTRIBUTED, "--load", save_replicated))
    _assert_close(resumed[0], replicated[0][2:], 1e-6, "loss, DP=2 -> DP=1, replicated")
    for key in replicated[3]:
        assert torch.allclose(resumed[3][key], replicated[3][key], atol=1e-6, rtol=0), key
    # both checkpoints hold megatron's optimizer state next to the model (torch_dist metadata)
    assert any(k.startswith("optimizer.distributed.dp_group_idx_0.gbuf_idx_0.") and k.endswith(".exp_avg_sq")
               for k in _checkpoint_keys(os.path.join(save, "iter_0000002")))
    assert any(k.startswith("optimizer.state.exp_avg_sq.model.") for k in _checkpoint_keys(
        os.path.join(save_replicated, "iter_0000002")))
    # a checkpoint of the earlier CPU engine (its own optimizer layout) is refused with what to do instead
    old = str(tmp_path / "ckpt-old-cpu-engine")
    shutil.copytree(save_replicated, old)
    common_file = os.path.join(old, "iter_0000002", "common.pt")
    common = torch.load(common_file, weights_only=False)
    common.update(checkpoint_version=1, args=dict(common["args"], use_cuda=False))
    torch.save(common, common_file)
    with pytest.raises(ValueError, match="written on CPU by an earlier megatron-dflash.*--dflash-init-from"):
        _run(_argv(tiny_target, tmp_path / "refused-old", *DISTRIBUTED, "--load", old))
    # megatron's distributed-optimizer state does not load into the replicated optimizer: refused up front
    with pytest.raises(ValueError, match=r"holds the state of a distributed optimizer \(dp_reshardable\) at TP=1, "
                                         r"this run has a replicated optimizer"):
        _run(_argv(tiny_target, tmp_path / "refused", *DISTRIBUTED, "--load", ckpt))
    # a distributed-optimizer training checkpoint converts to HF like any other
    result = convert_megatron_to_hf(save, str(tmp_path / "converted"), validate=True)
    assert result.source.endswith("iter_0000004")
    converted = load_file(str(tmp_path / "converted" / "model.safetensors"))
    assert converted.keys() == straight[3].keys()
    for key in converted:
        assert torch.equal(converted[key], straight[3][key]), key


# ------------------------------------------------------------------------------------------ failures


def _nan_on_rank_1(rank, world_size):
    import types

    from builders import tiny_draft_kwargs

    from megatron_dflash.draft.body import DFlashBody
    from megatron_dflash.draft.config import DFlashConfig
    from megatron_dflash.training.optim import build_engine

    args = types.SimpleNamespace(
        lr=1e-3, min_lr=0.0, lr_warmup_iters=0, lr_decay_iters=10, lr_decay_style="constant", weight_decay=0.0,
        train_iters=10, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0, bf16=False,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, use_distributed_optimizer=True)
    config = DFlashConfig(**tiny_draft_kwargs())
    body = DFlashBody(config)
    engine = build_engine(body, args, config, use_cuda=False)
    engine.zero_grad()
    for p in body.parameters():
        p.main_grad.fill_(float("nan") if rank == 1 else 1.0)
    before = [p.detach().clone() for p in body.parameters()]
    engine.finish_grads(torch.tensor(4.0))
    try:
        engine.step()
    except FloatingPointError as err:
        unchanged = all(torch.equal(a, p) for a, p in zip(before, body.parameters()))
        return str(err), unchanged
    return None, None


def test_a_nan_gradient_on_one_rank_stops_every_rank_before_the_update(tp_pool):
    """DP=2 with the distributed optimizer: rank 1's NaN fails both ranks with one clear error, no hang,
    and no weight moves (megatron's own NaN check would raise on rank 1 only, before the reduction)."""
    results = tp_pool(2).run(_nan_on_rank_1, tp=1, timeout=120)
    for message, unchanged in results:
        assert message is not None and "non-finite gradients (NaN or Inf)" in message and "--lr" in message
        assert unchanged


# ------------------------------------------------------------------------------------------ pipeline


def _pp2_dp2_run(rank, world_size, target, out_dir, *extra):
    torch.set_num_threads(1)
    argv = _argv(target, out_dir, *DISTRIBUTED, "--train-iters", "3", "--pipeline-model-parallel-size", "2",
                 "--target-backend", "megatron", *extra)
    return _run(argv)[:3]


def test_distributed_optimizer_under_pipeline_parallelism(tp_pool, tiny_target, tmp_path):
    """PP=2 x DP=2 with the distributed optimizer: the draft's stage builds megatron's optimizer without the
    other stage (its parameter-group alignment and grad norm stay on the draft's TP x DP ranks), and the run
    equals the single-rank run."""
    reference = _run(_argv(tiny_target, tmp_path / "single", *DISTRIBUTED, "--train-iters", "3"))
    results = tp_pool(4).run(_pp2_dp2_run, tiny_target, str(tmp_path / "pp2"), "--use-distributed-optimizer", tp=None,
                             timeout=300)
    assert all(r == results[0] for r in results), results
    losses, norms, lrs = results[0]
    _assert_close(losses, reference[0], 1e-6, "loss, PP=2 x DP=2 vs one rank")
    _assert_close(norms, reference[1], 1e-5, "grad norm, PP=2 x DP=2 vs one rank")
    assert lrs == reference[2]
