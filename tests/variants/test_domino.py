"""Domino: GRU correction head, mixed curriculum loss, decode-time walk, HF format, speculative decoding.

The checks: the loss equals a naive per-slot reference (a hand-written GRU cell, full logits,
``F.cross_entropy``) in value, gradients and metrics, for both label layouts and a pure-draft prefix;
the curriculum weight follows its schedule; ``shift_label`` labels and masks are right at sequence and
document ends; the decode-time walk computes the training logits when it commits the ground truth
(teacher forcing) and its greedy picks are what the training path's argmax would pick; a saved draft
has the published names and loads back; greedy speculative decoding with the Domino walk emits
exactly the target's greedy tokens; TP=2 equals TP=1.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from megatron_dflash.decoding import generate
from megatron_dflash.draft.body import DFlashBody, default_parallel_config
from megatron_dflash.checkpoint.hf import hf_state_dict, load_hf_checkpoint, load_hf_state_dict_into, save_hf_checkpoint
from megatron_dflash.objectives.dflash_loss import OutputHead
from megatron_dflash.plan.batch_plan import DFlashBatchPlan
from megatron_dflash.variants.domino import (
    DOMINO_ARCHITECTURE,
    DominoBody,
    DominoConfig,
    DominoHead,
    domino_block_targets,
    domino_lambda,
    domino_loss,
    domino_propose,
    domino_walk,
)

pytestmark = pytest.mark.usefixtures("one_thread")

H, V, W, S = 32, 40, 4, 16
E, G = 12, 10
ANCHORS = torch.tensor([[1, 6, 12, 0], [4, 9, 2, 11]])
VALID = torch.tensor([[True, True, True, False], [True, True, True, True]])


def tiny_config(**overrides) -> DominoConfig:
    kwargs = dict(
        hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, block_size=W, mask_token_id=5, vocab_size=V,
        num_target_layers=6, target_layer_ids=[1, 3], rope_theta=10000.0, max_position_embeddings=256,
        emb_dim=E, gru_hidden_dim=G,
    )
    kwargs.update(overrides)
    return DominoConfig(**kwargs)


def random_head(seed=0, shift_label=False, pure=0, vocab=V) -> DominoHead:
    torch.manual_seed(seed)
    head = DominoHead(H, vocab, E, G, shift_label=shift_label, pure_draft_prefix_len=pure)
    with torch.no_grad():
        head.embed_proj[2].weight.normal_(0.0, 0.5)  # starts at zero: make the correction non-trivial
    return head


def linear_head(weight: torch.Tensor, vocab: int = V) -> OutputHead:
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    layer.weight.data.copy_(weight)
    layer.requires_grad_(False)
    return OutputHead(layer, vocab)


# ================================================================================== config


def test_config_hf_round_trip_and_validation():
    cfg = tiny_config(shift_label=True, pure_draft_prefix_len=1)
    data = cfg.to_hf_dict()
    assert data["architectures"] == [DOMINO_ARCHITECTURE]
    dc = data["dflash_config"]
    assert dc["projector_type"] == "domino"
    assert (dc["emb_dim"], dc["gru_hidden_dim"], dc["shift_label"], dc["pure_draft_prefix_len"]) == (E, G, True, 1)
    assert DominoConfig.from_hf_dict(data) == cfg
    assert cfg.correction_start == 1 and tiny_config().correction_start == 1
    assert tiny_config(pure_draft_prefix_len=2).correction_start == 3
    # The first SpecForge layout: a DFlash architecture with projector_type "domino"; defaults apply.
    legacy = json.loads(json.dumps(data))
    legacy["architectures"] = ["DFlashDraftModel"]
    del legacy["dflash_config"]["shift_label"], legacy["dflash_config"]["pure_draft_prefix_len"]
    loaded = DominoConfig.from_hf_dict(legacy)
    assert (loaded.shift_label, loaded.pure_draft_prefix_len, loaded.emb_dim) == (False, 0, E)
    with pytest.raises(ValueError, match="not a Domino draft"):
        DominoConfig.from_hf_dict({**data, "architectures": ["DFlashDraftModel"], "dflash_config": {
            k: v for k, v in dc.items() if k != "projector_type"}})
    missing = json.loads(json.dumps(data))
    del missing["dflash_config"]["gru_hidden_dim"]
    with pytest.raises(ValueError, match="gru_hidden_dim"):
        DominoConfig.from_hf_dict(missing)
    with pytest.raises(ValueError, match="pure_draft_prefix_len"):
        tiny_config(pure_draft_prefix_len=W - 1)  # correction would start past the last slot
    tiny_config(shift_label=True, pure_draft_prefix_len=W - 1)  # with shift_label slot W-1 is still corrected
    with pytest.raises(ValueError, match="emb_dim"):
        tiny_config(emb_dim=0)


# ================================================================================== curriculum


def test_curriculum_schedule():
    lam = lambda step, **kw: domino_lambda(step, 1000, **{"lambda_start": 0.8, "decay_ratio": 0.5, **kw})  # noqa: E731
    assert lam(0) == pytest.approx(0.8)
    assert lam(250) == pytest.approx(0.4)  # halfway through the 500 decay steps
    assert lam(499) == pytest.approx(0.8 / 500)
    assert lam(500) == 0.0 and lam(999) == 0.0 and lam(5000) == 0.0
    assert lam(0, lambda_start=1.5) == 1.0 and lam(100, lambda_start=1.5) == pytest.approx(1.0)  # clamped
    assert lam(400, lambda_start=1.5) == pytest.approx(0.3)
    assert lam(0, lambda_start=-0.2) == 0.0
    # As the reference: the decay length is an integer number of steps (at least one), so step 0
    # keeps lambda_start even with decay_ratio 0, and 0.35 * 10 steps decay over int(3.5) = 3.
    assert lam(0, decay_ratio=0.0) == pytest.approx(0.8) and lam(1, decay_ratio=0.0) == 0.0
    assert domino_lambda(2, 10, lambda_start=0.9, decay_ratio=0.35) == pytest.approx(0.3)
    assert domino_lambda(3, 10, lambda_start=0.9, decay_ratio=0.35) == 0.0
    assert domino_lambda(9, 10, lambda_start=1.0, decay_ratio=1.0) == pytest.approx(0.1)
    for bad in (dict(step=-1), dict(decay_ratio=1.5), dict(lambda_start=float("nan"))):
        with pytest.raises(ValueError):
            kwargs = {"step": 0, "total_steps": 10, "lambda_start": 1.0, "decay_ratio": 0.5, **bad}
            domino_lambda(kwargs.pop("step"), kwargs.pop("total_steps"), **kwargs)


# ================================================================================== labels


def test_block_targets_both_layouts():
    ids = torch.arange(100, 100 + 10)[None]  # token at position t is 100 + t
    mask = torch.ones(1, 10, dtype=torch.bool)
    mask[0, 5] = False
    plan = DFlashBatchPlan.from_anchors(torch.tensor([[2, 6]]), block_size=W, input_mask=mask)
    labels, sup, prev = domino_block_targets(ids, plan, shift_label=False)
    assert labels[0].tolist() == [[103, 104, 105], [107, 108, 109]]
    assert prev[0].tolist() == [[102, 103, 104], [106, 107, 108]]
    assert sup[0].tolist() == [[True, True, False], [True, True, True]]

    labels, sup, prev = domino_block_targets(ids, plan, shift_label=True, input_mask=mask)
    assert labels[0, 0].tolist() == [103, 104, 105, 106]  # slot k predicts p + 1 + k, slot 0 included
    assert prev[0, 0].tolist() == [102, 103, 104, 105]  # the GRU starts at the anchor
    assert sup[0, 0].tolist() == [True, True, False, True]
    assert sup[0, 1].tolist() == [True, True, True, False]  # p + W = 10 is past the sequence
    # Without the input mask the last slot only needs to be inside the sequence and document.
    mask_last = mask.clone()
    mask_last[0, 6] = False
    _, sup, _ = domino_block_targets(ids, plan, shift_label=True, input_mask=mask_last)
    assert sup[0, 0, -1].item() is False
    _, sup, _ = domino_block_targets(ids, plan, shift_label=True)
    assert sup[0, 0, -1].item() is True

    # Packed documents: a label one past the block in the next document is not supervised.
    docs = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1, 1]])
    packed = DFlashBatchPlan.from_anchors(torch.tensor([[0, 4]]), block_size=W, seq_length=10, document_ids=docs)
    _, sup, _ = domino_block_targets(ids, packed, shift_label=True)
    assert sup[0, :, -1].tolist() == [False, True]


# ================================================================================== loss vs naive


def gru_cell(x, h, w_ih, w_hh):
    """PyTorch's GRU cell without biases, written out (gates r, z, n)."""
    gi, gh = w_ih @ x, w_hh @ h
    n_ = h.shape[0]
    r = torch.sigmoid(gi[:n_] + gh[:n_])
    z = torch.sigmoid(gi[n_ : 2 * n_] + gh[n_ : 2 * n_])
    n = torch.tanh(gi[2 * n_ :] + r * gh[2 * n_ :])
    return (1 - z) * n + z * h


