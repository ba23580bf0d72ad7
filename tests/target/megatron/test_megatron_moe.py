"""Qwen3-MoE and DeepSeek-V3 targets in the megatron backend: conversion, expert parallelism, sequence parallelism.

Reference: transformers' own forward of tiny random Qwen3-MoE models (fp32), saved in several safetensors
shards so the shard-by-shard loader is exercised. Two routings are covered: ``norm_topk_prob=True`` (Qwen3-
30B-A3B / 235B-A22B) with a dense first layer (``mlp_only_layers``), and ``norm_topk_prob=False`` with
``decoder_sparse_step=2`` and tied embeddings; and DeepSeek-V3 (MLA + MoE) with plain RoPE and with YaRN
``rope_scaling`` used past ``original_max_position_embeddings``, and with ``rms_norm_eps`` 1e-5 (its latent norms keep
transformers' 1e-6). On 4 gloo ranks, logits, final hidden states
and every tap must equal transformers to 1e-5 relative at TP=2 x EP=2 (sequence parallelism off and on),
PP=2 x EP=2 and TP=2 x PP=2 x EP=2 (expert TP 1, sequence parallelism on). Training a draft for a few steps
next to a Qwen3-MoE or a YaRN DeepSeek-V3 target at TP=2 x PP=2 x EP=2 with sequence parallelism gives the
losses of the HF-adapter target, and so does `torchrun` of pretrain_dflash.py at TP=2 x EP=2 on two CPU ranks.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_dflash.common.safetensors_files import target_safetensors_files
from megatron_dflash.target.megatron.config import hf_target_spec, megatron_target_config
from megatron_dflash.target.megatron.weights import (
    convert_hf_to_megatron_state_dict,
    load_hf_state_dict,
    megatron_weight_plan,
    stream_with_plan,
)
from megatron_dflash.training.device_shim import causal_mask, megatron_target_on_cpu
from repo_paths import REPO_ROOT
from training_runs import run_training

VOCAB, LAYERS, HIDDEN, SEQ, BATCH = 300, 4, 32, 12, 2
TAPS = [0, 1, 2]
RTOL = 1e-5
YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 8, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 0.8}


def _tiny_moe_models(root: str) -> dict:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, moe_intermediate_size=24,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=256, rms_norm_eps=1e-6,
    )
    deepseek = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1,
        norm_topk_prob=True, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
    )
    configs = {
        "renormalised": Qwen3MoeConfig(**common, norm_topk_prob=True, mlp_only_layers=[0], tie_word_embeddings=False),
        "raw_topk": Qwen3MoeConfig(**common, norm_topk_prob=False, decoder_sparse_step=2, tie_word_embeddings=True),
        # DeepSeek-V3: MLA (q and kv LoRA, decoupled RoPE dims), a dense first layer, sigmoid routing with the
        # correction bias, 2 groups of which 1 is kept, routed scaling, a shared expert.
        "deepseek_v3": DeepseekV3Config(**deepseek),
    }
    # DeepSeek-V3 with YaRN as its checkpoints ship it, stretched past original_max_position_embeddings (8 < SEQ):
    # mscale != mscale_all_dim, so both the cos/sin factor and the softmax-scale correction differ from 1.
    configs["deepseek_v3_yarn"] = DeepseekV3Config(**{
        **deepseek, "qk_rope_head_dim": 8, "max_position_embeddings": 320, "rope_scaling": YARN})
    # rms_norm_eps 1e-5 (as Kimi K2 ships it): transformers builds the latent norms q_a_layernorm / kv_a_layernorm
    # with 1e-6 whatever rms_norm_eps says, the other norms with rms_norm_eps.
    configs["deepseek_v3_eps"] = DeepseekV3Config(**{**deepseek, "rms_norm_eps": 1e-5})
    classes = {name: DeepseekV3ForCausalLM for name in configs if name.startswith("deepseek_v3")}
    models = {}
    for seed, (name, config) in enumerate(configs.items()):
        torch.manual_seed(100 + seed)
        model = classes.get(name, Qwen3MoeForCausalLM)(config).eval()
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "norm" in pname:  # non-trivial norm weights, so a misplaced norm shows
                    p.add_(0.3 * torch.randn_like(p))
                if pname.endswith("mlp.gate.weight"):  # decisive routing: no near-ties in the top-k
                    p.copy_(torch.randn_like(p))
            for bname, b in model.named_buffers():
                if bname.endswith("e_score_correction_bias"):  # the bias must change the choice, not the weights
                    b.copy_(0.5 * torch.randn_like(b))
        path = os.path.join(root, name)
        model.save_pretrained(path, max_shard_size="40KB")
        models[name] = (model, path)
    return models


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> dict:
    return _tiny_moe_models(str(tmp_path_factory.mktemp("moe_targets")))


def _inputs():
    gen = torch.Generator().manual_seed(11)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)


@torch.no_grad()
def _hf_reference(model, ids) -> dict:
    out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    return {"logits": out.logits.float(), "hidden": [h.float() for h in out.hidden_states]}


# --------------------------------------------------------------------------------------------------
# Single process: config, plan, streaming
# --------------------------------------------------------------------------------------------------


def test_moe_spec_config_and_refusals(tiny_moe):
    _, path = tiny_moe["renormalised"]
    spec = hf_target_spec(path)
    assert spec.num_experts == 4 and spec.num_experts_per_tok == 2 and spec.norm_topk_prob
    assert spec.moe_layers == (False, True, True, True)
    assert hf_target_spec(tiny_moe["raw_topk"][1]).moe_layers == (False, True, False, True)
    cfg = megatron_target_config(path, expert_model_parallel_size=2)
    assert cfg.num_moe_experts == 4 and cfg.moe_router_topk == 2 and cfg.moe_ffn_hidden_size == 24
    assert not cfg.moe_router_pre_softmax and cfg.moe_layer_freq == [0, 1, 1, 1]
    assert cfg.moe_aux_loss_coeff == 0.0 and cfg.moe_expert_capacity_factor is None
    assert megatron_target_config(tiny_moe["raw_topk"][1]).moe_router_pre_softmax
    with pytest.raises(ValueError, match="expert_model_parallel_size=3 must divide num_experts=4"):
        megatron_target_config(path, expert_model_parallel_size=3)
    with pytest.raises(ValueError, match="expert_tensor_parallel_size=5 must divide moe_intermediate_size=24"):
        megatron_target_config(path, expert_tensor_parallel_size=5)
    with pytest.raises(ValueError, match="sequence_parallel=True needs tensor_model_parallel_size > 1"):
        megatron_target_config(path, sequence_parallel=True)
    with pytest.raises(ValueError, match="1 <= num_experts_per_tok <= num_experts"):
        hf_target_spec({**spec_dict(path), "num_experts_per_tok": 9})
    # DeepSeek-V3: MLA sizes, sigmoid group-limited routing, and what megatron-core cannot reproduce.
    ds_path = tiny_moe["deepseek_v3"][1]
    ds = hf_target_spec(ds_path)
    assert ds.mla and ds.kv_lora_rank == 16 and ds.q_lora_rank == 24 and ds.moe_layers == (False, True, True, True)
    assert ds.router_score == "sigmoid" and ds.expert_bias and ds.router_groups == 2 and ds.router_group_topk == 1
    cfg = megatron_target_config(ds_path, tensor_model_parallel_size=2)
    assert cfg.multi_latent_attention and cfg.moe_router_topk_scaling_factor == 2.5
    assert cfg.moe_shared_expert_intermediate_size == 16 and cfg.moe_router_enable_expert_bias
    base = spec_dict(ds_path)
    with pytest.raises(ValueError, match="agree only when num_experts_per_tok / topk_group == 2"):
        hf_target_spec({**base, "num_experts_per_tok": 4})
    # YaRN: transformers' fields map onto MLATransformerConfig's, the softmax correction included.
    yarn = megatron_target_config(tiny_moe["deepseek_v3_yarn"][1])
    assert (yarn.rope_type, yarn.rotary_scaling_factor, yarn.original_max_position_embeddings) == ("yarn", 40.0, 8)
    assert (yarn.beta_fast, yarn.beta_slow, yarn.mscale, yarn.mscale_all_dim) == (32, 1, 1.0, 0.8)
    assert megatron_target_config(ds_path).mscale_all_dim == 0.0  # plain RoPE: no softmax correction
    # Without mscale_all_dim transformers scales cos/sin by mscale(factor, 1) and leaves the softmax alone.
    plain_yarn = hf_target_spec({**base, "rope_scaling": {"type": "yarn", "factor": 4.0, "mscale": 0.5}}).rope_scaling
    assert (plain_yarn["mscale"], plain_yarn["mscale_all_dim"], plain_yarn["original_max_position_embeddings"]) == (
        1.0, 0.0, 256)
    for scaling, message in [
        ({"rope_type": "linear", "factor": 4.0}, "DeepSeek-V3 rope_scaling type 'linear' is not supported"),
        ({**YARN, "attention_factor": 1.2}, "explicit attention_factor=1.2"),
        ({**YARN, "mscale": 0}, "mscale_all_dim=0.8 but no mscale"),
        ({**YARN, "truncate": False}, "truncate=False"),
        ({**YARN, "factor": 0}, "needs a positive 'factor'"),
    ]:
        with pytest.raises(ValueError, match=message):
            hf_target_spec({**base, "rope_scaling": scaling})
    with pytest.raises(ValueError, match="rope_scaling type 'yarn' is not supported"):
        hf_target_spec({**spec_dict(path), "rope_scaling": YARN})  # YaRN on a GQA target
    with pytest.raises(ValueError, match="must divide kv_lora_rank \\+ qk_rope_head_dim=22"):
        megatron_target_config({**base, "kv_lora_rank": 18}, tensor_model_parallel_size=4, expert_tensor_parallel_size=1)


def spec_dict(path: str) -> dict:
    import json

    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def test_expert_parallel_shards_hold_only_their_experts(tiny_moe):
    _, path = tiny_moe["renormalised"]
    hf = load_hf_state_dict(path)
    shards = [convert_hf_to_megatron_state_dict(hf, path, 0, 1, ep_rank=r, ep_size=2) for r in range(2)]
    for rank, shard in enumerate(shards):
        experts = sorted({k.split("local_experts.")[1].split(".")[0] for k in shard if "local_experts" in k})
        assert experts == ["0", "1"], experts  # two local experts per EP rank, renumbered from 0
        for j in range(2):
            src = f"model.layers.2.mlp.experts.{2 * rank + j}."
            fc1 = shard[f"decoder.layers.2.mlp.experts.local_experts.{j}.linear_fc1.weight"]
            torch.testing.assert_close(fc1, torch.cat([hf[src + "gate_proj.weight"], hf[src + "up_proj.weight"]]))
        torch.testing.assert_close(shard["decoder.layers.1.mlp.router.weight"], hf["model.layers.1.mlp.gate.weight"])
        assert "decoder.layers.0.mlp.linear_fc1.weight" in shard  # the dense first layer
        assert "decoder.layers.0.mlp.router.weight" not in shard
    # Expert TP splits each expert's columns like a dense MLP.
    etp = [convert_hf_to_megatron_state_dict(hf, path, r, 2, ep_rank=0, ep_size=2, etp_rank=r, etp_size=2) for r in range(2)]
    down = torch.cat([s["decoder.layers.3.mlp.experts.local_experts.1.linear_fc2.weight"] for s in etp], dim=1)
    torch.testing.assert_close(down, hf["model.layers.3.mlp.experts.1.down_proj.weight"])


def test_streaming_reads_shard_by_shard_and_equals_the_dict_conversion(tiny_moe):
    _, path = tiny_moe["raw_topk"]
    files = target_safetensors_files(path)
    assert len(files) > 3, files  # the fixture is sharded
    spec = hf_target_spec(path)
    kwargs = dict(tp_rank=1, tp_size=2, layer_offset=2, num_layers=2, pre_process=False, post_process=True,
                  padded_vocab=512, ep_rank=1, ep_size=2)
    plan = megatron_weight_plan(spec, **kwargs)
    streamed = dict(stream_with_plan(plan, files, spec.model_type))
    reference = convert_hf_to_megatron_state_dict(
        load_hf_state_dict(path), path, 1, 2, layer_offset=2, num_layers=2, pre_process=False, ep_rank=1, ep_size=2
    )
    assert sorted(streamed) == sorted(reference)
    for name, tensor in reference.items():
        torch.testing.assert_close(streamed[name], tensor, rtol=0, atol=0)
    # A checkpoint missing the shard with layer 3's q_proj: the error names it, after the last file.
    key = "model.layers.3.self_attn.q_proj.weight"
    dropped = [f for f in files if key not in _keys(f)]
    with pytest.raises(KeyError, match="no tensor.*q_proj.*a qwen3_moe checkpoint was expected"):
        dict(stream_with_plan([w for w in plan if key in w.sources], dropped, spec.model_type))


def _keys(path: str) -> str:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return " ".join(f.keys())


# --------------------------------------------------------------------------------------------------
# 4 gloo ranks: parity with transformers
# --------------------------------------------------------------------------------------------------

# Expert TP defaults to TP (2 at TP=2 x EP=2: experts split over columns too); at TP=2 x PP=2 x EP=2 it must be 1
# to fit 4 ranks (megatron's expert grid is ETP x EP x PP). Every model runs at TP=2 x PP=2 x EP=2 with SP; the
# other layouts take one Qwen3-MoE and one DeepSeek-V3 model each, so each family is seen with SP off and on, and
# each model in at least two layouts.
ALL_MODELS = ("renormalised", "raw_topk", "deepseek_v3", "deepseek_v3_yarn", "deepseek_v3_eps")
LAYOUTS = [
    (dict(tp=2, pp=1, ep=2, etp=None, sp=False), ("renormalised", "deepseek_v3", "deepseek_v3_eps")),
    (dict(tp=2, pp=1, ep=2, etp=None, sp=True), ("raw_topk", "deepseek_v3_yarn")),
    (dict(tp=1, pp=2, ep=2, etp=None, sp=False), ("renormalised", "deepseek_v3_yarn")),
    (dict(tp=2, pp=2, ep=2, etp=1, sp=True), ALL_MODELS),
]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _gather_vocab(local: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(local) for _ in range(group.size())]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _on_ranks_moe(rank: int, world_size: int, cases: dict, layouts: list) -> list:
    from megatron_dflash.common.parallel import destroy_model_parallel, initialize_model_parallel
    from megatron_dflash.target.megatron.model import MegatronTarget
    from megatron_dflash.target.megatron.pipeline import run_target_pipeline

    reports = []
    for layout, names in layouts:
        initialize_model_parallel(
            tensor_model_parallel_size=layout["tp"], pipeline_model_parallel_size=layout["pp"],
            expert_model_parallel_size=layout["ep"], expert_tensor_parallel_size=layout["etp"],
        )
        try:
            with megatron_target_on_cpu():
                for name in names:
                    case = cases[name]
                    target = MegatronTarget.from_pretrained(case["path"], TAPS, use_cpu_initialization=True,
                                                            sequence_parallel=layout["sp"])
                    ids = case["ids"]
                    r = {"layout": layout, "model": name, "rank": rank,
                         "param_bytes": sum(p.numel() * p.element_size() for p in target.parameters())}
                    if layout["pp"] == 1:
                        out = target(ids, attention_mask=causal_mask(SEQ), return_logits=True)
                        taps, final_hidden = out.taps, out.final_hidden
                        logits = _gather_vocab(out.logits)
                    else:
                        out = run_target_pipeline(target, {"tokens": ids}, draft_stage=-1)
                        taps = None
                        if out is not None:
                            taps = dict(zip(TAPS, out.taps.split(HIDDEN, dim=-1)))
                            final_hidden = out.final_hidden
                            logits = _gather_vocab(target.output_head.local_logits(final_hidden))
                    if taps is not None:
                        r["taps"] = {i: _relative(t, case["hidden"][i + 1]) for i, t in taps.items()}
                        r["final_hidden"] = _relative(final_hidden, case["hidden"][-1])
                        r["logits"] = _relative(logits[..., :VOCAB], case["logits"])
                        r["padding_is_-inf"] = bool(torch.isneginf(logits[..., VOCAB:]).all())
                    reports.append(r)
        finally:
            destroy_model_parallel()
    return reports


def test_moe_target_matches_transformers_under_tp_ep_pp_sp(tiny_moe, tp_pool):
    ids = _inputs()
    cases = {}
    for name, (model, path) in tiny_moe.items():
        ref = _hf_reference(model, ids)
        cases[name] = {"path": path, "ids": ids, "logits": ref["logits"], "hidden": ref["hidden"]}
    results = tp_pool(4).run(_on_ranks_moe, cases, LAYOUTS, tp=None, timeout=240)
    checked = set()
    for reports in results:
        for r in reports:
            if "taps" not in r:
                continue  # a first pipeline stage: its taps were checked on the last stage
            where = f"{r['layout']} {r['model']} rank {r['rank']}: {r}"
            assert sorted(r["taps"]) == TAPS, where
            for key in ("logits", "final_hidden"):
                assert r[key] <= RTOL, f"{key} differs by {r[key]:.2e} (relative); {where}"
            assert max(r["taps"].values()) <= RTOL, where
            assert r["padding_is_-inf"], where
            checked.add((tuple(sorted(r["layout"].items())), r["model"]))
    assert len(checked) == sum(len(names) for _, names in LAYOUTS)
    worst = max(max(r["logits"], r["final_hidden"], *r["taps"].values()) for reports in results for r in reports if "taps" in r)
    print(f"MoE parity over {len(checked)} (layout, model) pairs: worst relative difference {worst:.2e}")


# --------------------------------------------------------------------------------------------------
# Training with a MoE target: megatron backend at TP=2 x PP=2 x EP=2 (SP on) == HF adapter
# --------------------------------------------------------------------------------------------------

TRAIN_ARGS = ["--data-format", "synthetic", "--no-progress-bar", "--log-interval", "1", "--seq-length", "48",
              "--synthetic-train-samples", "64", "--synthetic-valid-samples", "16", "--eval-iters", "1",
              "--dflash-anchors-per-sample", "4", "--lr", "2e-3", "--lr-warmup-iters", "1", "--train-iters", "3",
              "--micro-batch-size", "4", "--global-batch-size", "4", "--dflash-eval-prompts", "0",
              "--dflash-num-layers", "1"]


@pytest.fixture(scope="module")
def tiny_moe_targets(tmp_path_factory) -> dict:
    """Random tiny Qwen3-MoE and DeepSeek-V3 (YaRN) targets with the embedded job's tokenizer, dense first layers."""
    import math

    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from megatron_dflash.embedded_job import synthetic_corpus

    tokenizer = synthetic_corpus.build_tokenizer()
    common = dict(
        vocab_size=64 * math.ceil(len(tokenizer) / 64), hidden_size=64, intermediate_size=96,
        moe_intermediate_size=32, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=4,
        num_attention_heads=4, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    families = {
        "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig(
            **common, num_experts=4, mlp_only_layers=[0], max_position_embeddings=256, num_key_value_heads=2,
            head_dim=16, tie_word_embeddings=True)),
        "deepseek_v3": (DeepseekV3ForCausalLM, DeepseekV3Config(
            **common, n_routed_experts=4, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
            num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16, routed_scaling_factor=1.5, tie_word_embeddings=False,
            # YaRN as DeepSeek-V3 checkpoints ship it, used past original_max_position_embeddings (seq 48).
            rope_scaling={**YARN, "original_max_position_embeddings": 16}, max_position_embeddings=640)),
    }
    paths = {}
    for name, (cls, config) in families.items():
        torch.manual_seed(5)
        model = cls(config).eval()
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if pname.endswith("mlp.gate.weight"):
                    p.copy_(torch.randn_like(p))
        path = paths[name] = str(tmp_path_factory.mktemp(f"tiny_{name}_target"))
        model.save_pretrained(path, max_shard_size="200KB")
        tokenizer.save_pretrained(path)
    return paths


