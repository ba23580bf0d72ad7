"""Speculative decoding with DSpark drafts (docs/design.md §18 DSpark): every slot of a block proposes a token,
so a block verifies ``[anchor, d_1 .. d_W]`` and a cycle commits up to ``W + 1`` tokens.

Checked, on tiny in-process models (the targets and helpers of `test_generate.py`):

* greedy decoding equals the target's own greedy decoding (HF `generate`) token for token, for a batch of
  prompts of different lengths, each Markov head form (vanilla, gated, rnn), with and without a confidence
  threshold, and a row decoded alone gives the same tokens as in the batch;
* a cycle commits up to ``W + 1`` tokens, and does (a target that keeps emitting what the draft proposes);
* every cycle drafts from exactly the committed context: its draft hidden states equal a training-path forward
  over the committed tokens (the draft's cache bookkeeping with the wider verify blocks);
* the confidence threshold: each row proposes the slots before the first whose cumulative confidence
  (product of the sigmoids of the walk's confidence logits) is below it, recomputed here in plain Python, and
  the verify block is as wide as the longest row's proposals; 0 never stops a block (the same decode as
  without), 1 stops every block at once (one token per cycle, as plain decoding);
* sampling follows the target's law (chi-square against its exact enumeration on a vocabulary of 8), with
  and without a threshold, and the test has power: a proposer that reports the distribution without the
  Markov bias instead of the one its tokens were drawn from fails it;
* a threshold for a draft without a confidence head, or out of [0, 1], is refused before decoding.

The heads are drawn larger than their init so that the Markov bias changes the proposals and the confidence
differs from slot to slot and row to row.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import pytest
import torch

from megatron_dflash.decoding import generate
from megatron_dflash.decoding.generate import spec_generate
from megatron_dflash.plan.batch_plan import DFlashBatchPlan
from megatron_dflash.variants import dspark
from megatron_dflash.variants.dspark import DSparkBody, DSparkConfig

pytest.importorskip("transformers")

from reference_sampling import chi_square_pvalue, exact_joint, marginal  # noqa: E402
from tiny_decoding import PROMPTS, TAPS, check_statistics, draft_config, hf_greedy, make_draft, qwen3_target  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, W, NEW = 96, 4, 23
FORMS = ("vanilla", "gated", "rnn")


def dspark_draft(vocab: int, block_size: int, form: str, *, seed: int = 1, head_std: float = 0.3,
                 confidence_head: bool = True) -> DSparkBody:
    """A DSpark draft on `test_generate`'s backbone, its Markov and confidence heads drawn with std `head_std`."""
    torch.manual_seed(seed)
    base = draft_config(vocab, block_size=block_size)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    config = DSparkConfig(**fields, markov_rank=8, markov_head_type=form, enable_confidence_head=confidence_head,
                          confidence_head_with_markov=confidence_head and form != "vanilla")
    body = DSparkBody(config, attention_backend="chunked").eval()
    generator = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, param in body.named_parameters():
            if name.startswith(("markov_head", "confidence_head")):
                param.copy_(torch.randn(param.shape, generator=generator) * head_std)
    return body


# ================================================================================== greedy


@pytest.mark.parametrize("threshold", [None, 0.3], ids=["all-slots", "threshold0.3"])
@pytest.mark.parametrize("form", FORMS)
def test_greedy_equals_target_greedy(form, threshold):
    target = qwen3_target(vocab=VOCAB, mode="mixed")
    draft = dspark_draft(VOCAB, W, form)
    out = spec_generate(target, draft, PROMPTS, max_new_tokens=NEW, confidence_threshold=threshold)
    for b, prompt in enumerate(PROMPTS):
        assert out.sequence(b) == hf_greedy(target, prompt, NEW), f"row {b}"
    check_statistics(out, W + 1, NEW)
    seen = Counter(a for row in out.acceptance_lengths for a in row)
    assert seen[1] > 0 and len(seen) >= 2  # rejections and accepted draft tokens
    assert len({tuple(row) for row in out.acceptance_lengths}) > 1  # rows out of step
    alone = spec_generate(target, draft, [PROMPTS[1]], max_new_tokens=NEW, confidence_threshold=threshold)
    assert alone.sequence(0) == out.sequence(1)


def test_a_cycle_commits_up_to_block_size_plus_one():
    """A target that keeps emitting the token the draft proposes accepts whole blocks: W drafted tokens and the
    bonus, W + 1 per cycle (a DFlash draft of the same block size commits at most W)."""
    target = qwen3_target(vocab=VOCAB, mode="absorbing")
    out = spec_generate(target, dspark_draft(VOCAB, W, "rnn"), PROMPTS, max_new_tokens=NEW)
    for b, prompt in enumerate(PROMPTS):
        assert out.sequence(b) == hf_greedy(target, prompt, NEW), f"row {b}"
    check_statistics(out, W + 1, NEW)
    assert Counter(a for row in out.acceptance_lengths for a in row)[W + 1] > 0
    plain = spec_generate(target, make_draft(VOCAB, block_size=W, backend="chunked"), PROMPTS, max_new_tokens=NEW)
    assert max(a for row in plain.acceptance_lengths for a in row) == W


