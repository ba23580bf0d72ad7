"""The draft body in one process (TP=1, fp32, tiny sizes), and its config.

What a body must guarantee whatever the attention kernel: each block sees the target
context strictly before its anchor (inside its document and window) and its own slots,
never another block or another row; invalid blocks give exact zeros and nothing is NaN;
the context feature is `hidden_norm(fc(concat taps))`, shared by every layer without a
second norm. The chunked (production) kernel must equal the dense reference in outputs and
in every parameter gradient. The DFlash config is checked against the published
target-layer formula and the HF `config.json` layouts it must read.
"""

from __future__ import annotations

import json

import pytest
import torch

from megatron_dflash.draft.body import DFlashBody, default_parallel_config
from megatron_dflash.draft.config import DFlashConfig, default_target_layer_ids
from megatron_dflash.plan.batch_plan import DFlashBatchPlan

H, W, S = 32, 4, 20
CHANGE_TOL = 1e-6  # "unchanged" (a leak moves outputs by ~1e-2 or more)


def tiny_config(**overrides) -> DFlashConfig:
    kwargs = dict(
        hidden_size=H,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        block_size=W,
        mask_token_id=3,
        vocab_size=50,
        num_target_layers=6,
        target_layer_ids=[1, 3],
        rope_theta=10000.0,
    )
    kwargs.update(overrides)
    return DFlashConfig(**kwargs)


def make_body(config: DFlashConfig, seed: int = 0, backend: str = "chunked") -> DFlashBody:
    torch.manual_seed(seed)
    body = DFlashBody(config, attention_backend=backend)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():  # norms away from 1 so that a misplaced norm shows
        for name, param in body.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(0.5 + torch.rand(param.shape, generator=gen))
    return body


def make_plan(**kwargs) -> DFlashBatchPlan:
    """B=3, N=3: row 0 unpacked (one block at anchor 0: empty context), row 1 with one
    invalid block, row 2 with no valid block at all."""
    anchors = torch.tensor([[0, 6, 15], [4, 11, 0], [0, 0, 0]])
    valid = torch.tensor([[True, True, True], [True, True, False], [False, False, False]])
    return DFlashBatchPlan.from_anchors(anchors, block_size=W, seq_length=S, block_valid=valid, **kwargs)


def make_inputs(config: DFlashConfig, plan: DFlashBatchPlan, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    taps = torch.randn(plan.batch_size, plan.seq_length, config.num_taps * config.hidden_size, generator=gen)
    blocks = torch.randn(plan.batch_size, plan.num_blocks, config.block_size, config.hidden_size, generator=gen)
    return taps, blocks


CONFIGS = {
    "full": dict(),
    "sliding_causal": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=5),
    "causal": dict(causal=True),
}


# ------------------------------------------------------------------------------ outputs


def test_output_shape_zero_at_invalid_blocks_and_no_nan():
    config = tiny_config()
    body = make_body(config)
    plan = make_plan()
    taps, blocks = make_inputs(config, plan)
    taps.requires_grad_(True)
    blocks.requires_grad_(True)
    out = body(taps, blocks, plan)
    assert out.shape == (3, 3, W, H) and out.dtype == torch.float32
    assert torch.equal(out[~plan.block_valid], torch.zeros_like(out[~plan.block_valid]))
    assert out[plan.block_valid].abs().sum(-1).gt(0).all()  # every valid slot has a non-zero state
    assert torch.isfinite(out).all()
    out.square().sum().backward()
    assert torch.isfinite(taps.grad).all() and torch.isfinite(blocks.grad).all()
    for name, param in body.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
    # Nothing flows from or into a row with no valid block, nor from an invalid block.
    assert torch.equal(blocks.grad[2], torch.zeros_like(blocks.grad[2]))
    assert torch.equal(taps.grad[2], torch.zeros_like(taps.grad[2]))
    assert torch.equal(blocks.grad[1, 2], torch.zeros_like(blocks.grad[1, 2]))