def naive_domino(hidden, plan, input_ids, head_weight, domino, emb_weight, *, lam, decay_gamma, input_mask):
    """Per-slot reference: (loss, weight_sum, final correct, base correct, final acceptance, base acceptance)."""
    B, N = plan.anchor_positions.shape
    shift = domino.shift_label
    w_ih, w_hh = domino.prefix_gru.weight_ih_l0, domino.prefix_gru.weight_hh_l0
    w1, w2 = domino.embed_proj[0].weight, domino.embed_proj[2].weight
    slots = range(0, W) if shift else range(1, W)
    final_sum = base_sum = hidden.new_zeros(())
    weight_sum = 0.0
    stats = {"final": [0, 0.0], "base": [0, 0.0]}
    for b in range(B):
        for n in range(N):
            if not plan.block_valid[b, n]:
                continue
            p = int(plan.anchor_positions[b, n])
            state = torch.zeros(G)
            run = {"final": [0, False], "base": [0, False]}
            for j, k in enumerate(slots):
                target_pos = p + k + (1 if shift else 0)
                state = gru_cell(emb_weight[input_ids[b, target_pos - 1]], state, w_ih, w_hh)
                z = hidden[b, n, k]
                base = (z @ head_weight.T)
                base[V:] = float("-inf")
                final = base
                if k >= domino.correction_start:
                    delta = F.silu(w1 @ torch.cat([z, state])) @ w2.T
                    final = base + F.pad(delta, (0, base.shape[0] - V))
                supervised = target_pos < S and bool(input_mask[b, target_pos])
                used = j < W - 1  # decoding proposes W - 1 tokens
                if not supervised:
                    for name in run:
                        run[name][1] = run[name][1] or used
                    continue
                label = input_ids[b, target_pos]
                w = 1.0 if decay_gamma is None else math.exp(-j / decay_gamma)
                final_sum = final_sum + w * F.cross_entropy(final[None], label[None])
                base_sum = base_sum + w * F.cross_entropy(base[None], label[None])
                weight_sum += w
                for name, logits in (("final", final), ("base", base)):
                    ok = bool(logits.argmax() == label)
                    stats[name][0] += ok
                    if used:
                        if ok and not run[name][1]:
                            run[name][0] += 1
                        else:
                            run[name][1] = True
            first = p + (slots[0] + (1 if shift else 0))
            if first < S and bool(input_mask[b, first]):
                for name in run:
                    stats[name][1] += run[name][0] + 1
    loss = (1 - lam) * final_sum + lam * base_sum
    return loss, weight_sum, stats