@pytest.mark.parametrize("mode", ["absorbing", "mixed"])
def test_every_block_is_drafted_from_exactly_the_committed_context(mode, monkeypatch):
    """The draft's cache after blocks of W + 1 verified tokens: every cycle's draft hidden states equal one
    training-path forward over the committed tokens' taps with a plan anchored at the committed length (tokens
    past it are invisible), so the wider blocks' taps land at the right positions, also after a whole block
    (the last proposal's taps) was accepted. One row, so each cycle's committed tokens are known."""
    target = qwen3_target(vocab=VOCAB, mode=mode)
    draft = dspark_draft(VOCAB, W, "rnn")
    seen = []
    walk = dspark.dspark_walk

    def recording_walk(body, hidden, anchor_ids, *args, **kwargs):
        seen.append(hidden.clone())
        return walk(body, hidden, anchor_ids, *args, **kwargs)

    monkeypatch.setattr(dspark, "dspark_walk", recording_walk)
    prompt = PROMPTS[1]
    out = spec_generate(target, draft, [prompt], max_new_tokens=NEW)
    generated, cycles = out.generated(0), out.acceptance_lengths[0]
    assert len(seen) == len(cycles) and (mode != "absorbing" or W + 1 in cycles)
    start = 0
    for hidden, committed in zip(seen, cycles):
        context = prompt + generated[:start]  # committed; the anchor generated[start] sits at len(context)
        filler = [VOCAB - 2] * W  # past the block: invisible to it
        ids = torch.tensor([context + [generated[start]] + filler])
        block = torch.tensor([[generated[start]] + [draft.config.mask_token_id] * (W - 1)])
        plan = DFlashBatchPlan.from_anchors(torch.tensor([[len(context)]]), block_size=W, seq_length=ids.shape[1])
        with torch.no_grad():
            states = target(ids, output_hidden_states=True).hidden_states
            taps = torch.cat([states[i + 1] for i in TAPS], dim=-1)
            expected = draft(taps, target.get_input_embeddings()(block)[:, None], plan)[:, 0]
        torch.testing.assert_close(hidden, expected, atol=1e-5, rtol=1e-5)
        start += committed


# ================================================================================== the confidence threshold


def _stops(confidence_row: list[float], threshold: float) -> int:
    """Slots proposed before the cumulative confidence falls below `threshold`, written plainly."""
    survival, count = 1.0, 0
    for logit in confidence_row:
        survival *= 1.0 / (1.0 + math.exp(-logit))
        if survival < threshold:
            break
        count += 1
    return count


def _record_cycles(monkeypatch) -> tuple[list, list]:
    """Record every walk's confidence logits and every greedy verification's (block proposals, lengths)."""
    walks, verified = [], []
    walk, verify = dspark.dspark_walk, generate.greedy_verify

    def recording_walk(*args, **kwargs):
        out = walk(*args, **kwargs)
        walks.append(out.confidence.tolist())
        return out

    def recording_verify(draft_tokens, target_logits, lengths=None):
        verified.append((draft_tokens.shape[1], None if lengths is None else lengths.tolist()))
        return verify(draft_tokens, target_logits, lengths)

    monkeypatch.setattr(dspark, "dspark_walk", recording_walk)
    monkeypatch.setattr(generate, "greedy_verify", recording_verify)
    return walks, verified


def test_the_threshold_stops_each_row_at_its_first_unconfident_slot(monkeypatch):
    target = qwen3_target(vocab=VOCAB, mode="mixed")
    draft = dspark_draft(VOCAB, W, "gated", seed=3)
    walks, verified = _record_cycles(monkeypatch)
    threshold = 0.3
    out = spec_generate(target, draft, PROMPTS, max_new_tokens=NEW, confidence_threshold=threshold)
    assert len(walks) == len(verified) == out.num_target_forwards
    counts = []
    for confidence, (width, lengths) in zip(walks, verified):
        expected = [_stops(row, threshold) for row in confidence]
        assert lengths == expected
        assert width == max(expected)  # no slot that every row left out is verified
        counts += expected
    assert len(set(counts)) >= 3 and 0 in counts and W in counts  # rows stop anywhere, from slot 0 to never
    for b, prompt in enumerate(PROMPTS):
        assert out.sequence(b) == hf_greedy(target, prompt, NEW), f"row {b}"