def test_unsupervised_slots_are_predictions_the_loss_never_reads():
    """Why the body does not zero slots outside `plan.loss_mask` (see `DFlashBody.forward`): its
    output does not depend on the supervision, and no gradient or loss value comes from those slots."""
    from megatron_dflash.objectives.dflash_loss import OutputHead, dflash_loss

    config = tiny_config()
    body = make_body(config)
    holes = torch.ones(3, S, dtype=torch.bool)
    holes[0, 8] = holes[1, 5] = holes[1, 14] = False  # unsupervised slots inside valid blocks
    plan, full = make_plan(input_mask=holes), make_plan()
    unsupervised = plan.block_valid[:, :, None] & ~plan.loss_mask
    unsupervised[:, :, 0] = False
    assert unsupervised.sum() == 3
    taps, blocks = make_inputs(config, plan)
    out = body(taps, blocks, plan)
    assert torch.equal(out, body(taps, blocks, full))  # the same predictions, supervised or not

    gen = torch.Generator().manual_seed(3)
    head = OutputHead(torch.nn.Linear(H, config.vocab_size, bias=False), config.vocab_size)
    ids = torch.randint(config.vocab_size, (3, S), generator=gen)
    hidden = out.detach().clone().requires_grad_(True)
    garbage = torch.where(unsupervised[..., None], 1e4 * torch.randn(out.shape, generator=gen), hidden.detach())
    garbage.requires_grad_(True)
    first, second = dflash_loss(hidden, plan, ids, head), dflash_loss(garbage, plan, ids, head)
    assert torch.equal(first.loss_sum, second.loss_sum) and torch.equal(first.weight_sum, second.weight_sum)
    first.loss_sum.backward()
    second.loss_sum.backward()
    assert torch.equal(hidden.grad, garbage.grad)
    assert torch.equal(hidden.grad[unsupervised], torch.zeros_like(hidden.grad[unsupervised]))


def test_batch_with_no_valid_block_at_all():
    config = tiny_config()
    body = make_body(config)
    anchors = torch.zeros(2, 2, dtype=torch.long)
    plan = DFlashBatchPlan.from_anchors(anchors, block_size=W, seq_length=S, block_valid=torch.zeros(2, 2, dtype=torch.bool))
    taps, blocks = make_inputs(config, plan)
    blocks.requires_grad_(True)
    out = body(taps, blocks, plan)
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    assert torch.isfinite(blocks.grad).all()
    for name, param in body.named_parameters():
        assert param.grad is None or torch.isfinite(param.grad).all(), name