CASES = {
    "plain": dict(shift=False, pure=0, lam=0.3, gamma=None, chunk=None),
    "plain-prefix-chunked": dict(shift=False, pure=1, lam=0.0, gamma=2.0, chunk=5),
    "shift": dict(shift=True, pure=0, lam=1.0, gamma=3.0, chunk=7),
    "shift-prefix": dict(shift=True, pure=1, lam=0.6, gamma=None, chunk=4),
}


def loss_problem(seed, shift, pure):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.ones(2, S, dtype=torch.bool)
    mask[0, 8] = mask[1, 15] = mask[1, 3] = False
    plan = DFlashBatchPlan.from_anchors(ANCHORS, block_size=W, input_mask=mask, block_valid=VALID)
    input_ids = torch.randint(V, (2, S), generator=gen)
    head_weight = torch.randn(V + 3, H, generator=gen)  # padded head
    emb_weight = torch.randn(V, H, generator=gen)
    hidden = torch.randn(2, ANCHORS.shape[1], W, H, generator=gen)
    hidden[~VALID] = 0
    domino = random_head(seed, shift_label=shift, pure=pure)
    return plan, mask, input_ids, head_weight, emb_weight, hidden, domino


@pytest.mark.parametrize("case", list(CASES))
def test_loss_matches_naive_reference(case):
    c = CASES[case]
    plan, mask, input_ids, head_weight, emb_weight, hidden, domino = loss_problem(3, c["shift"], c["pure"])
    embedding = torch.nn.Embedding.from_pretrained(emb_weight)
    hidden = hidden.requires_grad_(True)
    out = domino_loss(
        hidden, plan, input_ids, linear_head(head_weight), domino, embedding,
        lambda_base=c["lam"], decay_gamma=c["gamma"], input_mask=mask, chunk_slots=c["chunk"],
    )
    out.loss_sum.backward()
    grads = {n: p.grad.clone() for n, p in domino.named_parameters()}
    grad_hidden = hidden.grad.clone()

    domino.zero_grad()
    ref_hidden = hidden.detach().clone().requires_grad_(True)
    ref, ref_weight, stats = naive_domino(
        ref_hidden, plan, input_ids, head_weight, domino, emb_weight,
        lam=c["lam"], decay_gamma=c["gamma"], input_mask=mask,
    )
    ref.backward()
    torch.testing.assert_close(out.loss_sum, ref, rtol=1e-5, atol=1e-5)
    assert float(out.weight_sum) == pytest.approx(ref_weight, rel=1e-6)
    torch.testing.assert_close(grad_hidden, ref_hidden.grad, rtol=1e-4, atol=1e-6)
    for name, p in domino.named_parameters():
        if c["lam"] == 1.0:
            assert grads[name].abs().max() == 0, name  # only the base CE is trained
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    m = out.metrics
    assert (float(m.correct_tokens), float(m.acceptance_sum)) == (stats["final"][0], stats["final"][1])
    assert (float(m.base_correct_tokens), float(m.base_acceptance_sum)) == (stats["base"][0], stats["base"][1])
    assert float(m.loss_weight_sum) == pytest.approx(ref_weight, rel=1e-6)
    mixed = (1 - c["lam"]) * m.final_loss_sum + c["lam"] * m.base_loss_sum
    assert float(mixed) == pytest.approx(float(out.loss_sum), rel=1e-5)
    assert out.lambda_base == c["lam"]