def test_threshold_zero_never_stops_and_one_stops_at_once():
    target = qwen3_target(vocab=VOCAB, mode="absorbing")
    draft = dspark_draft(VOCAB, W, "vanilla")
    free = spec_generate(target, draft, PROMPTS, max_new_tokens=NEW)
    zero = spec_generate(target, draft, PROMPTS, max_new_tokens=NEW, confidence_threshold=0.0)
    assert torch.equal(zero.tokens, free.tokens) and zero.acceptance_lengths == free.acceptance_lengths
    one = spec_generate(target, draft, PROMPTS, max_new_tokens=NEW, confidence_threshold=1.0)
    assert torch.equal(one.tokens, free.tokens)
    assert {a for row in one.acceptance_lengths for a in row} == {1}  # the target's own token, one per cycle


def test_a_threshold_is_refused_where_no_confidence_head_can_use_it():
    target = qwen3_target(vocab=VOCAB)
    cases = [
        (make_draft(VOCAB, block_size=W, backend="chunked"), 0.5, "DFlash drafts have no confidence head"),
        (dspark_draft(VOCAB, W, "vanilla", confidence_head=False), 0.5, "has no confidence head"),
        (dspark_draft(VOCAB, W, "vanilla"), 1.5, r"must be a number in \[0, 1\]"),
    ]
    for draft, threshold, message in cases:
        with pytest.raises(ValueError, match=message):
            spec_generate(target, draft, PROMPTS, max_new_tokens=0, confidence_threshold=threshold)


# ================================================================================== sampling


def _sampled_pvalues(draft, threshold, steps: int = 4, n: int = 3000) -> tuple[list[float], Counter]:
    """Decode one prompt `n` times at T=1; the chi-square p-values of the emitted tokens' marginals (single
    positions and neighbour pairs) against the target's exact law, and the committed tokens per cycle."""
    target = qwen3_target(vocab=8, seed=2, head_std=0.3)
    prompt = [1, 4, 2, 6]
    out = spec_generate(target, draft, [prompt] * n, max_new_tokens=steps, temperature=1.0,
                        generator=torch.Generator().manual_seed(1234), confidence_threshold=threshold)
    check_statistics(out, draft.config.block_size + 1, steps)
    samples = [tuple(out.generated(b)) for b in range(n)]
    joint = exact_joint(target, prompt, steps, 1.0, 1.0, 0)
    pvalues = []
    for positions in [(0,), (1,), (2,), (3,), (0, 1), (1, 2), (2, 3)]:
        counts = Counter(tuple(s[i] for i in positions) for s in samples)
        pvalues.append(chi_square_pvalue(counts, marginal(joint, positions), n))
    return pvalues, Counter(a for row in out.acceptance_lengths for a in row)


@pytest.mark.parametrize("form, threshold", [("rnn", None), ("gated", 0.4)], ids=["rnn", "gated-threshold0.4"])
def test_sampling_follows_target_distribution(form, threshold, monkeypatch):
    """Blocks of 2: both slots propose, so a cycle verifies 3 tokens and commits up to 3 (tokens 2-4 of 4)."""
    pytest.importorskip("scipy")
    proposed = Counter()
    verify = generate.rejection_verify

    def recording_verify(draft_tokens, target_probs, draft_probs, generator, lengths=None):
        proposed.update([draft_tokens.shape[1]] * draft_tokens.shape[0] if lengths is None else lengths.tolist())
        return verify(draft_tokens, target_probs, draft_probs, generator, lengths)

    monkeypatch.setattr(generate, "rejection_verify", recording_verify)
    pvalues, cycles = _sampled_pvalues(dspark_draft(8, 2, form, seed=5, head_std=1.0), threshold)
    assert cycles[1] > 0 and cycles[3] > 0  # rejections and fully accepted blocks both occur
    if threshold is not None:
        assert proposed[2] > 0 and proposed[0] + proposed[1] > 0  # blocks stopped early, others did not
    assert min(pvalues) > 1e-4, pvalues


def test_sampling_test_has_power(monkeypatch):
    """Verifying against the backbone's distribution without the Markov bias (not the one the tokens were
    drawn from) breaks the law, and the chi-square test sees it."""
    pytest.importorskip("scipy")
    draft = dspark_draft(8, 2, "rnn", seed=5, head_std=1.0)
    propose = draft.propose_block

    def unbiased_probs(hidden, anchor_ids, head, embedding, temperature, generator, **kwargs):
        tokens, _, lengths = propose(hidden, anchor_ids, head, embedding, temperature, generator, **kwargs)
        return tokens, torch.softmax(head.local_logits(hidden) / temperature, dim=-1), lengths

    monkeypatch.setattr(draft, "propose_block", unbiased_probs)
    pvalues, _ = _sampled_pvalues(draft, None)
    assert min(pvalues) < 1e-10, pvalues
