"""The target's side of decoding (`decoding.target_side`) against the target's own forward without a cache.

Both verifiers must give, for every block, exactly the logits and taps of a plain forward of the target over
the row's committed tokens followed by the block, whatever the rows accepted before: the cached one keeps a
rectangular HF KV cache with rejected slots as masked holes (and compacts it when holes dominate), the
recomputed one runs the target over everything each cycle. Rows here accept in turn, so both rows collect
holes and the cache is compacted.
"""

from __future__ import annotations

import pytest
import torch

from megatron_dflash.decoding import target_side
from megatron_dflash.decoding.target_side import CachedTarget, RecomputedTarget

pytestmark = pytest.mark.usefixtures("one_thread")

transformers = pytest.importorskip("transformers")
from tiny_decoding import TAPS, qwen3_target  # noqa: E402

W = 4
PROMPTS = [[5, 17, 3, 40, 22], [9, 1, 33]]


def _plain_forward(target, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`(logits [L, V], taps [L, taps*H])` of the target over `tokens`, no cache, no padding."""
    out = target(input_ids=torch.tensor([tokens]), output_hidden_states=True, use_cache=False)
    taps = torch.cat([out.hidden_states[i + 1] for i in TAPS], dim=-1)
    return out.logits[0].float(), taps[0]


@pytest.mark.parametrize("widths", [(W,), (W + 1, 2, 1, W)], ids=["fixed-width", "varying-width"])
@pytest.mark.parametrize("kind", [CachedTarget, RecomputedTarget], ids=["cached", "recomputed"])
@torch.no_grad()
def test_every_verify_equals_the_plain_forward_over_the_committed_tokens(kind, widths, monkeypatch):
    """Blocks of one width (DFlash), or of varying widths up to the verifier's (a DSpark draft's blocks, which
    its confidence threshold shortens)."""
    target = qwen3_target(vocab=96)
    compactions = []
    compact = target_side._compact_target_cache

    def spy(cache, valid):
        compactions.append(valid.shape)
        return compact(cache, valid)

    monkeypatch.setattr(target_side, "_compact_target_cache", spy)
    side = kind(target, TAPS, 0, max(widths))
    lengths = torch.tensor([len(p) for p in PROMPTS])
    last_logits, prompt_taps = side.prefill(PROMPTS, lengths)
    for b, prompt in enumerate(PROMPTS):
        logits, taps = _plain_forward(target, prompt)
        torch.testing.assert_close(last_logits[b], logits[-1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(prompt_taps[b, : len(prompt)], taps, atol=1e-4, rtol=1e-4)
    committed = [list(p) for p in PROMPTS]
    gen = torch.Generator().manual_seed(0)
    for cycle in range(14):
        width = widths[cycle % len(widths)]
        block = torch.randint(0, 96, (len(PROMPTS), width), generator=gen)
        logits, taps = side.verify(block, torch.tensor([len(c) for c in committed]))
        for b in range(len(PROMPTS)):
            expected_logits, expected_taps = _plain_forward(target, committed[b] + block[b].tolist())
            torch.testing.assert_close(logits[b], expected_logits[-width:], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(taps[b], expected_taps[-width:], atol=1e-4, rtol=1e-4)
        # the rows accept in turn: all of the block, then nothing (the anchor only)
        accepted = torch.tensor([width - 1, 0] if cycle % 2 == 0 else [0, width - 1])
        side.commit(accepted)
        for b in range(len(PROMPTS)):
            committed[b] += block[b, : int(accepted[b]) + 1].tolist()
    side.close()
    if kind is CachedTarget and len(widths) == 1:  # (narrow blocks leave too few holes in 14 cycles)
        assert compactions  # the holes came to dominate the cache: it was compacted, and stayed exact


def test_the_family_chooses_the_verifier():
    """A target whose family keeps a KV cache (Qwen3) is verified with it."""
    verifier = target_side.target_side(qwen3_target(vocab=96), TAPS, 0, W)
    try:
        assert isinstance(verifier, CachedTarget)
    finally:
        verifier.close()
