"""The megatron target at TP=2, PP=2 and TP=3 against transformers, and its CPU shim.

Reference: transformers' own forward of tiny random Qwen3 / Llama models in fp32 (`tiny_targets`); the
converted megatron ``GPTModel`` must reproduce its logits and taps (``output_hidden_states[i + 1]``):

* one call on a pool of 2 gloo ranks at TP=2 (vocab-parallel logits gathered, padded columns -inf, custom
  position ids, a padding mask, the vocab-parallel embedding) and one at PP=2 x TP=1 (activations sent
  from stage 0 to stage 1 by hand; each stage captures the taps of the layers it owns under their global ids);
* a tied Llama with SmolLM2-135M's 9 heads / 3 KV heads on 3 ranks at TP=3 (logits and taps to fp32 rounding),
  and refused at TP=2 on each of 2 ranks with the sizes that would work, before any collective (no hang).

The HF references are computed here, in the test process; the ranks only import megatron.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from megatron_dflash.target.taps import concat_taps
from megatron_dflash.training.device_shim import causal_mask, megatron_target_on_cpu
from tiny_targets import ATOL, BATCH, LAYERS, SEQ, TAPS, VOCAB, count_calls, hf_reference, tiny_inputs, tiny_models


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    return tiny_models(str(tmp_path_factory.mktemp("targets")))


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


# --------------------------------------------------------------------------------------------------
# The megatron target on gloo ranks
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

    from megatron_dflash.target.megatron.model import MegatronTarget

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
            counts, handles = count_calls(layers + [target.model.decoder.final_layernorm])
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
    from megatron_dflash.target.megatron.model import MegatronTarget

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
    ids, positions, keep = tiny_inputs()
    cases = {}
    for name, (model, path) in tiny.items():
        ref = hf_reference(model, input_ids=ids)
        ref_pos = hf_reference(model, input_ids=ids, attention_mask=keep, position_ids=positions)
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


# --------------------------------------------------------------------------------------------------
# A target with 3 KV heads (SmolLM2's 9 / 3 heads): TP=3 matches transformers, TP=2 is refused
# --------------------------------------------------------------------------------------------------

_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
                "broadcast_object_list", "barrier", "reduce_scatter_tensor", "all_to_all_single", "send", "recv")


def _save_three_kv_heads(root: str):
    """A tiny random tied Llama with SmolLM2-135M's head layout (9 heads, 3 KV heads), norm weights perturbed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=36, intermediate_size=48, num_hidden_layers=LAYERS,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=8, max_position_embeddings=256,
                         rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=10000.0)
    torch.manual_seed(11)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.add_(0.3 * torch.randn_like(p))
    path = f"{root}/llama_3kv"
    model.save_pretrained(path)
    return model, path


@contextlib.contextmanager
def _counted_collectives():
    """The names of the torch.distributed collectives this rank enters inside the block, in order."""
    import torch.distributed as dist

    entered, saved = [], {name: getattr(dist, name) for name in _COLLECTIVES}

    def counting(name):
        def call(*args, **kwargs):
            entered.append(name)
            return saved[name](*args, **kwargs)
        return call

    for name in _COLLECTIVES:
        setattr(dist, name, counting(name))
    try:
        yield entered
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _on_ranks_tp3(rank: int, world_size: int, case: dict) -> dict:
    from megatron_dflash.target.megatron.model import MegatronTarget

    with megatron_target_on_cpu():
        target = MegatronTarget.from_pretrained(case["path"], TAPS, use_cpu_initialization=True)
        with _counted_collectives() as entered:  # the count sees megatron's own collectives
            out = target(case["ids"], attention_mask=case["keep"], position_ids=case["positions"], return_logits=True)
        valid = case["keep"].bool()
        logits = _gather_vocab(out.logits)
        return {
            "local_vocab": out.logits.shape[-1],
            "padding_is_-inf": bool(torch.isneginf(logits[..., VOCAB:]).all()),
            "logits": _maxdiff(logits[..., :VOCAB][valid], case["logits"][valid]),
            "final_hidden": _maxdiff(out.final_hidden[valid], case["hidden"][-1][valid]),
            "taps": max(_maxdiff(out.taps[i][valid], case["hidden"][i + 1][valid]) for i in TAPS),
            "tap_ids": sorted(out.taps),
            "forward_collectives": len(entered),
        }


def _on_ranks_refused(rank: int, world_size: int, path: str) -> dict:
    """Build the target at TP = world size; the collectives this rank entered before the error; the group after."""
    import torch.distributed as dist

    from megatron_dflash.target.megatron.model import MegatronTarget

    error = "no error"
    with _counted_collectives() as entered:
        try:
            with megatron_target_on_cpu():
                MegatronTarget.from_pretrained(path, TAPS, use_cpu_initialization=True)
        except ValueError as err:
            error = str(err)
    together = torch.ones(1)
    dist.all_reduce(together)  # every rank is still here, the group in step
    return {"error": error, "collectives": entered, "together": float(together)}


def test_three_kv_heads_run_at_tp3_as_in_transformers_and_tp2_is_refused_on_every_rank(tmp_path, tp_pool):
    model, path = _save_three_kv_heads(str(tmp_path))
    ids, positions, keep = tiny_inputs()
    ref = hf_reference(model, input_ids=ids, attention_mask=keep, position_ids=positions)
    case = {"path": path, "ids": ids, "keep": keep, "positions": positions, "logits": ref["logits"],
            "hidden": ref["hidden"]}
    for rank, r in enumerate(tp_pool(3).run(_on_ranks_tp3, case, tp=3)):
        assert r["local_vocab"] == 128 and r["padding_is_-inf"] and r["tap_ids"] == TAPS, (rank, r)
        assert r["forward_collectives"] > 0, (rank, r)
        for key in ("logits", "final_hidden", "taps"):
            assert r[key] < ATOL, f"rank {rank}: {key} differs by {r[key]:.2e}; {r}"
    refused = ("megatron target: tensor_model_parallel_size=2 must divide num_key_value_heads=3 (this converter "
               "splits whole query groups, experts and MLP columns across ranks); use tensor_model_parallel_size "
               "1 or 3.")
    for rank, r in enumerate(tp_pool(2).run(_on_ranks_refused, path, tp=2, timeout=60)):
        assert r == {"error": refused, "collectives": [], "together": 2.0}, (rank, r)
