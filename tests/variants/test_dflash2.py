"""DFlash 2: in-block convolutions, candidate selector, objective, HF format, reference parity.

The key checks: an untrained DFlash 2 body equals the DFlash body with the same backbone; the
convolutions never cross a block; a saved DFlash 2 directory loads in the reference
`dflash.model.DFlash2DraftModel` with the same hidden states and the same proposed paths; the
objective equals a naive per-slot reference (values and gradients); under TP=2 everything
matches TP=1.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from megatron_dflash.draft.body import DFlashBody, default_parallel_config
from megatron_dflash.checkpoint.hf import hf_state_dict, load_hf_checkpoint, load_hf_state_dict_into, save_hf_checkpoint
from megatron_dflash.objectives.dflash_loss import OutputHead, acceptance_lengths, dflash_loss
from megatron_dflash.common.parallel import SingleRankGroup
from megatron_dflash.plan.batch_plan import DFlashBatchPlan
from megatron_dflash.variants.dflash2 import (
    DFLASH2_ARCHITECTURE,
    CandidateSelector,
    DFlash2Body,
    DFlash2Config,
    GroupedDynamicCausalConv,
    dflash2_loss,
    topk_vocab_parallel,
)

from builders import tiny_draft_kwargs

TOL = 1e-5
SEQ = 20
ANCHORS = torch.tensor([[2, 7, 12, 16], [5, 0, 14, 9]])


def tiny_config(**overrides) -> DFlash2Config:
    selector = dict(vocab_size=48, conv_kernel_size=2, conv_group_size=8, selector_rank=8, selector_top_k=6)
    return DFlash2Config(**tiny_draft_kwargs(**{**selector, **overrides}))


def randomize_dflash2(module: torch.nn.Module, seed: int) -> None:
    """Non-identity convolutions, a non-trivial selector and norms away from 1, so that every
    DFlash 2 tensor matters (a test that passes with the identity proves nothing)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(shape, scale):
        return torch.randn(shape, generator=gen) * scale

    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("base_kernel"):
                param.copy_(rand(param.shape, 0.3))
                param[:, 0] += 1.0
            elif name.endswith("kernel_projection.weight"):
                param.copy_(rand(param.shape, 0.05))
            elif name.endswith("_codebook"):
                param.copy_(rand(param.shape, 0.7))
            elif name.endswith("hidden_projection.weight"):
                param.copy_(rand(param.shape, 0.3))
            elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                param.copy_(0.5 + torch.rand(param.shape, generator=gen))


def random_inputs(config, seed: int = 7, block_valid=None):
    gen = torch.Generator().manual_seed(seed)
    B, N = ANCHORS.shape
    taps = torch.randn(B, SEQ, config.num_taps * config.hidden_size, generator=gen)
    blocks = torch.randn(B, N, config.block_size, config.hidden_size, generator=gen)
    plan = DFlashBatchPlan.from_anchors(ANCHORS, block_size=config.block_size, seq_length=SEQ, block_valid=block_valid)
    return taps, blocks, plan


# ================================================================================== config


def test_config_hf_round_trip():
    cfg = tiny_config()
    data = cfg.to_hf_dict()
    assert data["architectures"] == [DFLASH2_ARCHITECTURE]
    assert data["is_causal"] is False
    for name, value in (("conv_kernel_size", 2), ("conv_group_size", 8), ("selector_rank", 8), ("selector_top_k", 6)):
        assert data["dflash_config"][name] == value
    assert DFlash2Config.from_hf_dict(data) == cfg
    # Even a generic saver asking for the plain DFlash name writes DFlash 2.
    assert cfg.to_hf_dict("DFlashDraftModel")["architectures"] == [DFLASH2_ARCHITECTURE]

    # Fields at the top level are read too (the reference looks there second).
    flat = json.loads(json.dumps(data))
    for name in ("conv_group_size", "selector_rank"):
        flat[name] = flat["dflash_config"].pop(name)
    assert DFlash2Config.from_hf_dict(flat) == cfg

    missing = json.loads(json.dumps(data))
    del missing["dflash_config"]["selector_top_k"]
    with pytest.raises(ValueError, match="selector_top_k"):
        DFlash2Config.from_hf_dict(missing)
    plain = dict(data, architectures=["DFlashDraftModel"])
    with pytest.raises(ValueError, match="not a DFlash 2"):
        DFlash2Config.from_hf_dict(plain)
    # A file without is_causal keeps the reference's per-layer default.
    undirected = json.loads(json.dumps(data))
    del undirected["is_causal"], undirected["dflash_config"]["causal"]
    assert DFlash2Config.from_hf_dict(undirected).causal is None


def test_config_validation():
    with pytest.raises(ValueError, match="conv_group_size"):
        tiny_config(conv_group_size=7)
    with pytest.raises(ValueError, match="selector_top_k"):
        tiny_config(selector_top_k=49)
    with pytest.raises(ValueError, match="selector_rank"):
        tiny_config(selector_rank=0)