@pytest.mark.parametrize("case", ["plain-prefix-chunked", "shift-prefix"])
def test_fused_loss_equals_the_recomputing_path(case):
    """The fused head loss (frozen head) against the per-chunk recomputing path: loss, every gradient, metrics."""
    c = CASES[case]
    plan, mask, input_ids, head_weight, emb_weight, hidden, domino = loss_problem(5, c["shift"], c["pure"])
    embedding = torch.nn.Embedding.from_pretrained(emb_weight)
    results = []
    for fused in (True, False):
        domino.zero_grad()
        h = hidden.clone().requires_grad_(True)
        out = domino_loss(h, plan, input_ids, linear_head(head_weight), domino, embedding, lambda_base=0.4,
                          decay_gamma=c["gamma"], input_mask=mask, chunk_slots=c["chunk"], fused=fused)
        (-1.5 * out.loss_sum).backward()  # a non-unit incoming gradient
        results.append((out, h.grad.clone(), {n: p.grad.clone() for n, p in domino.named_parameters()}))
    (fused_out, fused_gh, fused_g), (ref_out, ref_gh, ref_g) = results
    torch.testing.assert_close(fused_out.loss_sum, ref_out.loss_sum, rtol=1e-5, atol=1e-5)
    assert torch.equal(fused_out.metrics._stack()[:6], ref_out.metrics._stack()[:6])
    torch.testing.assert_close(fused_out.metrics._stack()[6:], ref_out.metrics._stack()[6:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_gh, ref_gh, rtol=1e-4, atol=1e-6)
    assert ref_g["embed_proj.2.weight"].abs().max() > 0
    for name, grad in ref_g.items():
        torch.testing.assert_close(fused_g[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_untrained_head_is_the_backbone():
    """embed_proj.2 starts at zero: final logits == base logits, the loss is the DFlash CE."""
    plan, mask, input_ids, head_weight, emb_weight, hidden, _ = loss_problem(4, False, 0)
    domino = DominoHead(H, V, E, G)
    out = domino_loss(hidden, plan, input_ids, linear_head(head_weight), domino,
                      torch.nn.Embedding.from_pretrained(emb_weight), lambda_base=0.5)
    m = out.metrics
    assert float(m.final_loss_sum) == pytest.approx(float(m.base_loss_sum), rel=1e-6)
    assert m.correct_tokens == m.base_correct_tokens and m.acceptance_sum == m.base_acceptance_sum
    body = DominoBody(tiny_config(), attention_backend="dense")
    plain = DFlashBody(tiny_config(), attention_backend="dense")
    backbone = {k: v for k, v in body.state_dict().items() if not k.startswith(("prefix_gru", "embed_proj"))}
    plain.load_state_dict(backbone)
    taps, blocks = torch.randn(2, S, 2 * H), torch.randn(2, ANCHORS.shape[1], W, H)
    with torch.no_grad():
        torch.testing.assert_close(body(taps, blocks, plan), plain(taps, blocks, plan))


# ================================================================================== decoding


@pytest.mark.parametrize("shift, pure", [(False, 0), (False, 1), (True, 0), (True, 1)])
def test_walk_equals_training_path(shift, pure):
    """Committing the ground truth, the walk's logits are the training logits (teacher forcing), and a
    greedy walk proposes exactly what the training path's argmax predicts after its own picks."""
    gen = torch.Generator().manual_seed(6)
    domino = random_head(7, shift_label=shift, pure=pure)
    head_weight = torch.randn(V, H, generator=gen)
    head = linear_head(head_weight)
    embedding = torch.nn.Embedding.from_pretrained(torch.randn(V, H, generator=gen))
    B = 3
    hidden = torch.randn(B, W, H, generator=gen)  # one block per row, anchor at position 0, S = W
    anchors = torch.randint(V, (B,), generator=gen)
    plan = DFlashBatchPlan.from_anchors(torch.zeros(B, 1, dtype=torch.int64), block_size=W, seq_length=W)
    slots = list(domino.decode_slots(W))
    corrected = torch.tensor([k >= domino.correction_start for k in slots])
    base = head.local_logits(hidden[:, slots[0] : slots[-1] + 1])
    embed = lambda ids: embedding(ids)  # noqa: E731

    def training_ce(tokens):
        """Per-row training-path CE (lambda 0, uniform weights) and metrics of the block [anchor, tokens]."""
        ids = torch.cat([anchors[:, None], tokens], dim=1)
        return domino_loss(hidden[:, None], plan, ids, head, domino, embedding, lambda_base=0.0, chunk_slots=2)

    # Teacher forcing with arbitrary ground truth.
    truth = torch.randint(V, (B, W - 1), generator=gen)
    _, _, logits = domino_walk(hidden[:, slots[0] : slots[-1] + 1], base, anchors, domino, embed,
                               corrected=corrected, forced_tokens=truth)
    out = training_ce(truth)
    expected = (torch.logsumexp(logits, -1) - logits.gather(-1, truth[..., None])[..., 0]).sum()
    torch.testing.assert_close(out.loss_sum, expected, rtol=1e-5, atol=1e-5)
    assert float(out.metrics.correct_tokens) == int((logits.argmax(-1) == truth).sum())

    # The greedy walk's picks are the training path's argmax: full acceptance against them.
    tokens, probs = domino_propose(hidden, anchors, domino, head, embedding)
    assert probs is None and tokens.shape == (B, W - 1)
    m = training_ce(tokens).metrics
    assert float(m.correct_tokens) == B * (W - 1) and float(m.acceptance_length) == W
    # The correction matters here: the backbone alone would propose something else.
    assert not torch.equal(tokens, base.argmax(-1))


def test_sampled_walk_returns_its_proposal():
    domino = random_head(2)
    gen = torch.Generator().manual_seed(1)
    head = linear_head(torch.randn(V + 2, H, generator=gen))
    embedding = torch.nn.Embedding.from_pretrained(torch.randn(V, H, generator=gen))
    hidden = torch.randn(4, W, H, generator=gen)
    anchors = torch.randint(V, (4,), generator=gen)
    tokens, probs = domino_propose(hidden, anchors, domino, head, embedding, temperature=0.7,
                                   generator=torch.Generator().manual_seed(0))
    assert probs.shape == (4, W - 1, V + 2)
    torch.testing.assert_close(probs.sum(-1), torch.ones(4, W - 1))
    assert (probs[..., V:] == 0).all() and (probs.gather(-1, tokens[..., None]) > 0).all()
    # Each step's distribution is the tempered softmax of the logits after the sampled prefix.
    slots = list(domino.decode_slots(W))
    base = head.local_logits(hidden[:, 1:])
    _, _, logits = domino_walk(hidden[:, 1:], base, anchors, domino, embedding, forced_tokens=tokens)
    torch.testing.assert_close(probs, torch.softmax(logits / 0.7, -1))
    assert slots == [1, 2, 3]


# ================================================================================== HF format


def test_checkpoint_published_names_and_round_trip(tmp_path):
    cfg = tiny_config(shift_label=True, pure_draft_prefix_len=1)
    torch.manual_seed(0)
    body = DominoBody(cfg, attention_backend="dense")
    with torch.no_grad():
        body.embed_proj[2].weight.normal_(0.0, 0.3)
    assert body.domino_head.embed_proj is body.embed_proj and body.domino_head.shift_label
    save_hf_checkpoint(body, str(tmp_path / "domino"))
    with open(tmp_path / "domino" / "config.json") as f:
        data = json.load(f)
    assert data["architectures"] == [DOMINO_ARCHITECTURE] and data["dflash_config"]["projector_type"] == "domino"
    with safe_open(str(tmp_path / "domino" / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert shapes["prefix_gru.weight_ih_l0"] == (3 * G, H)
    assert shapes["prefix_gru.weight_hh_l0"] == (3 * G, G)
    assert shapes["embed_proj.0.weight"] == (E, H + G)
    assert shapes["embed_proj.2.weight"] == (V, E)
    assert "fc.weight" in shapes and not any(k.startswith(("domino_head", "model.")) for k in shapes)

    loaded = load_hf_checkpoint(str(tmp_path / "domino"), attention_backend="dense")
    assert dataclasses.replace(loaded.config, extra_hf_fields={}) == body.config
    for name, tensor in body.state_dict().items():
        if isinstance(tensor, torch.Tensor):  # megatron's `_extra_state` entries are not
            assert torch.equal(loaded.state_dict()[name], tensor), name
    # The same weights copied into a body of the same config (published names, full tensors).
    copy = DominoBody(cfg, default_parallel_config(perform_initialization=False), attention_backend="dense")
    load_hf_state_dict_into(copy, hf_state_dict(body))
    assert torch.equal(copy.embed_proj[2].weight, body.embed_proj[2].weight)
    # The loaded head is live: same proposals.
    gen = torch.Generator().manual_seed(2)
    head = linear_head(torch.randn(V, H, generator=gen))
    embedding = torch.nn.Embedding.from_pretrained(torch.randn(V, H, generator=gen))
    hidden, anchors = torch.randn(2, W, H, generator=gen), torch.tensor([3, 8])
    assert torch.equal(loaded.propose_block(hidden, anchors, head, embedding)[0],
                       body.propose_block(hidden, anchors, head, embedding)[0])
    # A backbone built with a Domino config has no head: it is refused, not written as a Domino file.
    with pytest.raises(ValueError, match="DominoBody"):
        save_hf_checkpoint(DFlashBody(tiny_config()), str(tmp_path / "x"))


# ================================================================================== spec_generate


def qwen3_target(vocab: int, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
        rope_theta=10000.0,
    )
    return Qwen3ForCausalLM(config).eval()


@pytest.mark.parametrize("shift", [False, True], ids=["plain", "shift_label"])
def test_greedy_spec_decoding_equals_target_greedy(shift, monkeypatch):
    pytest.importorskip("transformers")
    vocab, new = 96, 20
    target = qwen3_target(vocab)
    cfg = tiny_config(hidden_size=64, vocab_size=vocab, mask_token_id=vocab - 1, num_target_layers=4,
                      target_layer_ids=[0, 2], head_dim=16, shift_label=shift, pure_draft_prefix_len=1)
    torch.manual_seed(1)
    draft = DominoBody(cfg, attention_backend="chunked").eval()
    with torch.no_grad():
        draft.embed_proj[2].weight.normal_(0.0, 1.0)
    # Count the proposals and how often the correction changed the backbone's pick.
    calls = {"n": 0, "changed": 0}
    propose = draft.propose_block

    def counting(hidden, anchors, head, embedding, temperature=0.0, generator=None):
        tokens, probs = propose(hidden, anchors, head, embedding, temperature, generator)
        slots = list(draft.domino_head.decode_slots(cfg.block_size))
        backbone = head.local_logits(hidden[:, slots[0] : slots[-1] + 1]).argmax(-1)
        calls["n"] += 1
        calls["changed"] += int((backbone != tokens).any())
        return tokens, probs

    monkeypatch.setattr(draft, "propose_block", counting)
    prompts = [[5, 17, 3, 40, 22], [9, 1, 33, 60, 2, 71, 8]]
    out = generate.spec_generate(target, draft, prompts, max_new_tokens=new)
    for b, prompt in enumerate(prompts):
        with torch.no_grad():
            reference = target.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new,
                                        do_sample=False)[0].tolist()
        assert out.sequence(b) == reference, f"row {b}"
    assert calls["n"] == out.num_draft_forwards > 0 and calls["changed"] > 0
    assert all(1 + sum(a) == new for a in out.acceptance_lengths)


def test_sampled_spec_decoding_runs_with_the_walks_proposals(monkeypatch):
    """Sampling: the walk's proposal distributions reach the rejection sampler (a smoke run; the
    distributions themselves are checked in `test_sampled_walk_returns_its_proposal`)."""
    pytest.importorskip("transformers")
    vocab, new = 96, 12
    target = qwen3_target(vocab, seed=2)
    cfg = tiny_config(hidden_size=64, vocab_size=vocab, mask_token_id=vocab - 1, num_target_layers=4,
                      target_layer_ids=[0, 2], head_dim=16)
    torch.manual_seed(3)
    draft = DominoBody(cfg, attention_backend="chunked").eval()
    with torch.no_grad():
        draft.embed_proj[2].weight.normal_(0.0, 1.0)
    seen = []
    propose = draft.propose_block

    def recording(hidden, anchors, head, embedding, temperature=0.0, generator=None):
        tokens, probs = propose(hidden, anchors, head, embedding, temperature, generator)
        seen.append(probs)
        return tokens, probs

    monkeypatch.setattr(draft, "propose_block", recording)
    out = generate.spec_generate(target, draft, [[5, 17, 3], [9, 1, 33, 60]], max_new_tokens=new,
                                 temperature=0.8, generator=torch.Generator().manual_seed(0))
    assert seen and all(p is not None and p.shape[1:] == (cfg.block_size - 1, vocab) for p in seen)
    assert all(1 + sum(a) == new for a in out.acceptance_lengths)
    assert int(out.tokens.max()) < vocab


# ================================================================================== tensor parallel


def _domino_step(head, domino, problem, lam=0.4):
    plan, mask, input_ids, _, emb_weight, hidden, _ = problem
    hidden = hidden.clone().requires_grad_(True)
    out = domino_loss(hidden, plan, input_ids, head, domino, torch.nn.Embedding.from_pretrained(emb_weight),
                      lambda_base=lam, decay_gamma=2.0, input_mask=mask, chunk_slots=5)
    out.loss_sum.backward()
    grads = {n: p.grad for n, p in domino.named_parameters()}
    return out.loss_sum.detach(), out.metrics._stack(), hidden.grad, grads


def _tp2_rank(rank, world_size, problem, domino_state):
    from megatron.core import parallel_state

    from megatron_dflash.draft.layers import column_parallel

    group = parallel_state.get_tensor_model_parallel_group()
    head_weight = problem[3]  # [V + 3, H]: pad the vocabulary to a multiple of TP like megatron
    padded = torch.cat([head_weight, torch.zeros(1, H)])  # 44 rows, 22 per rank: rank 1 holds padding
    layer = column_parallel(H, padded.shape[0], bias=False, parallel_config=default_parallel_config(),
                            tp_group=group, std=0.02)
    layer.weight.data.copy_(padded.chunk(world_size, 0)[rank])
    layer.requires_grad_(False)
    domino = DominoHead(H, V, E, G, shift_label=True, pure_draft_prefix_len=1)
    domino.load_state_dict(domino_state)
    return _domino_step(OutputHead(layer, V, tp_group=group), domino, problem)


def test_tensor_parallel_matches_single_rank(tp_pool):
    problem = loss_problem(8, True, 1)
    domino = problem[-1]
    state = {k: v.clone() for k, v in domino.state_dict().items()}
    loss, metrics, grad_hidden, grads = _domino_step(linear_head(problem[3]), domino, problem)
    for r_loss, r_metrics, r_grad_hidden, r_grads in tp_pool(2).run(_tp2_rank, problem, state):
        torch.testing.assert_close(r_loss, loss, rtol=1e-5, atol=1e-5)
        assert torch.equal(r_metrics[:6], metrics[:6])  # counts exactly, loss sums to rounding
        torch.testing.assert_close(r_metrics[6:], metrics[6:], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r_grad_hidden, grad_hidden, rtol=1e-4, atol=1e-6)
        for name, grad in grads.items():
            torch.testing.assert_close(r_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
