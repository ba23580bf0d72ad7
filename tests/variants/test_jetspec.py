"""JetSpec: causal in-block attention and forward KL to the target.

The checks: a JetSpec body is causal in-block (a slot never sees a later slot of its block) while
the DFlash body is not; the exported config says ``causal: true`` and loads back causal (config and
whole checkpoint); `jetspec_loss` equals a naive per-slot reference built from full logits and
``F.kl_div`` (values, gradients, and metrics measured against the target's argmax, not the data token).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from megatron_dflash.draft.body import DFlashBody
from megatron_dflash.checkpoint.hf import load_hf_checkpoint, save_hf_checkpoint
from megatron_dflash.draft.config import DFLASH_ARCHITECTURE, DFlashConfig
from megatron_dflash.objectives.dflash_loss import OutputHead
from megatron_dflash.plan.batch_plan import DFlashBatchPlan
from megatron_dflash.variants.dflash2 import DFlash2Config
from megatron_dflash.variants.jetspec import JetSpecConfig, jetspec_config, jetspec_loss, teacher_argmax_ids

pytestmark = pytest.mark.usefixtures("one_thread")

H, V, W, S = 32, 48, 4, 16
ANCHORS = torch.tensor([[1, 6, 11, 0], [4, 9, 2, 12]])
VALID = torch.tensor([[True, True, True, False], [True, True, True, True]])


def dflash_config(**overrides) -> DFlashConfig:
    kwargs = dict(
        hidden_size=H,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        block_size=W,
        mask_token_id=5,
        vocab_size=V,
        num_target_layers=6,
        target_layer_ids=[1, 3],
        rope_theta=10000.0,
        max_position_embeddings=256,
    )
    kwargs.update(overrides)
    return DFlashConfig(**kwargs)


def plan_of(anchors=ANCHORS, valid=VALID) -> DFlashBatchPlan:
    return DFlashBatchPlan.from_anchors(anchors, block_size=W, seq_length=S, block_valid=valid)


# ================================================================================== config


def test_config_forces_causal_and_round_trips(tmp_path):
    base = dflash_config(layer_types=["full_attention", "sliding_attention"], sliding_window=6)
    cfg = jetspec_config(base)
    assert isinstance(cfg, JetSpecConfig) and cfg.causal is True
    assert [cfg.layer_attention(i) for i in range(2)] == [(True, None), (True, 6)]
    assert base.causal is None  # the source config is not modified
    data = cfg.to_hf_dict()
    assert data["architectures"] == [DFLASH_ARCHITECTURE]
    assert data["is_causal"] is True and data["dflash_config"]["causal"] is True

    cfg.save_pretrained(str(tmp_path))
    with open(tmp_path / "config.json") as f:
        written = json.load(f)
    assert written["dflash_config"]["causal"] is True and written["is_causal"] is True
    for cls in (DFlashConfig, JetSpecConfig):
        loaded = cls.from_pretrained(str(tmp_path))
        assert loaded.causal is True
        assert all(loaded.layer_attention(i)[0] for i in range(loaded.num_hidden_layers))
    # Only `causal: true` in dflash_config (no is_causal) is enough too.
    del written["is_causal"]
    assert DFlashConfig.from_hf_dict(written).causal is True
    assert JetSpecConfig.from_hf_dict(written) == cfg

    with pytest.raises(ValueError, match="not a JetSpec draft"):
        JetSpecConfig.from_hf_dict(dflash_config().to_hf_dict())
    with pytest.raises(ValueError, match="causal"):
        JetSpecConfig(**{**vars(dflash_config()), "causal": False})
    with pytest.raises(ValueError, match="plain DFlashConfig"):
        jetspec_config(DFlash2Config(**{k: v for k, v in vars(dflash_config()).items() if k != "causal"}))


def test_checkpoint_round_trip_stays_causal(tmp_path):
    torch.manual_seed(0)
    body = DFlashBody(jetspec_config(dflash_config()), attention_backend="dense")
    save_hf_checkpoint(body, str(tmp_path / "jetspec"))
    loaded = load_hf_checkpoint(str(tmp_path / "jetspec"), attention_backend="dense")
    assert loaded.config.causal is True
    taps = torch.randn(2, S, 2 * H)
    blocks = torch.randn(2, ANCHORS.shape[1], W, H)
    with torch.no_grad():
        torch.testing.assert_close(loaded(taps, blocks, plan_of()), body(taps, blocks, plan_of()))


# ================================================================================== causal in-block


@pytest.mark.parametrize("backend", ["dense", "chunked"])
def test_slot_never_sees_later_slots(backend):
    torch.manual_seed(1)
    cfg = dflash_config()
    jet = DFlashBody(jetspec_config(cfg), attention_backend=backend)
    plain = DFlashBody(cfg, attention_backend=backend)
    plain.load_state_dict(jet.state_dict())
    plan = plan_of()
    taps = torch.randn(2, S, 2 * H)
    blocks = torch.randn(2, ANCHORS.shape[1], W, H)
    with torch.no_grad():
        jet_ref, plain_ref = jet(taps, blocks, plan), plain(taps, blocks, plan)
        for j in range(1, W):
            changed = blocks.clone()
            changed[:, :, j] += torch.randn(2, ANCHORS.shape[1], H)
            out = jet(taps, changed, plan)
            valid = plan.block_valid
            # Slots before j are untouched, slot j and later see the change.
            torch.testing.assert_close(out[:, :, :j], jet_ref[:, :, :j], rtol=0, atol=1e-6)
            assert (out[:, :, j:] - jet_ref[:, :, j:]).abs().amax(dim=-1)[valid].min() > 1e-4
            # The bidirectional body lets slot j reach every slot (the test can tell the two apart).
            plain_out = plain(taps, changed, plan)
            assert (plain_out[:, :, :j] - plain_ref[:, :, :j]).abs().amax(dim=-1)[valid].min() > 1e-4


# ================================================================================== loss


def naive_jetspec(hidden, plan, head_weight, teacher_hidden, temperature, decay_gamma, vocab):
    """Per-slot reference from full logits: (loss_sum, weight_sum, correct, acceptance per block)."""
    B, N = plan.anchor_positions.shape
    loss_sum = hidden.new_zeros(())
    weight_sum = 0.0
    correct = torch.zeros(B, N, W, dtype=torch.bool)
    acceptance = torch.zeros(B, N)
    for b in range(B):
        for n in range(N):
            if not plan.block_valid[b, n]:
                continue
            p = int(plan.anchor_positions[b, n])
            run = 0
            broken = False
            for k in range(1, W):
                draft = (hidden[b, n, k] @ head_weight.T)[:vocab]
                teacher = (teacher_hidden[b, p + k - 1] @ head_weight.T)[:vocab]
                kl = F.kl_div(
                    F.log_softmax(draft / temperature, -1), F.log_softmax(teacher / temperature, -1),
                    log_target=True, reduction="sum",
                )
                w = 1.0 if decay_gamma is None else float(torch.exp(torch.tensor(-(k - 1) / decay_gamma)))
                loss_sum = loss_sum + w * temperature**2 * kl
                weight_sum += w
                correct[b, n, k] = bool(draft.argmax() == teacher.argmax())
                if correct[b, n, k] and not broken:
                    run += 1
                else:
                    broken = True
            acceptance[b, n] = run + 1
    return loss_sum, weight_sum, correct, acceptance


@pytest.mark.parametrize(
    "temperature, decay_gamma, chunk_slots", [(1.0, None, None), (2.0, 3.0, 5)], ids=["T1-uniform", "T2-decay-chunked"]
)
def test_loss_matches_naive_reference(temperature, decay_gamma, chunk_slots):
    gen = torch.Generator().manual_seed(4)
    plan = plan_of()
    N = ANCHORS.shape[1]
    padded = V + 4  # the head has padding columns past the vocabulary
    head_weight = torch.randn(padded, H, generator=gen)
    layer = torch.nn.Linear(H, padded, bias=False)
    layer.weight.data.copy_(head_weight)
    layer.requires_grad_(False)
    head = OutputHead(layer, V)
    teacher_hidden = torch.randn(2, S, H, generator=gen)
    hidden = torch.randn(2, N, W, H, generator=gen)
    # Some slots copy the teacher's state, so the draft agrees with the target there (non-trivial metrics).
    for b, n, k in [(0, 0, 1), (0, 0, 2), (0, 1, 1), (1, 0, 1), (1, 0, 2), (1, 0, 3), (1, 2, 2)]:
        hidden[b, n, k] = teacher_hidden[b, int(ANCHORS[b, n]) + k - 1]
    hidden[~VALID] = 0
    hidden.requires_grad_(True)
    # Data tokens that never equal the target's argmax: accuracy against them would be 0.
    greedy = teacher_argmax_ids(plan, head, teacher_hidden)
    input_ids = torch.randint(V, (2, S), generator=gen)

    out = jetspec_loss(
        hidden, plan, input_ids, head, teacher_hidden,
        temperature=temperature, decay_gamma=decay_gamma, chunk_slots=chunk_slots,
    )
    out.loss_sum.backward()
    grad = hidden.grad.clone()

    ref_hidden = hidden.detach().clone().requires_grad_(True)
    ref_loss, ref_weight, correct, acceptance = naive_jetspec(
        ref_hidden, plan, head_weight, teacher_hidden, temperature, decay_gamma, V
    )
    ref_loss.backward()
    torch.testing.assert_close(out.loss_sum, ref_loss.float(), rtol=1e-5, atol=1e-5)
    assert float(out.weight_sum) == pytest.approx(ref_weight, rel=1e-6)
    torch.testing.assert_close(grad, ref_hidden.grad, rtol=1e-4, atol=1e-6)

    m = out.metrics
    assert float(m.supervised_tokens) == int(VALID.sum()) * (W - 1)
    assert float(m.correct_tokens) == int(correct.sum()) >= 7
    assert float(m.valid_blocks) == int(VALID.sum())
    assert float(m.acceptance_sum) == float(acceptance.sum())
    # The teacher's argmax helper agrees with the full logits.
    for b in range(2):
        for n in range(N):
            if VALID[b, n]:
                p = int(ANCHORS[b, n])
                expect = [int((teacher_hidden[b, p + k - 1] @ head_weight[:V].T).argmax()) for k in range(1, W)]
                assert greedy[b, n, 1:].tolist() == expect


def test_loss_mask_and_invalid_inputs():
    gen = torch.Generator().manual_seed(5)
    plan = plan_of()
    layer = torch.nn.Linear(H, V, bias=False)
    head = OutputHead(layer, V)
    teacher_hidden = torch.randn(2, S, H, generator=gen)
    hidden = torch.randn(2, ANCHORS.shape[1], W, H, generator=gen)
    input_ids = torch.randint(V, (2, S), generator=gen)
    full = jetspec_loss(hidden, plan, input_ids, head, teacher_hidden)
    # A mask that keeps the first predicted slot only (slot 0 is never supervised, even if asked).
    mask = torch.zeros(2, ANCHORS.shape[1], W, dtype=torch.bool)
    mask[:, :, :2] = True
    part = jetspec_loss(hidden, plan, input_ids, head, teacher_hidden, loss_mask=mask)
    assert float(part.metrics.supervised_tokens) == int(VALID.sum())
    assert float(part.weight_sum) == int(VALID.sum())
    assert float(part.loss_sum) < float(full.loss_sum)
    with pytest.raises(ValueError, match="temperature"):
        jetspec_loss(hidden, plan, input_ids, head, teacher_hidden, temperature=0.0)
    with pytest.raises(ValueError, match="teacher_hidden"):
        jetspec_loss(hidden, plan, input_ids, head, teacher_hidden[:, :-1])
    with pytest.raises(ValueError, match="input_ids"):
        jetspec_loss(hidden, plan, input_ids[:, :-1], head, teacher_hidden)