def _forward_backward(body: DFlashBody, taps, blocks, plan, backend: str):
    body.attention_backend = backend
    body.zero_grad(set_to_none=True)
    taps = taps.clone().requires_grad_(True)
    blocks = blocks.clone().requires_grad_(True)
    out = body(taps, blocks, plan)
    gen = torch.Generator().manual_seed(5)
    out.backward(torch.randn(out.shape, generator=gen))
    grads = {name: p.grad.clone() for name, p in body.named_parameters()}
    return out.detach(), grads, taps.grad, blocks.grad


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_chunked_equals_dense(name):
    config = tiny_config(**CONFIGS[name])
    body = make_body(config)
    # Packed row 1 (documents [0, 9), [9, 20)) on top of the usual layout.
    docs = torch.tensor([[0] * S, [0] * 9 + [1] * 11, [0] * S])
    plan = DFlashBatchPlan.from_anchors(
        torch.tensor([[0, 6, 15], [9, 2, 14], [0, 0, 0]]),
        block_size=W,
        seq_length=S,
        block_valid=torch.tensor([[True, True, True], [True, True, False], [False, False, False]]),
        document_ids=docs,
    )
    taps, blocks = make_inputs(config, plan)
    dense = _forward_backward(body, taps, blocks, plan, "dense")
    chunked = _forward_backward(body, taps, blocks, plan, "chunked")
    torch.testing.assert_close(chunked[0], dense[0], atol=1e-5, rtol=1e-5)
    assert dense[1].keys() == chunked[1].keys()
    for key in dense[1]:
        torch.testing.assert_close(chunked[1][key], dense[1][key], atol=1e-5, rtol=1e-4, msg=key)
    torch.testing.assert_close(chunked[2], dense[2], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(chunked[3], dense[3], atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------------------ visibility


def _changed(before: torch.Tensor, after: torch.Tensor) -> float:
    return (before - after).abs().max().item()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_blocks_and_rows_are_independent(name):
    config = tiny_config(**CONFIGS[name])
    body = make_body(config)
    plan = DFlashBatchPlan.from_anchors(torch.tensor([[3, 8, 14], [5, 10, 2]]), block_size=W, seq_length=S)
    taps, blocks = make_inputs(config, plan)
    with torch.no_grad():
        base = body(taps, blocks, plan)
        # Another block's embedding (same row): only that block moves.
        other = blocks.clone()
        other[0, 1] += torch.randn(W, H)
        out = body(taps, other, plan)
        assert _changed(out[0, 1], base[0, 1]) > 1e-3
        for b in (0, 2):
            assert _changed(out[0, b], base[0, b]) <= CHANGE_TOL, b
        assert _changed(out[1], base[1]) <= CHANGE_TOL
        # Another row's context and blocks: this row does not move.
        other_taps, other_blocks = taps.clone(), blocks.clone()
        other_taps[1] = torch.randn_like(other_taps[1])
        other_blocks[1] = torch.randn_like(other_blocks[1])
        out = body(other_taps, other_blocks, plan)
        assert _changed(out[0], base[0]) <= CHANGE_TOL
        assert _changed(out[1], base[1]) > 1e-3


def _effect_of_each_context_position(body, config, anchor, document_ids=None) -> list[float]:
    """How much one block's output moves when one context position changes, for every position.

    Rows are independent (tested above), so all S perturbations run as one batch: row 0 is
    the unperturbed input, row 1 + j has position j replaced.
    """
    rows = S + 1
    plan = DFlashBatchPlan.from_anchors(
        torch.full((rows, 1), anchor),
        block_size=W,
        seq_length=S,
        document_ids=None if document_ids is None else document_ids.expand(rows, S),
    )
    gen = torch.Generator().manual_seed(11)
    taps = torch.randn(1, S, config.num_taps * H, generator=gen).repeat(rows, 1, 1)
    blocks = torch.randn(1, 1, W, H, generator=gen).repeat(rows, 1, 1, 1)
    for j in range(S):
        taps[1 + j, j] = torch.randn(config.num_taps * H, generator=gen)
    with torch.no_grad():
        out = body(taps, blocks, plan)
    return [_changed(out[1 + j], out[0]) for j in range(S)]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_context_is_strictly_before_the_anchor(name):
    config = tiny_config(**CONFIGS[name])
    body = make_body(config)
    anchor = 9
    for position, delta in enumerate(_effect_of_each_context_position(body, config, anchor)):
        if position >= anchor:  # the anchor itself and every later position are invisible
            assert delta <= CHANGE_TOL, f"context position {position} >= anchor {anchor} leaked ({delta:.2g})"
        else:
            assert delta > 1e-4, f"context position {position} < anchor {anchor} is not seen"


def test_context_stays_inside_the_document_and_the_window():
    # Every layer slides: the query at a+q sees context j iff (a+q) - j < window, so slot 0
    # reaches furthest back, to a - window + 1. The block's document starts at 6.
    window = 5
    config = tiny_config(layer_types=["sliding_attention"] * 2, sliding_window=window)
    body = make_body(config)
    anchor, doc_start = 14, 6
    docs = torch.tensor([[0] * doc_start + [1] * (S - doc_start)])
    first_visible = max(doc_start, anchor - window + 1)
    assert first_visible > doc_start  # both limits are exercised
    for position, delta in enumerate(_effect_of_each_context_position(body, config, anchor, docs)):
        if first_visible <= position < anchor:
            assert delta > 1e-4, f"position {position} should be visible"
        else:
            assert delta <= CHANGE_TOL, f"position {position} leaked ({delta:.2g})"
    # Bidirectional sliding layers see the same context window.
    config = tiny_config(layer_types=["sliding_attention"] * 2, sliding_window=window, causal=False)
    body = make_body(config)
    for position, delta in enumerate(_effect_of_each_context_position(body, config, anchor, docs)):
        assert (delta > 1e-4) == (first_visible <= position < anchor), (position, delta)


def test_context_feature_is_hidden_norm_of_fc_and_not_renormed():
    """`c = hidden_norm(fc(concat taps))` reaches every layer's k/v projections as is."""
    config = tiny_config()
    body = make_body(config)
    plan = DFlashBatchPlan.from_anchors(torch.tensor([[4, 10]]), block_size=W, seq_length=S)
    taps, blocks = make_inputs(config, plan)
    seen: dict[str, list[torch.Tensor]] = {}

    def record(name):
        def hook(module, args):
            seen.setdefault(name, []).append(args[0].detach().clone())

        return hook

    handles = []
    for i, layer in enumerate(body.layers):
        for proj in ("k_proj", "v_proj"):
            handles.append(getattr(layer.self_attn, proj).register_forward_pre_hook(record(f"{i}.{proj}")))
    with torch.no_grad():
        body(taps, blocks, plan)
    for handle in handles:
        handle.remove()

    # Written out from the definition: fc, then RMSNorm(eps) with hidden_norm's weight.
    x = taps @ body.fc.weight.detach().T
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps)
    expected = body.hidden_norm.weight.detach() * x
    for name, inputs in seen.items():
        contexts = [t for t in inputs if t.shape == (1, S, H)]
        assert len(contexts) == 1, name
        torch.testing.assert_close(contexts[0], expected, atol=1e-6, rtol=1e-5, msg=name)


# ------------------------------------------------------------------------------ errors


def test_bad_inputs_raise_value_errors():
    config = tiny_config()
    body = make_body(config)
    plan = make_plan()
    taps, blocks = make_inputs(config, plan)
    cases = [
        ((taps[..., :H], blocks, plan), r"2 taps x 32 = 64.*target_layer_ids=\[1, 3\]"),
        ((taps[0], blocks, plan), r"target_hidden must be \[batch, seq, taps\*hidden\]"),
        ((taps, blocks[0], plan), r"block_embeddings must be \[batch, blocks, block_size, hidden\]"),
        ((taps, blocks[:, :2], plan), r"block_embeddings has shape \(3, 2, 4, 32\), expected \(3, 3, 4, 32\)"),
        ((taps[:, :-1], blocks, plan), r"plan is for batch 3 x seq 20"),
        ((taps, blocks, "plan"), r"plan must be a DFlashBatchPlan"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            body(*args)
    other = DFlashBatchPlan.from_anchors(torch.tensor([[0, 6, 12]] * 3), block_size=W + 1, seq_length=S)
    with pytest.raises(ValueError, match="plan.block_size=5 but config.block_size=4"):
        body(taps, blocks, other)


def test_refused_parallel_layouts():
    config = tiny_config()
    with pytest.raises(ValueError, match="sequence_parallel=True is not supported"):
        DFlashBody(config, parallel_config=default_parallel_config(sequence_parallel=True, tensor_model_parallel_size=2))
    with pytest.raises(ValueError, match="context_parallel_size=2 is not supported"):
        DFlashBody(config, parallel_config=default_parallel_config(context_parallel_size=2))


def test_tensor_parallel_size_must_divide_kv_heads():
    config = DFlashConfig(mask_token_id=0)  # the default draft: 8 KV heads
    with pytest.raises(ValueError, match=r"num_key_value_heads=8.*at most 8"):
        config.validate_tensor_parallel(16)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        config.validate_tensor_parallel(3)
    for tp in (1, 2, 4, 8):
        config.validate_tensor_parallel(tp)


def test_config_validation_messages():
    with pytest.raises(ValueError, match="mask_token_id is required"):
        DFlashConfig()
    with pytest.raises(ValueError, match="not a row of the target embedding"):
        DFlashConfig(mask_token_id=10**6)
    with pytest.raises(ValueError, match="duplicates"):
        tiny_config(target_layer_ids=[1, 1])
    with pytest.raises(ValueError, match="last layer 5"):
        tiny_config(target_layer_ids=[1, 5])
    with pytest.raises(ValueError, match="outside"):
        tiny_config(target_layer_ids=[1, 6])
    with pytest.raises(ValueError, match="multiple of"):
        tiny_config(num_attention_heads=3)
    with pytest.raises(ValueError, match="sliding_window"):
        tiny_config(layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(ValueError, match="layer_types has 1 entries"):
        tiny_config(layer_types=["full_attention"])
    with pytest.raises(ValueError, match="block_size"):
        tiny_config(block_size=1)


@pytest.mark.parametrize("multiplier", [-1.0, -0.5, 0.0, float("inf"), float("nan")])
def test_output_multiplier_must_be_positive(multiplier):
    """A negative multiplier reverses every argmax of the draft: refused, in the config, in a
    config.json and in the output head alike (the reference refuses it as well)."""
    from megatron_dflash.objectives.dflash_loss import OutputHead

    with pytest.raises(ValueError, match="output_multiplier"):
        tiny_config(output_multiplier=multiplier)
    data = tiny_config(output_multiplier=2.0).to_hf_dict()
    data["dflash_config"]["output_multiplier"] = multiplier
    with pytest.raises(ValueError, match="output_multiplier"):
        DFlashConfig.from_hf_dict(data)
    with pytest.raises(ValueError, match="output_multiplier"):
        OutputHead(torch.nn.Linear(4, 8, bias=False), 8, output_multiplier=multiplier)
    assert tiny_config(output_multiplier=0.25).output_multiplier == 0.25


# ------------------------------------------------------------------------------ target layers


def test_default_target_layer_ids_match_the_published_formula():
    build = pytest.importorskip("dflash.model").build_target_layer_ids
    checked = rejected = 0
    for num_target in range(2, 65):
        for num_draft in range(1, min(num_target, 10) + 1):
            published = build(num_target, num_draft)
            valid = (
                len(set(published)) == len(published)
                and min(published) >= 0
                and max(published) < num_target - 1
            )
            if valid:
                assert default_target_layer_ids(num_target, num_draft) == published, (num_target, num_draft)
                checked += 1
            else:
                with pytest.raises(ValueError, match="duplicates|last layer|outside"):
                    default_target_layer_ids(num_target, num_draft)
                rejected += 1
    assert checked > 300 and rejected > 10
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B drafts
    assert default_target_layer_ids(28, 1) == [14]
    assert DFlashConfig(mask_token_id=0, num_target_layers=36).target_layer_ids == [1, 9, 17, 25, 33]


# ------------------------------------------------------------------------------ HF config.json


def test_hf_config_round_trip(tmp_path):
    config = tiny_config(
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=7,
        causal=True,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
        input_embedding_scale=2.0,
        extra_hf_fields={"eos_token_id": 7},
    )
    data = config.to_hf_dict()
    assert data["architectures"] == ["DFlashDraftModel"] and data["model_type"] == "qwen3"
    # Both places: the published drafters and NeMo read dflash_config, SpecForge the top level.
    assert data["dflash_config"]["block_size"] == W and data["block_size"] == W
    assert data["is_causal"] is True and data["dflash_config"]["causal"] is True and data["eos_token_id"] == 7
    assert DFlashConfig.from_hf_dict(json.loads(json.dumps(data))) == config
    config.save_pretrained(str(tmp_path))
    assert DFlashConfig.from_pretrained(str(tmp_path)) == config


def test_hf_config_reads_older_and_newer_layouts():
    base = tiny_config().to_hf_dict()
    # Older files: block_size at the top level; transformers 5: rope_parameters.
    older = json.loads(json.dumps(base))
    older["block_size"] = 8
    del older["dflash_config"]["block_size"]
    del older["rope_theta"], older["rope_scaling"]
    older["rope_parameters"] = {"rope_theta": 500000.0, "rope_type": "default"}
    config = DFlashConfig.from_hf_dict(older)
    assert config.block_size == 8 and config.rope_theta == 500000.0 and config.rope_scaling is None

    scaled = json.loads(json.dumps(base))
    del scaled["rope_theta"], scaled["rope_scaling"]
    scaled["rope_parameters"] = {
        "rope_theta": 1e6,
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = DFlashConfig.from_hf_dict(scaled)
    assert config.rope_theta == 1e6
    assert config.rope_scaling["rope_type"] == "llama3" and config.rope_scaling["factor"] == 8.0

    legacy = json.loads(json.dumps(base))
    legacy["rope_scaling"] = {"type": "linear", "factor": 2.0}
    assert DFlashConfig.from_hf_dict(legacy).rope_scaling == {"rope_type": "linear", "factor": 2.0}

    no_depth = json.loads(json.dumps(base))
    del no_depth["num_target_layers"]
    with pytest.raises(ValueError, match="num_target_layers"):
        DFlashConfig.from_hf_dict(no_depth)
