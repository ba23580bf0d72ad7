"""DSpark's whole training forward and backward against NeMo AutoModel 0.7.0's `DSparkTrainerModule`
(docs/design.md §18 DSpark), on fixed anchors.

The same weights (our HF export loaded into NeMo's `Qwen3DSparkModel` / `KimiK3DSparkModel`, with the
target's embedding and head as its frozen copies), the same target taps and final hidden states, the same
anchors (NeMo's anchor draw replaced by our plan's anchors and valid blocks). Our side runs the training
path: `embed_blocks` with the target's embedding, the body, the registry's loss adapter (`Variant.loss`) with
the loss mask as the input mask, then the global normalisation ``loss_sum / weight_sum``. Compared: the loss
and its three terms (1e-5 relative; NeMo adds 1e-6 to each denominator, a relative ``1e-6 / weight_sum``)
and every parameter gradient (1e-4 relative), for each Markov head form with the confidence head off, on
without the Markov input and on with it, and for the Kimi K3 MLA draft. The anchors meet every cut of the
supervision: the sequence end, a gap of the loss mask inside the block, the token after the block outside
the loss mask, and an invalid block.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from megatron_dflash.checkpoint.hf import save_hf_checkpoint
from megatron_dflash.objectives.dflash_loss import embed_blocks
from megatron_dflash.plan.batch_plan import DFlashBatchPlan
from megatron_dflash.target.head import OutputHead
from megatron_dflash.variants.dspark import DSparkBody, DSparkConfig, KimiK3DSparkBody
from megatron_dflash.variants.options import DSPARK_OPTIONS
from megatron_dflash.variants.registry import get_variant

from builders import tiny_draft_kwargs
from dspark_models import k3_config, nemo_dspark, qwen3_config
from nemo_reference import randomize

pytestmark = pytest.mark.usefixtures("one_thread")

LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4
DECAY = 4.0
SEQ = 24
# Row 0: a prompt, then a gap at 10..11. Row 1: a gap at 16, padding from 21.
LOSS_MASK = torch.tensor([[0] * 4 + [1] * 6 + [0] * 2 + [1] * 12,
                          [0] * 2 + [1] * 14 + [0] + [1] * 4 + [0] * 3]).bool()
# Row 0: a full block; a block cut by the gap after slot 0; a full block; the last slot past the sequence.
# Row 1: a full block; two blocks whose last label (p + W) is outside the loss mask; an invalid block.
ANCHORS = torch.tensor([[4, 8, 13, 20], [2, 12, 17, 0]])
VALID = torch.tensor([[True] * 4, [True, True, True, False]])
CONFIDENCE = {
    "off": dict(enable_confidence_head=False, confidence_head_with_markov=False),
    "hidden": dict(enable_confidence_head=True, confidence_head_with_markov=False),
    "with_markov": dict(enable_confidence_head=True, confidence_head_with_markov=True),
}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))


def target_modules(config, seed: int = 6):
    """The target's embedding and output layer (frozen), non-trivial."""
    gen = torch.Generator().manual_seed(seed)
    embedding = nn.Embedding(config.vocab_size, config.hidden_size)
    head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    with torch.no_grad():
        embedding.weight.copy_(torch.randn(embedding.weight.shape, generator=gen))
        head.weight.copy_(torch.randn(head.weight.shape, generator=gen) * 0.3)
    return embedding.requires_grad_(False), head.requires_grad_(False)


def batch(config, seed: int = 5):
    gen = torch.Generator().manual_seed(seed)
    B = LOSS_MASK.shape[0]
    ids = torch.randint(0, config.vocab_size, (B, SEQ), generator=gen)
    taps = torch.randn(B, SEQ, config.num_taps * config.hidden_size, generator=gen)
    final = torch.randn(B, SEQ, config.hidden_size, generator=gen)
    return ids, taps, final


def ours(body, embedding, head, ids, taps, final, plan, variant: str, options=None, weighting=None):
    """The training step's path: (loss, terms, {name: grad})."""
    out = get_variant(variant).loss(
        body, body(taps, embed_blocks(ids, plan, embedding, mask_token_id=body.config.mask_token_id), plan), plan,
        ids, OutputHead(head, body.config.vocab_size), decay_gamma=None if weighting else DECAY, weighting=weighting,
        chunk_slots=5, prefix_lengths=None, final_hidden=final, options=options or DSPARK_OPTIONS.options_cls(),
        step=0, total_steps=1, embedding=embedding, input_mask=LOSS_MASK,
    )
    (out.loss_sum / out.weight_sum).backward()
    m = out.metrics
    terms = {"loss": out.loss_sum.detach() / out.weight_sum, "ce": m.ce_loss, "l1": m.l1_loss, "bce": m.bce_loss}
    return terms, {n: p.grad for n, p in body.named_parameters()}