def _train_moe(rank, world_size, target, out_dir, *extra):
    argv = ["--target", target, "--dflash-export", os.path.join(out_dir, "hf"), *TRAIN_ARGS,
            "--target-backend", "megatron", *extra]
    torch.set_num_threads(1)
    result = run_training(argv)  # without CUDA the loop runs the megatron target under device_shim.megatron_target_on_cpu
    return result.losses, result.grad_norms


@pytest.fixture(scope="module")
def hf_target_runs(tiny_moe_targets, tmp_path_factory):
    """`hf_target_runs(family)` -> the training result of TRAIN_ARGS with the transformers target, run once."""
    results = {}

    def result(family: str):
        if family not in results:
            saved = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                export = str(tmp_path_factory.mktemp(f"hf_{family}") / "hf")
                results[family] = run_training(["--target", tiny_moe_targets[family], "--dflash-export", export,
                                                 *TRAIN_ARGS])
            finally:
                torch.set_num_threads(saved)
        return results[family]

    return result


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_training_with_a_megatron_moe_target_equals_the_hf_target(family, tiny_moe_targets, hf_target_runs, tmp_path,
                                                                  tp_pool):
    tiny_moe_target = tiny_moe_targets[family]
    reference = hf_target_runs(family)
    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
              "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1", "--sequence-parallel"]
    results = tp_pool(4).run(_train_moe, tiny_moe_target, str(tmp_path / "moe"), *layout, tp=None, timeout=300)
    assert all(r == results[0] for r in results), results
    losses, norms = results[0]
    assert len(losses) == len(reference.losses) == 3
    for a, b in zip(reference.losses, losses):
        assert abs(a - b) < 1e-5, (reference.losses, losses)
    for a, b in zip(reference.grad_norms, norms):
        assert abs(a - b) < 1e-4 * max(1.0, a), (reference.grad_norms, norms)


