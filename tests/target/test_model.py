"""The frozen target: HF tap capture, the HF -> megatron converter, and the megatron target at TP=2 and PP=2.

Reference everywhere: transformers' own forward of a tiny random model, in fp32. The tap of layer ``i`` must
equal ``output_hidden_states[i + 1]`` (docs/design.md §2 Conventions), and the converted megatron ``GPTModel`` must
reproduce transformers' logits:

* Qwen3 (tied embeddings, q/k norms, head_dim != hidden / heads), Llama (untied, llama3 RoPE scaling) and
  Llama (tied, linear RoPE scaling);
* one call on a pool of 2 gloo ranks at TP=2 (vocab-parallel logits gathered, padded columns -inf, custom
  position ids, a padding mask, the vocab-parallel embedding) and one at PP=2 x TP=1 (activations sent
  from stage 0 to stage 1 by hand; each stage captures the taps of the layers it owns under their global ids).

The HF references are computed here, in the test process; the ranks only import megatron.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_dflash.draft.config import DFlashConfig
from megatron_dflash.target.model import (
    HFTarget,
    concat_taps,
    convert_hf_to_megatron_state_dict,
    fused_qkv_weight,
    hf_target_spec,
    megatron_target_config,
    padded_vocab_size,
    taps_from_hidden_states,
)
from megatron_dflash.training.device_shim import causal_mask, megatron_target_on_cpu

VOCAB, LAYERS, SEQ, BATCH = 300, 4, 12, 2
ATOL = 1e-4
TAPS = [0, 2]


def _tiny_models(root: str) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
    )
    configs = {
        # head_dim 16 * 4 heads != hidden 32: megatron's kv_channels must follow head_dim.
        "qwen3": (Qwen3ForCausalLM, Qwen3Config(**common, head_dim=16, tie_word_embeddings=True, rope_theta=10000.0)),
        "llama": (
            LlamaForCausalLM,
            LlamaConfig(
                **common, tie_word_embeddings=False,
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
            ),
        ),
        # Tied Llama with linear RoPE scaling (megatron's seq_len_interpolation_factor).
        "llama_linear": (
            LlamaForCausalLM,
            LlamaConfig(**common, tie_word_embeddings=True, rope_theta=500.0, rope_scaling={"rope_type": "linear", "factor": 4.0}),
        ),
    }
    models = {}
    for seed, (name, (cls, config)) in enumerate(configs.items()):
        torch.manual_seed(seed)
        model = cls(config).eval()
        with torch.no_grad():  # non-trivial norm weights, so a misplaced norm shows
            for pname, p in model.named_parameters():
                if "norm" in pname:
                    p.add_(0.3 * torch.randn_like(p))
        path = os.path.join(root, name)
        model.save_pretrained(path)
        models[name] = (model, path)
    return models


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    return _tiny_models(str(tmp_path_factory.mktemp("targets")))


def _inputs():
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    positions = torch.arange(SEQ)[None].repeat(BATCH, 1) + torch.tensor([[3], [90]])  # llama3 scaling matters
    keep = torch.ones(BATCH, SEQ, dtype=torch.long)
    keep[1, -4:] = 0  # right padding on row 1
    return ids, positions, keep


@torch.no_grad()
def _hf_reference(model, **kwargs) -> dict:
    out = model(**kwargs, output_hidden_states=True, use_cache=False)
    return {"logits": out.logits.float(), "hidden": [h.float() for h in out.hidden_states]}


# --------------------------------------------------------------------------------------------------
# (a) HFTarget, single process
# --------------------------------------------------------------------------------------------------


def test_hf_target_taps_are_hidden_states_i_plus_1(tiny):
    ids, positions, keep = _inputs()
    for name, (model, _) in tiny.items():
        ref = _hf_reference(model, input_ids=ids)
        target = HFTarget(model, TAPS)
        out = target(ids, return_logits=True)
        assert out.taps.shape == (BATCH, SEQ, len(TAPS) * 32)
        torch.testing.assert_close(out.taps, torch.cat([ref["hidden"][i + 1] for i in TAPS], -1), rtol=0, atol=0)
        torch.testing.assert_close(out.taps, taps_from_hidden_states(ref["hidden"], TAPS), rtol=0, atol=0)
        torch.testing.assert_close(out.final_hidden, ref["hidden"][-1], rtol=0, atol=0)
        torch.testing.assert_close(out.logits, ref["logits"], rtol=0, atol=1e-6)
        assert target(ids).logits is None
        # Order follows target_layer_ids; masks and positions reach the model.
        rev = HFTarget(model, TAPS[::-1])(ids, attention_mask=keep, position_ids=positions)
        ref2 = _hf_reference(model, input_ids=ids, attention_mask=keep, position_ids=positions)
        torch.testing.assert_close(rev.taps, torch.cat([ref2["hidden"][i + 1] for i in TAPS[::-1]], -1), rtol=0, atol=0)


def _count_calls(modules) -> tuple[list, list]:
    """Forward pre-hooks that count the calls of ``modules``; returns (counts, handles)."""
    counts = [0] * len(modules)

    def hook(index):
        def count(module, args):
            counts[index] += 1
        return count

    return counts, [m.register_forward_pre_hook(hook(i)) for i, m in enumerate(modules)]


def test_hf_target_without_final_hidden_stops_after_the_last_tap(tiny):
    """Training without a distillation loss reads only the taps: the layers after the last tapped one and the
    final norm never run, and the taps are those of the full forward, bit for bit."""
    ids, positions, keep = _inputs()
    for name, (model, _) in tiny.items():
        target = HFTarget(model, TAPS)
        full = target(ids, attention_mask=keep, position_ids=positions)
        layers = list(model.model.layers)
        counts, handles = _count_calls(layers + [model.model.norm])
        try:
            short = target(ids, attention_mask=keep, position_ids=positions, need_final_hidden=False)
        finally:
            for handle in handles:
                handle.remove()
        assert counts == [1] * (max(TAPS) + 1) + [0] * (LAYERS - max(TAPS) - 1) + [0], (name, counts)
        assert short.final_hidden is None and short.logits is None
        torch.testing.assert_close(short.taps, full.taps, rtol=0, atol=0)
        # The hooks are disarmed afterwards: a full forward runs every layer again.
        torch.testing.assert_close(target(ids).final_hidden, _hf_reference(model, input_ids=ids)["hidden"][-1],
                                   rtol=0, atol=0)
        with pytest.raises(ValueError, match="need_final_hidden=True"):
            target(ids, return_logits=True, need_final_hidden=False)


def test_hf_target_is_frozen_and_exposes_embedding_and_head(tiny):
    model, _ = tiny["qwen3"]
    target = HFTarget(model, TAPS, output_multiplier=0.5, final_logit_softcapping=3.0)
    target.train()
    assert not target.training and not model.training
    assert not any(p.requires_grad for p in target.parameters())
    assert target.embedding is model.get_input_embeddings()
    assert target.output_head.layer is model.get_output_embeddings()
    ids, _, _ = _inputs()
    out = target(ids, return_logits=True)
    assert not out.taps.requires_grad
    raw = _hf_reference(model, input_ids=ids)["logits"]
    torch.testing.assert_close(out.logits, torch.tanh(raw * 0.5 / 3.0) * 3.0, rtol=0, atol=1e-6)
    # The taps feed an autograd graph (no inference-mode tensors).
    fc = torch.nn.Linear(out.taps.shape[-1], 4)
    fc(out.taps).sum().backward()
    model.train()  # leave the shared fixture in eval mode regardless
    model.eval()


def test_hf_target_refuses_bad_layers_and_mismatched_config(tiny):
    model, _ = tiny["llama"]
    with pytest.raises(ValueError, match="last layer 3"):
        HFTarget(model, [0, LAYERS - 1])
    with pytest.raises(ValueError, match="duplicates"):
        HFTarget(model, [1, 1])
    with pytest.raises(ValueError, match="outside"):
        HFTarget(model, [7])
    cfg = DFlashConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
                       num_hidden_layers=2, vocab_size=VOCAB, mask_token_id=5, num_target_layers=LAYERS, target_layer_ids=[0, 1])
    assert HFTarget.from_config(model, cfg).target_layer_ids == [0, 1]
    bad = DFlashConfig(**{**cfg.__dict__, "num_target_layers": 6, "target_layer_ids": [0, 1], "extra_hf_fields": {}})
    with pytest.raises(ValueError, match="num_target_layers=6"):
        HFTarget.from_config(model, bad)


# --------------------------------------------------------------------------------------------------
# Converter pieces (no megatron model needed)
# --------------------------------------------------------------------------------------------------


def test_fused_qkv_layout_is_megatrons_per_group_interleave():
    groups, q_per_group, hd, hidden = 2, 3, 4, 5
    q = torch.randn(groups * q_per_group * hd, hidden)
    k = torch.randn(groups * hd, hidden)
    v = torch.randn(groups * hd, hidden)
    fused = fused_qkv_weight(q, k, v, groups, hd).view(groups, (q_per_group + 2) * hd, hidden)
    # What SelfAttention.get_query_key_value_tensors does with [.., ng, (np/ng + 2) * hn]:
    q2, k2, v2 = torch.split(fused, [q_per_group * hd, hd, hd], dim=1)
    torch.testing.assert_close(q2.reshape(-1, hidden), q)
    torch.testing.assert_close(k2.reshape(-1, hidden), k)
    torch.testing.assert_close(v2.reshape(-1, hidden), v)


def test_converter_shards_and_tied_output_layer(tiny):
    from safetensors.torch import load_file

    _, path = tiny["qwen3"]
    hf = load_file(os.path.join(path, "model.safetensors"))
    spec = hf_target_spec(path)
    padded = padded_vocab_size(VOCAB, 2)
    assert padded == 512
    shards = [convert_hf_to_megatron_state_dict(hf, path, r, 2) for r in range(2)]
    assert "output_layer.weight" not in shards[0]  # tied, same stage as the embedding
    emb = torch.cat([s["embedding.word_embeddings.weight"] for s in shards])
    assert emb.shape == (padded, 32)
    torch.testing.assert_close(emb[:VOCAB], hf["model.embed_tokens.weight"])
    assert emb[VOCAB:].abs().sum() == 0
    fc1 = [s["decoder.layers.1.mlp.linear_fc1.weight"] for s in shards]
    gate = torch.cat([f[:24] for f in fc1])
    up = torch.cat([f[24:] for f in fc1])
    torch.testing.assert_close(gate, hf["model.layers.1.mlp.gate_proj.weight"])
    torch.testing.assert_close(up, hf["model.layers.1.mlp.up_proj.weight"])
    proj = torch.cat([s["decoder.layers.1.self_attention.linear_proj.weight"] for s in shards], dim=1)
    torch.testing.assert_close(proj, hf["model.layers.1.self_attn.o_proj.weight"])
    # A last stage without the embedding gets its own copy of the tied weight; layers are renumbered.
    last = convert_hf_to_megatron_state_dict(hf, path, 1, 2, layer_offset=2, num_layers=2, pre_process=False)
    assert "embedding.word_embeddings.weight" not in last
    torch.testing.assert_close(last["output_layer.weight"], shards[1]["embedding.word_embeddings.weight"])
    torch.testing.assert_close(last["decoder.layers.0.input_layernorm.weight"], hf["model.layers.2.input_layernorm.weight"])
    assert not any(k.startswith("decoder.layers.2") for k in last)
    assert spec.qk_layernorm and spec.tie_word_embeddings and spec.head_dim == 16


def test_megatron_config_matches_and_refuses(tiny):
    _, path = tiny["qwen3"]
    cfg = megatron_target_config(path, tensor_model_parallel_size=2)
    assert (cfg.num_layers, cfg.hidden_size, cfg.kv_channels, cfg.num_query_groups) == (LAYERS, 32, 16, 2)
    assert cfg.qk_layernorm and cfg.gated_linear_unit and cfg.normalization == "RMSNorm"
    assert cfg.hidden_dropout == 0.0 and cfg.attention_dropout == 0.0
    base = _config_dict(path)
    with pytest.raises(ValueError, match="must divide num_key_value_heads=2"):
        megatron_target_config(base, tensor_model_parallel_size=4)
    with pytest.raises(ValueError, match="model_type='mistral'"):
        hf_target_spec({**base, "model_type": "mistral"})
    with pytest.raises(ValueError, match="sliding-window"):
        hf_target_spec({**base, "use_sliding_window": True})
    with pytest.raises(ValueError, match="'yarn' is not supported"):
        hf_target_spec({**base, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}})
    with pytest.raises(ValueError, match="attention_bias"):
        hf_target_spec({**base, "attention_bias": True})


def _config_dict(path: str) -> dict:
    import json

    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def _megatron_cpu_patch_points() -> dict:
    """What `device_shim.megatron_target_on_cpu` replaces, as it is now ("absent": the name is not defined)."""
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.tensor_parallel import mappings
    from megatron.core.tensor_parallel import random as mp_random
    from megatron.core.transformer import multi_latent_attention as mla
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as alltoall

    return {"current_device": torch.cuda.current_device, "embd_group": LanguageModule._is_in_embd_group,
            "dtoh": alltoall._maybe_dtoh_and_synchronize, "stream": alltoall.cuda_dtoh_stream,
            "gather": mappings._gather_along_first_dim, "scatter": mappings._reduce_scatter_along_first_dim,
            "mla_te": mla.HAVE_TE, "gemm": getattr(moe_utils, "te_general_gemm", "absent"),
            "fork": vars(mp_random.get_cuda_rng_tracker()).get("fork", "absent")}


def test_megatron_target_cpu_patches_apply_only_inside_a_cpu_run(monkeypatch):
    """Importing the package patches nothing; `train` enters the target's CPU shim only for a megatron
    target without CUDA, and everything is restored afterwards."""
    from types import SimpleNamespace

    from megatron.core.tensor_parallel import mappings

    import megatron_dflash.training.loop as loop

    outside = _megatron_cpu_patch_points()
    # as megatron defines them: nothing imported so far replaced them
    assert outside["current_device"].__module__ == "torch.cuda"
    assert outside["embd_group"].__qualname__ == "LanguageModule._is_in_embd_group"
    assert outside["gather"].__module__ == mappings.__name__
    seen = []
    monkeypatch.setattr(loop, "_train", lambda job, hooks, env: seen.append(_megatron_cpu_patch_points()))
    for backend, cuda in [("megatron", True), ("hf", False), ("megatron", False)]:
        loop.train(SimpleNamespace(args=SimpleNamespace(target_backend=backend, use_cuda=cuda)))
    on_cuda, hf, cpu = seen
    assert on_cuda == outside and hf == outside
    assert all(cpu[name] is not outside[name] for name in ("current_device", "embd_group", "dtoh", "stream",
                                                             "gather", "scatter", "fork"))
    assert cpu["gemm"] is None or cpu["gemm"] is outside["gemm"]  # defined (as None) only where TE does not
    assert cpu["current_device"]() == "cpu" and cpu["mla_te"] is False
    assert _megatron_cpu_patch_points() == outside


def test_concat_taps_names_missing_layers():
    taps = {2: torch.zeros(1, 3, 4), 0: torch.ones(1, 3, 4)}
    assert concat_taps(taps, [0, 2])[..., 0].eq(1).all()
    with pytest.raises(ValueError, match=r"\[5\] are missing"):
        concat_taps(taps, [0, 5])


# --------------------------------------------------------------------------------------------------
# (b) megatron target on gloo ranks
# --------------------------------------------------------------------------------------------------


def _gather_vocab(local: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(local) for _ in range(group.size())]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def _on_ranks_tp(rank: int, world_size: int, cases: dict) -> dict:
    from megatron.core import parallel_state

    from megatron_dflash.target.model import MegatronTarget

    assert parallel_state.get_tensor_model_parallel_world_size() == 2
    report = {}
    with megatron_target_on_cpu():
        for name, case in cases.items():
            # CPU weights also where CUDA exists: the ranks compute on the CPU.
            target = MegatronTarget.from_pretrained(case["path"], TAPS, use_cpu_initialization=True)
            target.train()
            ids, mask = case["ids"], causal_mask(SEQ)
            out = target(ids, attention_mask=mask, return_logits=True)
            logits = _gather_vocab(out.logits)
            r = report[name] = {}
            r["frozen"] = not target.training and not any(p.requires_grad for p in target.parameters())
            r["local_vocab"] = out.logits.shape[-1]
            r["padding_is_-inf"] = bool(torch.isneginf(logits[..., VOCAB:]).all())
            r["logits"] = _maxdiff(logits[..., :VOCAB], case["logits"])
            r["final_hidden"] = _maxdiff(out.final_hidden, case["hidden"][-1])
            r["tap_ids"] = sorted(out.taps)
            r["tap_layouts"] = [tuple(t.shape) for t in out.taps.values()]
            r["taps"] = max(_maxdiff(out.taps[i], case["hidden"][i + 1]) for i in TAPS)
            r["concat"] = _maxdiff(concat_taps(out.taps, TAPS), torch.cat([case["hidden"][i + 1] for i in TAPS], -1))
            # Per-row positions (RoPE) and a [B, S] padding mask, against HF with the same inputs.
            out = target(ids, attention_mask=case["keep"], position_ids=case["positions"], return_logits=True)
            valid = case["keep"].bool()
            logits = _gather_vocab(out.logits)[..., :VOCAB]
            r["positions_and_padding"] = _maxdiff(logits[valid], case["logits_pos"][valid])
            r["positions_taps"] = max(_maxdiff(out.taps[i][valid], case["hidden_pos"][i + 1][valid]) for i in TAPS)
            # Taps only: the forward stops after the last tapped layer (no final norm, no output tensor).
            layers = list(target.model.decoder.layers)
            counts, handles = _count_calls(layers + [target.model.decoder.final_layernorm])
            try:
                short = target(ids, attention_mask=mask, need_final_hidden=False)
            finally:
                for handle in handles:
                    handle.remove()
            r["short_calls"] = counts
            r["short_empty"] = short.final_hidden is None and short.output_tensor is None and short.logits is None
            r["short_taps"] = max(_maxdiff(short.taps[i], case["hidden"][i + 1]) for i in TAPS)
            # The vocab-parallel embedding looks up full rows (its own all-reduce).
            r["embedding"] = _maxdiff(target.embedding(ids), case["hidden"][0])
            r["head_weight_tied"] = target.output_head.weight is not None
    return report


def _on_ranks_pp(rank: int, world_size: int, case: dict) -> dict:
    import torch.distributed as dist

    from megatron_dflash.common.parallel import destroy_model_parallel, initialize_model_parallel
    from megatron_dflash.target.model import MegatronTarget

    initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    try:
        with megatron_target_on_cpu():
            target = MegatronTarget.from_pretrained(case["path"], [1, 2], use_cpu_initialization=True)
            ids = case["ids"]
            mask = causal_mask(SEQ)
            r = {
                "layers": target.layer_ids,
                "has_embedding": target.embedding is not None,
                "has_head": target.output_head is not None,
            }
            if rank == 0:
                out = target(ids, attention_mask=mask)
                dist.send(out.output_tensor.contiguous(), dst=1)
                r["output_tensor"] = tuple(out.output_tensor.shape)
            else:
                buffer = torch.empty(SEQ, BATCH, 32)
                dist.recv(buffer, src=0)
                out = target(None, attention_mask=mask, input_tensor=buffer, return_logits=True)
                r["logits"] = _maxdiff(out.logits[..., :VOCAB], case["logits"])
                r["padding_is_-inf"] = bool(torch.isneginf(out.logits[..., VOCAB:]).all())
            r["taps"] = {i: _maxdiff(t, case["hidden"][i + 1]) for i, t in out.taps.items()}
    finally:
        destroy_model_parallel()
    return r


def test_megatron_target_tp2_and_pp2_match_transformers(tiny, tp_pool):
    ids, positions, keep = _inputs()
    cases = {}
    for name, (model, path) in tiny.items():
        ref = _hf_reference(model, input_ids=ids)
        ref_pos = _hf_reference(model, input_ids=ids, attention_mask=keep, position_ids=positions)
        cases[name] = {
            "path": path, "ids": ids, "keep": keep, "positions": positions,
            "logits": ref["logits"], "hidden": ref["hidden"],
            "logits_pos": ref_pos["logits"], "hidden_pos": ref_pos["hidden"],
        }
    pool = tp_pool(2)
    reports = pool.run(_on_ranks_tp, cases, tp=2)
    for rank, report in enumerate(reports):
        for name, r in report.items():
            where = f"rank {rank} {name}: {r}"
            assert r["frozen"] and r["padding_is_-inf"] and r["local_vocab"] == 256, where
            assert r["tap_ids"] == TAPS and all(s == (BATCH, SEQ, 32) for s in r["tap_layouts"]), where
            assert r["short_calls"] == [1] * (max(TAPS) + 1) + [0] * (LAYERS - max(TAPS) - 1) + [0], where
            assert r["short_empty"], where
            for key in ("logits", "final_hidden", "taps", "concat", "positions_and_padding", "positions_taps", "embedding",
                        "short_taps"):
                assert r[key] < ATOL, f"{key} differs by {r[key]:.2e}; {where}"
            assert r["head_weight_tied"] == (name != "llama"), where

    # PP=2 x TP=1, tied Qwen3: stage 0 owns layers 0-1 (tap 1), stage 1 layers 2-3 (tap 2) and the head.
    stage0, stage1 = pool.run(_on_ranks_pp, cases["qwen3"], tp=None)
    assert stage0["layers"] == [0, 1] and stage1["layers"] == [2, 3], (stage0, stage1)
    assert stage0["has_embedding"] and not stage0["has_head"], stage0
    assert stage1["has_head"] and not stage1["has_embedding"], stage1
    assert stage0["output_tensor"] == (SEQ, BATCH, 32)
    assert list(stage0["taps"]) == [1] and list(stage1["taps"]) == [2], (stage0, stage1)
    assert stage0["taps"][1] < ATOL and stage1["taps"][2] < ATOL and stage1["logits"] < ATOL, (stage0, stage1)
    assert stage1["padding_is_-inf"], stage1
    print("TP=2:", {n: {k: v for k, v in r.items() if isinstance(v, float)} for n, r in reports[0].items()})
    print("PP=2:", stage0["taps"], stage1["taps"], stage1["logits"])