def nemo(ref, embedding, head, ids, taps, final, plan, module, monkeypatch):
    """NeMo's trainer on the same anchors: (loss, terms, {name: grad})."""
    core = nemo_dspark("core")
    ref.initialize_embeddings_and_head(embed_tokens=embedding, lm_head=head, freeze=True)
    monkeypatch.setattr(module, "sample_anchor_positions",
                        lambda **kw: (plan.anchor_positions.clone(), plan.block_valid.clone()))
    trainer = core.DSparkTrainerModule(ref, loss_decay_gamma=DECAY, ce_loss_alpha=0.1, l1_loss_alpha=0.9,
                                       confidence_head_alpha=1.0)
    out = trainer(input_ids=ids, target_hidden_states=taps, loss_mask=LOSS_MASK.long(),
                  target_last_hidden_states=final)
    out.loss.backward()
    terms = {"loss": out.loss.detach(), "ce": out.ce_loss, "l1": out.l1_loss, "bce": out.confidence_loss}
    return terms, {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}


def compare(got, expected, what: str) -> dict:
    """Assert the parity; returns the measured relative differences."""
    (terms, grads), (ref_terms, ref_grads) = got, expected
    errors = {}
    for name, value in ref_terms.items():
        if name == "bce" and float(value) == 0.0:
            assert float(terms[name]) == 0.0, f"{what}: a BCE term without a confidence head"
            continue
        errors[name] = relative(torch.as_tensor(terms[name]), value)
        assert errors[name] <= LOSS_RTOL, f"{what} {name}: relative difference {errors[name]:.3g}"
    assert set(grads) == set(ref_grads), f"{what}: {sorted(set(grads) ^ set(ref_grads))}"
    worst = 0.0
    for name, ref_grad in ref_grads.items():
        assert ref_grad is not None and ref_grad.abs().max() > 0, f"{what}: NeMo gives {name} no gradient"
        error = relative(grads[name], ref_grad)
        assert error <= GRAD_RTOL, f"{what} grad {name}: relative difference {error:.3g}"
        worst = max(worst, error)
    errors["grad (worst)"] = worst
    return errors


@pytest.mark.parametrize("confidence", list(CONFIDENCE))
@pytest.mark.parametrize("form", ["vanilla", "gated", "rnn"])
def test_training_step_matches_nemo_trainer(tmp_path, monkeypatch, form, confidence):
    draft = nemo_dspark("draft_qwen3")
    config = DSparkConfig(**tiny_draft_kwargs(markov_rank=8, markov_head_type=form, **CONFIDENCE[confidence]))
    torch.manual_seed(0)
    body = DSparkBody(config)
    randomize(body, 2)
    save_hf_checkpoint(body, str(tmp_path / "ours"))
    ref = draft.Qwen3DSparkModel(qwen3_config(str(tmp_path / "ours" / "config.json"))).float()
    ref.load_state_dict(load_file(str(tmp_path / "ours" / "model.safetensors")), strict=False)
    embedding, head = target_modules(config)
    ids, taps, final = batch(config)
    plan = DFlashBatchPlan.from_anchors(ANCHORS, block_size=config.block_size, block_valid=VALID,
                                        input_mask=LOSS_MASK)
    got = ours(body, embedding, head, ids, taps, final, plan, "dspark")
    expected = nemo(ref, embedding, head, ids, taps, final, plan, draft, monkeypatch)
    print(form, confidence, compare(got, expected, f"{form} / confidence {confidence}"))


def test_kimi_k3_training_step_matches_nemo_trainer(tmp_path, monkeypatch):
    draft = nemo_dspark("draft_kimi_k3")
    backbone = nemo_dspark("draft_deepseek_v4")  # KimiK3DSparkModel's forward (and anchor draw) is its base's
    from nemo_automodel.components.models.kimi_k3.config import KimiK3TextConfig

    config = k3_config()
    torch.manual_seed(0)
    body = KimiK3DSparkBody(config)
    randomize(body, 2)
    save_hf_checkpoint(body, str(tmp_path / "ours"))
    with open(tmp_path / "ours" / "config.json") as f:
        ref = draft.KimiK3DSparkModel(KimiK3TextConfig(**json.load(f))).float()
    ref.load_state_dict(load_file(str(tmp_path / "ours" / "model.safetensors")), strict=False)
    embedding, head = target_modules(config)
    ids, taps, final = batch(config)
    plan = DFlashBatchPlan.from_anchors(ANCHORS, block_size=config.block_size, block_valid=VALID,
                                        input_mask=LOSS_MASK)
    got = ours(body, embedding, head, ids, taps, final, plan, "kimi_k3_dspark")
    expected = nemo(ref, embedding, head, ids, taps, final, plan, backbone, monkeypatch)
    print("kimi_k3", compare(got, expected, "Kimi K3"))