def test_torchrun_with_an_expert_parallel_target_on_cpu_ranks(tiny_moe_targets, hf_target_runs, tmp_path):
    """`torchrun --nproc-per-node 2 pretrain_dflash.py --target-backend megatron` with a DeepSeek-V3 target at
    TP=2 x EP=2 (expert TP 1) without CUDA: the losses (metrics.jsonl, every iteration) are the transformers
    target's."""
    import json
    import subprocess
    import sys

    pretrain = os.path.join(REPO_ROOT, "pretrain_dflash.py")
    argv = ["--target", tiny_moe_targets["deepseek_v3"], "--dflash-export", str(tmp_path / "hf"), *TRAIN_ARGS,
            "--run-dir", str(tmp_path), "--target-backend", "megatron", "--tensor-model-parallel-size", "2",
            "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"]
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           pretrain, *argv], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "(megatron); world 2 = TP 2 x PP 1 x DP 1;" in done.stdout and "device cpu" in done.stdout, done.stdout
    train = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in train if r["split"] == "train"]
    reference = hf_target_runs("deepseek_v3").losses
    assert [r["iteration"] for r in train] == [1, 2, 3]
    losses = [r["loss"] for r in train]
    print("torchrun TP=2 x EP=2 vs HF losses, max relative difference",
          max(abs(a - b) / abs(b) for a, b in zip(losses, reference)))
    assert losses == pytest.approx(reference, rel=1e-5, abs=0), (losses, reference)