# ================================================================================== convolution


def naive_convolve(x, dynamic, base, group_size):
    """Slot-by-slot: `out[w] = sum_j (base[j] + dynamic[w, j, group]) * x[w - j]`, `w - j >= 0`."""
    *lead, W, H = x.shape
    K = base.shape[0]
    groups = torch.arange(H) // group_size
    out = torch.zeros_like(x)
    for w in range(W):
        for j in range(K):
            if w - j < 0:
                continue
            coefficient = base[j] + dynamic[..., w, j, :][..., groups]
            out[..., w, :] += coefficient * x[..., w - j, :]
    return out


def random_conv(hidden=64, kernel=2, group=8, seed=0) -> GroupedDynamicCausalConv:
    conv = GroupedDynamicCausalConv(hidden, kernel, group)
    randomize_dflash2(conv, seed)
    return conv


def test_conv_identity_init():
    conv = GroupedDynamicCausalConv(64, 2, 8)
    x = torch.randn(2, 3, 4, 64)
    y = torch.randn(2, 3, 4, 64)
    out, coefficients = conv.prepare(x)
    assert torch.equal(out, x)
    assert torch.equal(coefficients, torch.zeros(2, 3, 4, 2, 8))
    assert torch.equal(conv.finish(y, coefficients), y)
    assert conv.base_kernel.shape == (2, 2, 64)
    assert conv.kernel_projection.weight.shape == (2 * 2 * 64 // 8, 64)


@pytest.mark.parametrize("kernel", [2, 3])
def test_conv_matches_naive_loop_and_reference(kernel):
    torch.manual_seed(1)
    conv = random_conv(kernel=kernel)
    x = torch.randn(2, 3, 4, 64)
    y = torch.randn(2, 3, 4, 64)
    dynamic = conv.kernel_projection(x).view(2, 3, 4, 2, kernel, 8)
    out, coefficients = conv.prepare(x)
    torch.testing.assert_close(out, naive_convolve(x, dynamic[..., 0, :, :], conv.base_kernel[0], 8), rtol=0, atol=1e-6)
    torch.testing.assert_close(
        conv.finish(y, coefficients), naive_convolve(y, dynamic[..., 1, :, :], conv.base_kernel[1], 8), rtol=0, atol=1e-6
    )

    # The reference module on its own layout ([batch, positions, hidden], one block per row).
    model = pytest.importorskip("dflash.model")
    ref = model.GroupedDynamicCausalConv(64, kernel, 8)
    ref.load_state_dict(conv.state_dict())
    ref_out, ref_coefficients = ref.prepare(x.reshape(6, 4, 64))
    torch.testing.assert_close(out.reshape(6, 4, 64), ref_out, rtol=0, atol=1e-6)
    torch.testing.assert_close(conv.finish(y, coefficients).reshape(6, 4, 64), ref.finish(y.reshape(6, 4, 64), ref_coefficients), rtol=0, atol=1e-6)


def test_conv_never_crosses_blocks():
    conv = random_conv()
    x = torch.randn(2, 3, 4, 64)
    y = torch.randn(2, 3, 4, 64)
    out, c = conv.prepare(x)
    fin = conv.finish(y, c)
    x2, y2 = x.clone(), y.clone()
    x2[1, 1] += torch.randn(4, 64)
    y2[1, 1] += torch.randn(4, 64)
    out2, c2 = conv.prepare(x2)
    fin2 = conv.finish(y2, c2)
    changed = torch.zeros(2, 3, dtype=torch.bool)
    changed[1, 1] = True
    assert torch.equal(out[~changed], out2[~changed]) and torch.equal(fin[~changed], fin2[~changed])
    assert not torch.equal(out[1, 1], out2[1, 1])
    # Slot 0 of a block reads no predecessor, in particular not the last slot of the previous block.
    x3 = x.clone()
    x3[0, 0, -1] += 1.0
    assert torch.equal(conv.prepare(x3)[0][0, 1], out[0, 1])


# ================================================================================== body


def test_untrained_dflash2_body_equals_dflash_body():
    cfg = tiny_config()
    taps, blocks, plan = random_inputs(cfg, block_valid=torch.tensor([[True, True, False, True], [True, True, True, True]]))
    torch.manual_seed(0)
    dflash = DFlashBody(cfg, attention_backend="dense").eval()
    dflash2 = DFlash2Body(cfg, attention_backend="dense").eval()
    missing, unexpected = dflash2.load_state_dict(dflash.state_dict(), strict=False)
    assert not unexpected and all("_conv." in k or k.startswith("candidate_selector.") for k in missing)
    with torch.no_grad():
        expected = dflash(taps, blocks, plan)
        got = dflash2(taps, blocks, plan)
    assert torch.equal(got, expected)
    # The identity selector: scores equal the backbone logits.
    logits = torch.randn(2, 3, 48)
    values, ids = torch.topk(logits, 6)
    scores = dflash2.candidate_selector.score(torch.randn(2, 3, 64), values, ids, torch.randint(48, (2, 3)))
    assert torch.equal(scores, values)


def test_body_blocks_are_independent():
    cfg = tiny_config()
    torch.manual_seed(0)
    body = DFlash2Body(cfg, attention_backend="chunked").eval()
    randomize_dflash2(body, 3)
    taps, blocks, plan = random_inputs(cfg)
    blocks2 = blocks.clone()
    blocks2[0, 1] += torch.randn(cfg.block_size, cfg.hidden_size)
    with torch.no_grad():
        out, out2 = body(taps, blocks, plan), body(taps, blocks2, plan)
    others = torch.ones(2, 4, dtype=torch.bool)
    others[0, 1] = False
    assert torch.equal(out[others], out2[others])
    assert not torch.allclose(out[0, 1], out2[0, 1])


# ================================================================================== selector


def random_selector(vocab=48, hidden=64, rank=8, top_k=6, seed=0) -> CandidateSelector:
    selector = CandidateSelector(vocab, hidden, rank, top_k)
    randomize_dflash2(selector, seed)
    return selector


def test_selector_score_matches_formula():
    selector = random_selector()
    hidden = torch.randn(3, 5, 64)
    ids = torch.stack([torch.randperm(48)[:6] for _ in range(15)]).view(3, 5, 6)
    unary = torch.randn(3, 5, 6)
    predecessor = torch.randint(48, (3, 5))
    got = selector.score(hidden, unary, ids, predecessor)
    A, Bc, P = selector.predecessor_codebook, selector.successor_codebook, selector.hidden_projection.weight
    expected = torch.empty(3, 5, 6)
    for i in range(3):
        for t in range(5):
            gate = A[predecessor[i, t]] * (P @ hidden[i, t])
            for k in range(6):
                expected[i, t, k] = unary[i, t, k] + (gate * Bc[ids[i, t, k]]).sum()
    torch.testing.assert_close(got, expected.detach(), rtol=1e-5, atol=1e-5)


def test_zero_successor_walk_is_the_argmax():
    selector = CandidateSelector(48, 64, 8, 6)  # fresh: successor codebook zero
    assert torch.count_nonzero(selector.successor_codebook) == 0
    logits = torch.randn(4, 5, 48)
    path, ids, probs = selector.walk(torch.randn(4, 5, 64), logits, torch.randint(48, (4,)), 0.0)
    assert torch.equal(path, logits.argmax(-1))
    assert probs is None and ids.shape == (4, 5, 6)


def test_sampled_walk_returns_the_proposal_distribution():
    selector = random_selector()
    hidden, logits, anchor = torch.randn(4, 5, 64), torch.randn(4, 5, 48) * 3, torch.randint(48, (4,))
    T = 0.7
    path, ids, q = selector.walk(hidden, logits, anchor, T, generator=torch.Generator().manual_seed(5))
    again, _, _ = selector.walk(hidden, logits, anchor, T, generator=torch.Generator().manual_seed(5))
    assert torch.equal(path, again)
    torch.testing.assert_close(q.sum(-1), torch.ones(4, 5))
    assert bool((ids == path[..., None]).any(-1).all())  # every pick is a candidate
    unary = logits.gather(-1, ids)
    predecessors = torch.cat([anchor[:, None], path[:, :-1]], dim=1)
    scores = selector.score(hidden, unary, ids, predecessors)
    torch.testing.assert_close(q, torch.softmax(scores / T, dim=-1))
    # Greedy below the threshold; a negative temperature is refused.
    greedy, _, none = selector.walk(hidden, logits, anchor, 1e-6)
    assert none is None
    assert torch.equal(greedy, selector.walk(hidden, logits, anchor, 0.0)[0])
    with pytest.raises(ValueError, match="temperature"):
        selector.walk(hidden, logits, anchor, -1.0)


def test_topk_vocab_parallel_single_rank():
    logits = torch.randn(3, 5, 40, requires_grad=True)
    values, ids = topk_vocab_parallel(logits, 7, 0, SingleRankGroup())
    expected_values, expected_ids = torch.topk(logits, 7)
    assert torch.equal(values, expected_values) and torch.equal(ids, expected_ids)
    values.sum().backward()
    assert logits.grad.sum() == 3 * 5 * 7
    with pytest.raises(ValueError, match="exceeds"):
        topk_vocab_parallel(logits, 41, 0, SingleRankGroup())


@pytest.mark.parametrize("vocab", [32000, 151936, 4096 * 3 + 7], ids=["32000", "151936", "no-group-divides"])
def test_topk_of_long_rows_equals_torch_topk(vocab):
    """The two-pass top-k of long rows (group maxima, then the best groups' columns) is torch.topk's:
    same values in the same order, same ids, on random rows and on rows whose top values crowd into
    one group or tie; values keep their gradient."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(2, 3, vocab, generator=gen)
    logits[0, 0, 128:128 + 20] += 10.0  # the whole top-k inside one or two groups
    logits[0, 1, ::997] = 50.0  # tied top values in different groups
    logits.requires_grad_()
    values, ids = topk_vocab_parallel(logits, 16, 0, SingleRankGroup())
    expected_values, expected_ids = torch.topk(logits.detach(), 16)
    assert torch.equal(values.detach(), expected_values)
    untied = torch.ones(2, 3, dtype=torch.bool)
    untied[0, 1] = False
    assert torch.equal(ids[untied], expected_ids[untied])
    assert torch.equal(logits.detach().gather(-1, ids), values.detach())  # ties: ids of equal values
    assert ids[0, 1].unique().numel() == 16
    values.sum().backward()
    assert logits.grad.sum() == 2 * 3 * 16 and bool((logits.grad.gather(-1, ids) == 1).all())


# ================================================================================== reference parity


@pytest.mark.parametrize("layer_types", [None, ["sliding_attention", "full_attention"]])
def test_saved_dflash2_matches_reference(tmp_path, layer_types):
    model = pytest.importorskip("dflash.model", reason="the reference modeling code (`dflash`) is not installed")
    extra = {} if layer_types is None else dict(layer_types=layer_types, sliding_window=3)
    cfg = tiny_config(**extra)
    torch.manual_seed(0)
    body = DFlash2Body(cfg, attention_backend="chunked").eval()
    randomize_dflash2(body, 11)
    save_hf_checkpoint(body, str(tmp_path / "draft"))

    with open(tmp_path / "draft" / "config.json") as f:
        assert json.load(f)["architectures"] == [DFLASH2_ARCHITECTURE]
    with safe_open(str(tmp_path / "draft" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "candidate_selector.predecessor_codebook" in names and "candidate_selector.successor_codebook" in names
    assert "layers.1.mlp_conv.kernel_projection.weight" in names and not any(n.endswith("codebook.weight") for n in names)

    ref, info = model.DFlash2DraftModel.from_pretrained(str(tmp_path / "draft"), dtype=torch.float32, output_loading_info=True)
    ref = ref.eval()
    assert not info["missing_keys"] and not info["unexpected_keys"], info

    taps, blocks, plan = random_inputs(cfg)
    head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    torch.nn.init.normal_(head.weight, std=0.5)
    anchor_tokens = torch.randint(cfg.vocab_size, ANCHORS.shape)
    with torch.no_grad():
        ours = body(taps, blocks, plan)
        worst = 0.0
        for row in range(ANCHORS.shape[0]):
            for blk in range(ANCHORS.shape[1]):
                p = int(ANCHORS[row, blk])
                expected = ref(
                    position_ids=torch.arange(p + cfg.block_size)[None],
                    noise_embedding=blocks[row, blk][None],
                    target_hidden=taps[row, :p][None],
                )[0]
                worst = max(worst, (ours[row, blk] - expected).abs().max().item())
                # The greedy proposal, as the reference decoder makes it.
                drafted = expected[None, 1:]
                ref_path, _, _ = ref.propose(drafted, anchor_tokens[row, blk][None], head, 0.0)
                our_hidden = ours[row, blk][None, 1:]
                our_path, _, _ = body.candidate_selector.walk(
                    our_hidden, head(our_hidden), anchor_tokens[row, blk][None], 0.0
                )
                assert torch.equal(our_path, ref_path)
    assert worst <= TOL, worst

    # And back: the directory loads into a body with the same weights.
    loaded = load_hf_checkpoint(str(tmp_path / "draft"), attention_backend="chunked")
    saved = hf_state_dict(body)
    for name, tensor in hf_state_dict(loaded).items():
        assert torch.equal(tensor, saved[name]), name


# ================================================================================== objective


def naive_dflash2_loss(hidden, plan, input_ids, head, selector, decay_gamma, selector_weight_factor):
    """Slot by slot with full logits: (loss_sum, weight_sum, dict of metric counts).

    As the reference: each term is a weighted mean over the slots it trains on, the selector's over
    the slots whose label is among the candidates; `loss_sum / weight_sum` is their weighted sum.
    """
    B, N, W, _ = hidden.shape
    K = selector.top_k
    loss = hidden.new_zeros(())
    selector_loss = hidden.new_zeros(())
    selector_weight = 0.0
    weight_sum = 0.0
    counts = dict(supervised=0, hits=0, tf=0, walk_correct=0, base_correct=0)
    walk_correct = torch.zeros(B, N, W - 1, dtype=torch.bool)
    base_correct = torch.zeros(B, N, W - 1, dtype=torch.bool)
    for b in range(B):
        for n in range(N):
            p = int(plan.anchor_positions[b, n])
            predecessor = input_ids[b, p]
            for k in range(1, W):
                logits = head(hidden[b, n, k]).float()
                values, ids = torch.topk(logits, K)
                # The greedy walk runs over every slot of a valid block.
                with torch.no_grad():
                    walk_scores = selector.score(hidden[b, n, k], values, ids, predecessor)
                    predecessor = ids[walk_scores.argmax()]
                if not plan.loss_mask[b, n, k]:
                    continue
                w = 1.0 if decay_gamma is None else math.exp(-(k - 1) / decay_gamma)
                label = input_ids[b, p + k]
                loss = loss + w * F.cross_entropy(logits[None], label[None])
                weight_sum += w
                counts["supervised"] += 1
                base_correct[b, n, k - 1] = bool(logits.argmax() == label)
                walk_correct[b, n, k - 1] = bool(predecessor == label)
                if bool((ids == label).any()):
                    counts["hits"] += 1
                    scores = selector.score(hidden[b, n, k], values, ids, input_ids[b, p + k - 1])
                    target = int((ids == label).nonzero()[0, 0])
                    selector_loss = selector_loss + w * F.cross_entropy(scores[None], torch.tensor([target]))
                    selector_weight += w
                    counts["tf"] += int(scores.argmax() == target)
    if selector_weight > 0:
        loss = loss + selector_weight_factor * weight_sum * selector_loss / selector_weight
    counts["selector_loss"] = float(selector_loss / max(selector_weight, 1e-12))
    supervised = plan.loss_mask[:, :, 1:]
    counts["walk_correct"] = int(walk_correct.sum())
    counts["base_correct"] = int(base_correct.sum())
    counts["walk_acceptance"] = float(acceptance_lengths(walk_correct, supervised, plan.block_valid).sum())
    counts["base_acceptance"] = float(acceptance_lengths(base_correct, supervised, plan.block_valid).sum())
    return loss, weight_sum, counts


def loss_problem(seed=0, vocab=24, top_k=5):
    gen = torch.Generator().manual_seed(seed)
    B, N, W, H = 2, 3, 4, 16
    S = 14
    anchors = torch.tensor([[1, 6, 9], [0, 4, 10]])
    input_mask = torch.ones(B, S, dtype=torch.bool)
    input_mask[0, 8] = False  # a hole inside block (0, 1)
    plan = DFlashBatchPlan.from_anchors(
        anchors, block_size=W, input_mask=input_mask, block_valid=torch.tensor([[True, True, True], [True, False, True]])
    )
    input_ids = torch.randint(vocab, (B, S), generator=gen)
    hidden = torch.randn(B, N, W, H, generator=gen)
    head = torch.nn.Linear(H, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, H, generator=gen) * 0.6)
    # Make the labels land among the candidates often, but not always.
    with torch.no_grad():
        for b in range(B):
            for n in range(N):
                for k in range(1, W):
                    if (b + n + k) % 3:
                        label = input_ids[b, int(anchors[b, n]) + k]
                        hidden[b, n, k] += 0.8 * head.weight[label]
    selector = random_selector(vocab=vocab, hidden=H, rank=4, top_k=top_k, seed=seed + 1)
    return plan, input_ids, hidden, head, selector


@pytest.mark.parametrize("chunk_slots", [5, None])
def test_loss_matches_naive_reference(chunk_slots):
    plan, input_ids, hidden, head, selector = loss_problem()
    out_hidden = hidden.clone().requires_grad_(True)
    got = dflash2_loss(
        out_hidden, plan, input_ids, OutputHead(head, 24), selector, decay_gamma=2.0, selector_weight=0.5,
        chunk_slots=chunk_slots,
    )
    got.loss_sum.backward()
    ours_grads = [out_hidden.grad] + [p.grad.clone() for p in selector.parameters()]
    selector.zero_grad()

    ref_hidden = hidden.clone().requires_grad_(True)
    expected, weight_sum, counts = naive_dflash2_loss(ref_hidden, plan, input_ids, head, selector, 2.0, 0.5)
    expected.backward()
    ref_grads = [ref_hidden.grad] + [p.grad for p in selector.parameters()]

    torch.testing.assert_close(got.loss_sum, expected.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.weight_sum, torch.tensor(weight_sum), rtol=1e-6, atol=1e-6)
    for a, b in zip(ours_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    m = got.metrics
    assert 0 < counts["hits"] < counts["supervised"]  # the problem exercises both cases
    assert float(m.supervised_tokens) == counts["supervised"]
    assert float(m.candidate_hits) == counts["hits"]
    assert float(m.teacher_forced_correct) == counts["tf"]
    assert float(m.correct_tokens) == counts["walk_correct"]
    assert float(m.acceptance_sum) == counts["walk_acceptance"]
    assert float(m.base_correct_tokens) == counts["base_correct"]
    assert float(m.base_acceptance_sum) == counts["base_acceptance"]
    # The selector term is a mean over the slots with their label among the candidates (not
    # diluted by the recall), as the reference normalises it.
    torch.testing.assert_close(float(m.selector_loss), counts["selector_loss"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        m.base_loss_sum + 0.5 * m.loss_weight_sum * m.selector_loss, got.loss_sum.detach().double(),
        rtol=1e-6, atol=1e-6,
    )


@pytest.mark.parametrize("chunk_slots", [5, None])
def test_fused_selector_term_matches_naive_reference(chunk_slots):
    """A frozen head takes the fused kernel: the candidates come out of the same logits pass as the
    backbone CE, their gradient through their rows of the head's weight. Against the dense oracle."""
    plan, input_ids, hidden, head, selector = loss_problem(seed=4)
    head.requires_grad_(False)
    out_hidden = hidden.clone().requires_grad_(True)
    got = dflash2_loss(out_hidden, plan, input_ids, OutputHead(head, 24), selector, decay_gamma=2.0,
                       selector_weight=0.5, chunk_slots=chunk_slots, fused=True)
    got.loss_sum.backward()
    ours = [out_hidden.grad] + [p.grad.clone() for p in selector.parameters()]
    selector.zero_grad()
    ref_hidden = hidden.clone().requires_grad_(True)
    expected, weight_sum, counts = naive_dflash2_loss(ref_hidden, plan, input_ids, head, selector, 2.0, 0.5)
    expected.backward()
    torch.testing.assert_close(got.loss_sum, expected.detach(), rtol=1e-5, atol=1e-5)
    for a, b in zip(ours, [ref_hidden.grad] + [p.grad for p in selector.parameters()]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    m = got.metrics
    assert 0 < counts["hits"] < counts["supervised"]
    assert (float(m.candidate_hits), float(m.teacher_forced_correct)) == (counts["hits"], counts["tf"])
    assert (float(m.correct_tokens), float(m.base_correct_tokens)) == (counts["walk_correct"], counts["base_correct"])
    assert float(m.acceptance_sum) == counts["walk_acceptance"]


@pytest.mark.parametrize("backbone_grad", [True, False])
def test_fused_selector_term_equals_the_recomputing_path(backbone_grad):
    """Fused against the per-chunk path with the target's output transform (multiplier, soft cap) and a
    padded head (the kernel never forms the padding columns): loss, every gradient, every metric."""
    plan, input_ids, hidden, head, selector = loss_problem(seed=5)
    wide = torch.nn.Linear(head.in_features, 28, bias=False)
    with torch.no_grad():
        wide.weight.zero_()
        wide.weight[:24] = head.weight
    wide.requires_grad_(False)
    results = []
    for fused in (True, False):
        selector.zero_grad()
        h = hidden.clone().requires_grad_(True)
        out_head = OutputHead(wide, 24, output_multiplier=1.3, final_logit_softcapping=4.0)
        out = dflash2_loss(h, plan, input_ids, out_head, selector, decay_gamma=3.0, selector_weight=0.7,
                           chunk_slots=4, selector_backbone_grad=backbone_grad, fused=fused)
        out.loss_sum.backward()
        results.append((out, h.grad, {n: p.grad.clone() for n, p in selector.named_parameters()}))
    (fused_out, fused_gh, fused_g), (ref_out, ref_gh, ref_g) = results
    torch.testing.assert_close(fused_out.loss_sum, ref_out.loss_sum, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_gh, ref_gh, rtol=1e-4, atol=1e-6)
    for name, grad in ref_g.items():
        torch.testing.assert_close(fused_g[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    counts = slice(0, 8)  # the counts exactly, the loss sums to rounding
    assert torch.equal(fused_out.metrics._stack()[counts], ref_out.metrics._stack()[counts])
    torch.testing.assert_close(fused_out.metrics._stack()[8:], ref_out.metrics._stack()[8:], rtol=1e-5, atol=1e-5)


def test_loss_without_backbone_gradient_and_identity_selector():
    plan, input_ids, hidden, head, selector = loss_problem(seed=2)
    hidden.requires_grad_(True)
    out = dflash2_loss(hidden, plan, input_ids, OutputHead(head, 24), selector, decay_gamma=2.0, selector_backbone_grad=False)
    out.loss_sum.backward()
    base_hidden = hidden.detach().clone().requires_grad_(True)
    dflash_loss(base_hidden, plan, input_ids, OutputHead(head, 24), decay_gamma=2.0).loss_sum.backward()
    torch.testing.assert_close(hidden.grad, base_hidden.grad, rtol=1e-6, atol=1e-7)
    assert selector.successor_codebook.grad.abs().sum() > 0

    # An untrained selector walks exactly the backbone's argmax.
    fresh = CandidateSelector(24, 16, 4, 5)
    with torch.no_grad():
        m = dflash2_loss(hidden, plan, input_ids, OutputHead(head, 24), fresh).metrics
    assert float(m.correct_tokens) == float(m.base_correct_tokens)
    assert float(m.acceptance_sum) == float(m.base_acceptance_sum)
    # A fresh successor codebook still gets a gradient on the first step.
    hidden.grad = None
    dflash2_loss(hidden, plan, input_ids, OutputHead(head, 24), fresh).loss_sum.backward()
    assert fresh.successor_codebook.grad.abs().sum() > 0


def test_metrics_add_and_fp16_is_refused(tmp_path):
    plan, input_ids, hidden, head, selector = loss_problem(seed=3)
    with torch.no_grad():
        m = dflash2_loss(hidden, plan, input_ids, OutputHead(head, 24), selector).metrics
    total = m + m
    assert float(total.acceptance_sum) == 2 * float(m.acceptance_sum)
    assert total.acceptance_length == m.acceptance_length
    assert m.as_dflash_metrics().acceptance_length == m.acceptance_length
    assert 0 < float(m.candidate_recall) <= 1
    with pytest.raises(ValueError, match="bfloat16"):
        DFlash2Body(tiny_config(), default_parallel_config(params_dtype=torch.float16))
    body = DFlash2Body(tiny_config(), default_parallel_config(perform_initialization=False))
    with pytest.raises(ValueError, match="bfloat16"):
        save_hf_checkpoint(body, str(tmp_path / "fp16"), dtype=torch.float16)


# ================================================================================== tensor parallel


def _dflash2_step(body, head, problem):
    """Forward, DFlash 2 loss, backward: (hidden, loss_sum, metrics, grads of the replicated DFlash 2 tensors)."""
    taps, blocks, plan, input_ids, _ = problem
    hidden = body(taps, blocks, plan)
    out = dflash2_loss(hidden, plan, input_ids, head, body.candidate_selector, decay_gamma=3.0, chunk_slots=7)
    out.loss_sum.backward()
    grads = {n: p.grad for n, p in body.named_parameters() if "_conv." in n or "selector" in n}
    return hidden.detach(), out.loss_sum.detach(), out.metrics._stack(), grads


def _tp2_rank(rank, world_size, state, problem):
    """One rank of a TP=2 DFlash 2 body and a vocab-parallel head; also checks the vocab-parallel top-k."""
    from megatron.core import parallel_state

    from megatron_dflash.draft.layers import column_parallel

    group = parallel_state.get_tensor_model_parallel_group()
    config = default_parallel_config(perform_initialization=False)
    body = DFlash2Body(tiny_config(), config, tp_group=group, attention_backend="chunked")
    load_hf_state_dict_into(body, state)
    head_weight = problem[-1]
    V, H = head_weight.shape
    layer = column_parallel(H, V, bias=False, parallel_config=config, tp_group=group, std=0.02)
    layer.weight.data.copy_(head_weight.chunk(world_size, 0)[rank])
    layer.requires_grad_(False)
    result = _dflash2_step(body, OutputHead(layer, V, tp_group=group), problem)

    # topk_vocab_parallel: global values and ids; the gradient reaches this rank's shard only.
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(3)).requires_grad_(True)
    shard = V // world_size
    values, ids = topk_vocab_parallel(logits[:, rank * shard : (rank + 1) * shard], 6, rank * shard, group)
    (values * torch.arange(6.0)).sum().backward()
    return result, (values.detach(), ids, logits.grad)


def test_tensor_parallel_matches_single_rank(tp_pool):
    cfg = tiny_config()
    torch.manual_seed(0)
    body = DFlash2Body(cfg, attention_backend="chunked")
    randomize_dflash2(body, 5)
    state = hf_state_dict(body)
    taps, blocks, plan = random_inputs(cfg)
    gen = torch.Generator().manual_seed(9)
    input_ids = torch.randint(cfg.vocab_size, (2, SEQ), generator=gen)
    head_weight = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen) * 0.3
    problem = (taps, blocks, plan, input_ids, head_weight)
    head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    head.weight.data.copy_(head_weight)
    head.requires_grad_(False)
    hidden, loss, metrics, grads = _dflash2_step(body, OutputHead(head, cfg.vocab_size), problem)

    logits = torch.randn(5, cfg.vocab_size, generator=torch.Generator().manual_seed(3))
    top_values, top_ids = torch.topk(logits, 6)
    top_grad = torch.zeros_like(logits).scatter(-1, top_ids, torch.arange(6.0).expand(5, 6))
    rank_grads = []
    for (r_hidden, r_loss, r_metrics, r_grads), (values, ids, grad) in tp_pool(2).run(_tp2_rank, state, problem):
        torch.testing.assert_close(r_hidden, hidden, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r_loss, loss, rtol=1e-5, atol=1e-5)
        # Counts exactly, the loss sums (last three) to rounding.
        assert torch.equal(r_metrics[:-3], metrics[:-3])
        torch.testing.assert_close(r_metrics[-3:], metrics[-3:], rtol=1e-5, atol=1e-5)
        for name, grad_tp1 in grads.items():
            torch.testing.assert_close(r_grads[name], grad_tp1, rtol=1e-4, atol=1e-5, msg=name)
        assert torch.equal(values, top_values) and torch.equal(ids, top_ids)
        rank_grads.append(grad)
    # Each rank's gradient covers its own shard; together they are the full gradient.
    assert torch.equal(rank_grads[0] + rank_grads[1], top_grad)


def test_fused_loss_never_materialises_more_than_one_chunk_of_logits():
    """The selector term adds no logits of its own: with a frozen head the peak allocation of the whole
    DFlash 2 loss, forward and backward, stays below one ``[chunk, V]`` chunk."""
    from largest_tensor import LargestNewTensor

    gen = torch.Generator().manual_seed(6)
    B, S, N, W, vocab, H, chunk = 2, 48, 4, 5, 1000, 8, 4
    plan = DFlashBatchPlan.from_anchors(torch.tensor([[0, 9, 20, 31], [3, 14, 25, 40]]), block_size=W, seq_length=S)
    input_ids = torch.randint(vocab, (B, S), generator=gen)
    hidden = torch.randn(B, N, W, H, generator=gen).requires_grad_(True)
    head = torch.nn.Linear(H, vocab, bias=False)
    head.requires_grad_(False)
    selector = random_selector(vocab=vocab, hidden=H, rank=4, top_k=5, seed=7)
    M = B * N * (W - 1)
    assert M * 5 * H < chunk * vocab  # so that the bound below is about logits
    with LargestNewTensor() as tracker:
        dflash2_loss(hidden, plan, input_ids, OutputHead(head, vocab), selector, chunk_slots=chunk).loss_sum.backward()
    assert tracker.largest <= chunk * vocab, (tracker.largest, tracker.op)
    assert hidden.grad.abs().sum() > 0


@pytest.mark.parametrize("frozen_codebooks", [False, True])
def test_selector_loss_kernel_against_autograd(frozen_codebooks):
    """`_SelectorLoss` forms its gradients in forward: against autograd through the plain expression in
    fp64 (the kernel's scores are fp32), with chunks that split the rows, repeated predecessors and candidates across rows, slots whose
    label is not a candidate and slots of weight 0."""
    from megatron_dflash.variants.dflash2 import _SelectorLoss

    gen = torch.Generator().manual_seed(3)
    M, K, R, V = 11, 4, 5, 9
    dt = torch.float64
    projected = torch.randn(M, R, generator=gen, dtype=dt, requires_grad=True)
    unary = torch.randn(M, K, generator=gen, dtype=dt, requires_grad=True)
    codebook_a = torch.randn(V, R, generator=gen, dtype=dt, requires_grad=not frozen_codebooks)
    codebook_b = torch.randn(V, R, generator=gen, dtype=dt, requires_grad=not frozen_codebooks)
    ids = torch.stack([torch.randperm(V, generator=gen)[:K] for _ in range(M)])
    predecessor = torch.randint(V, (M,), generator=gen)
    label = torch.where(torch.arange(M) % 3 == 0, torch.randint(V, (M,), generator=gen), ids[:, 1])
    weight = torch.rand(M, generator=gen, dtype=dt)
    weight[4] = 0.0
    total, hit, top1 = _SelectorLoss.apply(projected, unary, codebook_a, codebook_b, ids, predecessor, label,
                                           weight, 4)
    (2.5 * total).backward()
    inputs = [projected, unary] + ([] if frozen_codebooks else [codebook_a, codebook_b])
    got = [t.grad.clone() for t in inputs]
    for t in inputs:
        t.grad = None

    scores = unary + torch.einsum("mr,mkr->mk", codebook_a[predecessor] * projected, codebook_b[ids])
    match = ids == label[:, None]
    expected_hit = match.any(dim=-1)
    nll = torch.logsumexp(scores, dim=-1) - (scores * match).sum(dim=-1)
    expected = (nll * weight * expected_hit).sum()
    (2.5 * expected).backward()
    assert 0 < int(expected_hit.sum()) < M
    assert torch.equal(hit, expected_hit)
    assert torch.equal(top1, (scores.argmax(dim=-1) == match.to(dt).argmax(dim=-1)) & expected_hit)
    # The scores and their softmax run in fp32, as `CandidateSelector.score` returns them.
    torch.testing.assert_close(total.double(), expected.detach(), rtol=1e-5, atol=1e-6)
    for a, b in zip(got, [t.grad for t in inputs]):
        assert a.dtype == dt
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert float(got[1][4].abs().sum()) == 0.0  # weight 0: no gradient
