"""The target pipeline at TP=2 x PP=2 (4 gloo ranks) against one process at TP=1 x PP=1.

A tiny HF Qwen3 target (4 layers, hidden 32, tied embeddings) is tapped at layers [2, 0, 1] (stage 0 owns
layers 0-1, stage 1 layers 2-3, so both stages produce taps and the body's order is not the layer order).
With the draft on the last stage (``--dflash-pipeline-stage -1``) and on stage 0, the taps routed by
`run_target_pipeline`, the frozen embedding / output-layer copies of `copy_frozen_target_heads` and a
TP=2 draft body must give the same hard loss, the same distillation (KL) loss against the routed
``final_hidden``, the same weight sum and the same body gradients (TP shards gathered) as the reference:
`HFTarget` + a TP=1 body in the test process.

One pool call also checks: the copies of an untied target (output layer sent from the last stage), the
errors (a draft stage out of range: the same error on every rank; ranks disagreeing on the draft stage or
the batch shape; context parallelism), and that the group is still in sync after them.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_dflash.draft.body import DFlashBody
from megatron_dflash.checkpoint.hf import hf_state_dict, load_hf_state_dict_into
from megatron_dflash.draft.config import DFlashConfig
from megatron_dflash.plan.data_hook import attach_dflash_plan
from megatron_dflash.objectives.dflash_loss import dflash_loss, embed_blocks
from megatron_dflash.common.parallel import SingleRankGroup
from megatron_dflash.target.megatron.pipeline import DraftStagePlacement, resolve_draft_stage
from megatron_dflash.target.taps import HFTarget
from megatron_dflash.training.device_shim import megatron_target_on_cpu

VOCAB, LAYERS, HIDDEN, BATCH, SEQ = 300, 4, 32, 2, 16
TAPS = [2, 0, 1]
TOL = dict(rtol=1e-5, atol=1e-5)
LOSS_ARGS = dict(decay_gamma=2.0, chunk_slots=7)
KL_ARGS = dict(decay_gamma=2.0, chunk_slots=7, soft_target="kl", temperature=2.0)


def _draft_config() -> DFlashConfig:
    return DFlashConfig(
        hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=VOCAB, mask_token_id=7, block_size=4, num_target_layers=LAYERS,
        target_layer_ids=TAPS, max_position_embeddings=256, rope_theta=10000.0,
        # A non-trivial output transform: the last stage must hand it to the head's copy.
        output_multiplier=0.75, final_logit_softcapping=20.0,
    )


def _save_target(root: str, name: str, tied: bool, seed: int) -> tuple:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        rms_norm_eps=1e-6, tie_word_embeddings=tied, rope_theta=10000.0,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # non-trivial norm weights
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.add_(0.3 * torch.randn_like(p))
    path = os.path.join(root, name)
    model.save_pretrained(path)
    return model, path


def _batch() -> dict:
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    loss_mask = torch.ones(BATCH, SEQ, dtype=torch.bool)
    loss_mask[0, :4] = False
    batch = {
        "tokens": tokens,
        "loss_mask": loss_mask,
        "position_ids": torch.arange(SEQ)[None].repeat(BATCH, 1),
        "document_ids": torch.zeros(BATCH, SEQ, dtype=torch.int64),
        "sample_ids": torch.tensor([11, 12]),
    }
    return attach_dflash_plan(batch, optimizer_step=3, seed=5, anchors_per_sample=3, block_size=4)


def _body_state(cfg: DFlashConfig) -> dict:
    torch.manual_seed(0)
    body = DFlashBody(cfg, tp_group=SingleRankGroup())
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-trivial norms; a larger fc so the taps matter
        for name, p in body.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name == "fc.weight":
                p.mul_(10.0)
    return {k: v.clone() for k, v in hf_state_dict(body).items()}


def _reference(model, cfg: DFlashConfig, state: dict, batch: dict) -> dict:
    """TP=1 x PP=1: HFTarget, TP=1 body, hard + KL loss, body gradients."""
    target = HFTarget.from_config(model, cfg)
    body = DFlashBody(cfg, tp_group=SingleRankGroup())
    load_hf_state_dict_into(body, state)
    plan, tokens = batch["dflash_plan"], batch["tokens"]
    out = target(tokens, position_ids=batch["position_ids"])
    with torch.no_grad():
        blocks = embed_blocks(tokens, plan, target.embedding, mask_token_id=cfg.mask_token_id)
    hidden = body(out.taps, blocks, plan)
    hard = dflash_loss(hidden, plan, tokens, target.output_head, **LOSS_ARGS)
    soft = dflash_loss(hidden, plan, tokens, target.output_head, teacher_hidden=out.final_hidden, **KL_ARGS)
    (hard.loss_sum + soft.loss_sum).backward()
    return {
        "taps": out.taps, "final_hidden": out.final_hidden,
        "hard": hard.loss_sum.detach(), "soft": soft.loss_sum.detach(), "weight_sum": hard.weight_sum,
        "grads": {n: p.grad.clone() for n, p in body.named_parameters()},
    }


# --------------------------------------------------------------------------------------------------
# On the 4 ranks
# --------------------------------------------------------------------------------------------------


def _error_of(fn) -> str:
    try:
        fn()
    except ValueError as err:
        return str(err)
    return "no error"


def _gathered_grads(body) -> dict:
    import torch.distributed as dist

    from megatron_dflash.draft.sharding import _partition_dims

    dims = _partition_dims(body)
    group = body.tp_group
    grads = {}
    for name, p in body.named_parameters():
        grad = p.grad.contiguous()
        if dims[name] is not None:
            parts = [torch.empty_like(grad) for _ in range(group.size())]
            dist.all_gather(parts, grad, group=group)
            grad = torch.cat(parts, dim=dims[name])
        grads[name] = grad
    return grads


def _on_ranks_pipeline(rank: int, world_size: int, case: dict) -> dict:
    from megatron.core import parallel_state

    from megatron_dflash.common.parallel import destroy_model_parallel, initialize_model_parallel
    from megatron_dflash.target.megatron.model import MegatronTarget
    from megatron_dflash.target.megatron.pipeline import copy_frozen_target_heads, run_target_pipeline

    cfg, batch = case["cfg"], case["batch"]
    plan, tokens = batch["dflash_plan"], batch["tokens"]
    initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    try:
        stage = parallel_state.get_pipeline_model_parallel_rank()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        report = {"stage": stage, "tp_rank": tp_rank, "runs": {}}
        with megatron_target_on_cpu():
            target = MegatronTarget.from_pretrained(case["tied"], config=cfg, use_cpu_initialization=True)
            for arg in (-1, 0):
                placement = resolve_draft_stage(arg, 2)
                embedding, head = copy_frozen_target_heads(target, placement)
                # Default attention mask: causal, built explicitly on CPU.
                out = run_target_pipeline(target, batch, draft_stage=placement, need_final_hidden=True)
                r = report["runs"][arg] = {"holds": placement.holds_draft(), "got": out is not None,
                                           "copies": (embedding is not None, head is not None)}
                if out is None:
                    continue
                r["own_embedding"] = embedding is target.embedding
                r["own_head"] = head is target.output_head
                r["head_meta"] = (head.output_multiplier, head.final_logit_softcapping)
                r["frozen"] = not any(p.requires_grad for p in embedding.parameters()) and not head.requires_grad()
                body = DFlashBody(cfg)
                assert body.tp_group.size() == 2
                load_hf_state_dict_into(body, case["state"])
                with torch.no_grad():
                    blocks = embed_blocks(tokens, plan, embedding, mask_token_id=cfg.mask_token_id)
                hidden = body(out.taps, blocks, plan)
                hard = dflash_loss(hidden, plan, tokens, head, **LOSS_ARGS)
                soft = dflash_loss(hidden, plan, tokens, head, teacher_hidden=out.final_hidden, **KL_ARGS)
                (hard.loss_sum + soft.loss_sum).backward()
                r.update(
                    taps=out.taps, final_hidden=out.final_hidden, taps_grad=out.taps.requires_grad,
                    hard=hard.loss_sum.detach(), soft=soft.loss_sum.detach(), weight_sum=hard.weight_sum,
                    grads=_gathered_grads(body),
                )

            # Untied target: the output layer's shard comes from the last stage, the embedding from the first.
            untied = MegatronTarget.from_pretrained(case["untied"], TAPS, use_cpu_initialization=True)
            copies = {}
            for arg in (0, 1):
                embedding, head = copy_frozen_target_heads(untied, arg)
                if embedding is not None:
                    weight = head.weight if head.weight is not None else head.layer.weight
                    copies[arg] = (embedding.weight.detach().clone(), weight.detach().clone())
                    if arg == 1:  # the copy used as a module: full rows after its TP all-reduce
                        report["untied_lookup"] = embedding(tokens)
            report["untied"] = copies

            # ---- errors: every rank must raise, with the same message, and the group stays in sync.
            errors = report["errors"] = {}
            errors["resolve"] = _error_of(lambda: resolve_draft_stage(2, 2))
            errors["run_out_of_range"] = _error_of(lambda: run_target_pipeline(target, batch, draft_stage=2))
            errors["copy_out_of_range"] = _error_of(lambda: copy_frozen_target_heads(target, -3))
            disagree = 0 if rank == 3 else -1
            errors["disagree_stage"] = _error_of(lambda: run_target_pipeline(target, batch, draft_stage=disagree))
            short = dict(batch, tokens=tokens[:, :-1], position_ids=batch["position_ids"][:, :-1]) if rank == 1 else batch
            errors["disagree_shape"] = _error_of(lambda: run_target_pipeline(target, short, draft_stage=-1))
            target.model.config.context_parallel_size = 2
            try:
                errors["context_parallel"] = _error_of(lambda: run_target_pipeline(target, batch))
            finally:
                target.model.config.context_parallel_size = 1
            out = run_target_pipeline(target, batch, draft_stage=-1)
            report["after_errors"] = out.taps if out is not None else None

        # PP=1 (TP=2, DP=2): the same entry points, no routing; the target's own modules.
        destroy_model_parallel()
        initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=1)
        with megatron_target_on_cpu():
            flat = MegatronTarget.from_pretrained(case["tied"], config=cfg, use_cpu_initialization=True)
            embedding, head = copy_frozen_target_heads(flat, -1)
            out = run_target_pipeline(flat, batch)
            report["pp1"] = {"own": (embedding is flat.embedding, head is flat.output_head),
                             "taps": out.taps, "final_hidden": out.final_hidden}
            report["pp1_error"] = _error_of(lambda: run_target_pipeline(flat, batch, draft_stage=1))
    finally:
        destroy_model_parallel()
    return report


# --------------------------------------------------------------------------------------------------
# The test
# --------------------------------------------------------------------------------------------------


def test_resolve_draft_stage():
    assert resolve_draft_stage(-1, 4) == DraftStagePlacement(3, 4)
    assert resolve_draft_stage(0, 4).is_first_stage and resolve_draft_stage(-1, 4).is_last_stage
    assert resolve_draft_stage(-4, 4).draft_stage == 0
    assert resolve_draft_stage(-1, 1) == DraftStagePlacement(0, 1)
    for bad in (4, -5, 7):
        with pytest.raises(ValueError, match=rf"--dflash-pipeline-stage={bad} is outside the 4 pipeline stage"):
            resolve_draft_stage(bad, 4)
    with pytest.raises(ValueError, match="must be an integer"):
        resolve_draft_stage(True, 2)
    with pytest.raises(ValueError, match="made for 2 pipeline stage"):
        resolve_draft_stage(DraftStagePlacement(1, 2), 4)
    with pytest.raises(ValueError, match="0..1"):
        DraftStagePlacement(2, 2)


def test_pipeline_tp2_pp2_matches_single_process(tmp_path, tp_pool):
    cfg = _draft_config()
    tied_model, tied_path = _save_target(str(tmp_path), "tied", tied=True, seed=0)
    untied_model, untied_path = _save_target(str(tmp_path), "untied", tied=False, seed=1)
    batch = _batch()
    assert bool(batch["dflash_plan"].block_valid.all())
    state = _body_state(cfg)
    ref = _reference(tied_model, cfg, state, batch)
    assert ref["hard"] > 0 and ref["soft"] > 0 and all(g.abs().max() > 0 for g in ref["grads"].values())

    case = {"cfg": cfg, "batch": batch, "state": state, "tied": tied_path, "untied": untied_path}
    reports = tp_pool(4).run(_on_ranks_pipeline, case, tp=None)

    # Megatron's rank order: TP groups [0, 1], [2, 3]; stage 0 = ranks 0, 1; stage 1 = ranks 2, 3.
    assert [(r["stage"], r["tp_rank"]) for r in reports] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for arg, draft in ((-1, 1), (0, 0)):
        for rank, report in enumerate(reports):
            r = report["runs"][arg]
            where = f"draft stage arg {arg}, rank {rank}"
            on_draft = report["stage"] == draft
            assert r["holds"] == on_draft and r["got"] == on_draft and r["copies"] == (on_draft, on_draft), where
            if not on_draft:
                continue
            # Own modules where the stage has them, frozen copies elsewhere.
            assert r["own_embedding"] == (draft == 0) and r["own_head"] == (draft == 1), where
            assert r["head_meta"] == (0.75, 20.0) and r["frozen"], where
            assert not r["taps_grad"], where
            torch.testing.assert_close(r["taps"], ref["taps"], **TOL, msg=lambda m: f"{where} taps: {m}")
            torch.testing.assert_close(r["final_hidden"], ref["final_hidden"], **TOL,
                                       msg=lambda m: f"{where} final_hidden: {m}")
            for key in ("hard", "soft", "weight_sum"):
                torch.testing.assert_close(r[key], ref[key], **TOL, msg=lambda m: f"{where} {key}: {m}")
            assert set(r["grads"]) == set(ref["grads"]), where
            for name, grad in r["grads"].items():
                torch.testing.assert_close(grad, ref["grads"][name], **TOL, msg=lambda m: f"{where} grad {name}: {m}")

    # Untied copies: TP rank r of the draft's stage holds rows r*256 .. of the padded tables.
    sd = untied_model.state_dict()
    padded = {k: torch.cat([sd[k], sd[k].new_zeros(512 - VOCAB, HIDDEN)]) for k in ("model.embed_tokens.weight", "lm_head.weight")}
    assert not torch.equal(sd["model.embed_tokens.weight"], sd["lm_head.weight"])
    for report in reports:
        copies, tp_rank = report["untied"], report["tp_rank"]
        assert list(copies) == [report["stage"]], report["untied"].keys()
        emb, out = copies[report["stage"]]
        rows = slice(256 * tp_rank, 256 * (tp_rank + 1))
        torch.testing.assert_close(emb, padded["model.embed_tokens.weight"][rows], rtol=0, atol=0)
        torch.testing.assert_close(out, padded["lm_head.weight"][rows], rtol=0, atol=0)
        if report["stage"] == 1:
            torch.testing.assert_close(report["untied_lookup"], sd["model.embed_tokens.weight"][batch["tokens"]],
                                       rtol=0, atol=0)

    # Errors: raised on every rank, identically.
    errors = [r["errors"] for r in reports]
    for key in errors[0]:
        messages = {e[key] for e in errors}
        assert len(messages) == 1, (key, messages)
    e = errors[0]
    assert e["resolve"] == ("--dflash-pipeline-stage=2 is outside the 2 pipeline stage(s): use -1 (the last stage, "
                            "default) or a stage index in 0..1.")
    assert e["run_out_of_range"].startswith("run_target_pipeline: --dflash-pipeline-stage=2 is outside"), e
    assert "on every rank of the model-parallel group" in e["run_out_of_range"], e
    assert e["copy_out_of_range"].startswith("copy_frozen_target_heads: --dflash-pipeline-stage=-3 is outside"), e
    assert "disagree" in e["disagree_stage"] and "rank 3: [2, 2, 0," in e["disagree_stage"], e
    assert "disagree" in e["disagree_shape"] and "rank 1: [2, 2, 1, 2, 15," in e["disagree_shape"], e
    assert "context_parallel_size=2 is not supported" in e["context_parallel"], e
    assert "TEDotProductAttention" in e["context_parallel"], e
    # The group is still in sync: a normal run after the errors.
    for report in reports:
        if report["stage"] == 1:
            torch.testing.assert_close(report["after_errors"], ref["taps"], **TOL)
        else:
            assert report["after_errors"] is None

    # PP=1: every rank is the draft's stage and uses the target's own embedding and head.
    for report in reports:
        assert report["pp1"]["own"] == (True, True)
        torch.testing.assert_close(report["pp1"]["taps"], ref["taps"], **TOL)
        torch.testing.assert_close(report["pp1"]["final_hidden"], ref["final_hidden"], **TOL)
        assert "--dflash-pipeline-stage=1 is outside the 1 pipeline stage(s)" in report["pp1_error"], report["pp1_error"]