def test_training_arguments_for_expert_and_sequence_parallelism(tiny_moe_targets, tmp_path):
    from megatron_dflash.training.arguments import ArgumentError, parse_args
    from megatron_dflash.training.job import prepare_job

    args = parse_args(["--target", tiny_moe_targets["deepseek_v3"], *TRAIN_ARGS, "--target-backend", "megatron",
                       "--pack-sequences"])
    with pytest.raises(ArgumentError, match="drop --pack-sequences"):
        prepare_job(args, world_size=1, env={}, cuda=False, log=lambda *a: None)
    tiny_moe_target = tiny_moe_targets["qwen3_moe"]
    from megatron_dflash.training.arguments import ArgumentError, parse_args
    from megatron_dflash.training.job import prepare_job

    def check(argv, world, message):
        args = parse_args(["--target", tiny_moe_target, *TRAIN_ARGS, *argv])
        with pytest.raises(ArgumentError, match=message):
            prepare_job(args, world_size=world, env={}, cuda=False, log=lambda *a: None)

    check(["--expert-model-parallel-size", "2"], 2, "use --target-backend megatron")
    check(["--sequence-parallel", "--target-backend", "megatron"], 1, "needs --tensor-model-parallel-size > 1")
    check(["--sequence-parallel", "--target-backend", "megatron", "--tensor-model-parallel-size", "5"], 5,
          "--seq-length 48 must be a multiple of --tensor-model-parallel-size 5")
    check(["--context-parallel-size", "2", "--target-backend", "megatron"], 2, "TEDotProductAttention")
    check(["--expert-model-parallel-size", "4", "--target-backend", "megatron", "--pipeline-model-parallel-size",
           "2"], 4, "not divisible by --expert-tensor-parallel-size 1 x --expert-model-parallel-size 4")
    check(["--expert-model-parallel-size", "3", "--target-backend", "megatron", "--global-batch-size", "12"], 3,
          "expert_model_parallel_size=3 must divide num_experts=4")
