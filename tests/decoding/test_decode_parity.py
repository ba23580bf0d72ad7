"""Decoding is bit for bit what it was before the draft forward took a KV cache.

`spec_generate` runs the draft through `DFlashBody.forward` with a `DraftKVCache`, the same
modules as training. `reference_decode` keeps the decode-only copy of the layer it replaced. For
every variant (DFlash, DFlash with sliding-window layers, DFlash 2, Domino with and without
`shift_label`, JetSpec's causal blocks), greedy and sampled, on fixed seeds, both paths must give

* the same draft hidden states in every cycle (`torch.equal`, what the head and the proposers read),
* the same tokens, lengths, acceptance lengths and forward counts.

Batches of rows that accept different lengths (and rows that finish early) exercise the per-row
cache writes, the growth of the cache and the dropping of finished rows.
"""

from __future__ import annotations

import pytest
import torch

from megatron_dflash.decoding import generate
from megatron_dflash.objectives.dflash_loss import OutputHead

pytest.importorskip("transformers")

from reference_decode import reference_decode  # noqa: E402
from tiny_decoding import HIDDEN, TAPS, TARGET_LAYERS, make_draft, qwen3_target  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, W = 96, 4
PROMPTS = [[5, 17, 3, 40, 22], [9, 1, 33, 60, 2, 71, 8, 50, 11], [44, 3, 19]]


def _domino(shift_label: bool):
    from megatron_dflash.variants.domino import DominoBody, DominoConfig

    config = DominoConfig(
        hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, block_size=W, mask_token_id=VOCAB - 1, vocab_size=VOCAB,
        num_target_layers=TARGET_LAYERS, target_layer_ids=TAPS, rope_theta=10000.0, max_position_embeddings=512,
        emb_dim=12, gru_hidden_dim=10, shift_label=shift_label, pure_draft_prefix_len=1,
    )
    torch.manual_seed(1)
    draft = DominoBody(config, attention_backend="chunked").eval()
    with torch.no_grad():
        draft.embed_proj[2].weight.normal_(0.0, 1.0)  # starts at zero: make the correction matter
    return draft


def _jetspec():
    from megatron_dflash.variants.jetspec import jetspec_config

    plain = make_draft(VOCAB, block_size=W, backend="chunked")
    torch.manual_seed(1)
    draft = type(plain)(jetspec_config(plain.config), attention_backend="chunked").eval()
    draft.load_state_dict(plain.state_dict())
    return draft


DRAFTS = {
    "dflash": lambda: make_draft(VOCAB, block_size=W, backend="chunked"),
    "dflash-sliding": lambda: make_draft(
        VOCAB, block_size=W, backend="chunked", layer_types=["full_attention", "sliding_attention"], sliding_window=5
    ),
    "dflash2": lambda: make_draft(VOCAB, dflash2=True, block_size=W, backend="chunked"),
    "domino": lambda: _domino(False),
    "domino-shift": lambda: _domino(True),
    "jetspec": _jetspec,
}


def _run(target, draft, temperature: float, monkeypatch) -> tuple:
    """Decode the prompts; return the output and every draft hidden state the head or proposer read."""
    seen: list[torch.Tensor] = []
    local_logits = OutputHead.local_logits

    def recording_logits(self, hidden, *args, **kwargs):
        seen.append(hidden.clone())
        return local_logits(self, hidden, *args, **kwargs)

    monkeypatch.setattr(OutputHead, "local_logits", recording_logits)
    propose = getattr(draft, "propose_block", None)
    if propose is not None:

        def recording_propose(hidden, *args, **kwargs):
            seen.append(hidden.clone())
            return propose(hidden, *args, **kwargs)

        monkeypatch.setattr(draft, "propose_block", recording_propose)
    generator = torch.Generator().manual_seed(11) if temperature > 0 else None
    out = generate.spec_generate(
        target, draft, PROMPTS, max_new_tokens=21, temperature=temperature, generator=generator, stop_token_ids=[13]
    )
    monkeypatch.undo()
    return out, seen


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
@pytest.mark.parametrize("variant", list(DRAFTS))
def test_decoding_is_bit_identical_to_the_decode_only_layer(variant, temperature, monkeypatch):
    target = qwen3_target(vocab=VOCAB, mode="mixed")
    draft = DRAFTS[variant]()
    new, new_hidden = _run(target, draft, temperature, monkeypatch)
    with reference_decode():
        old, old_hidden = _run(target, draft, temperature, monkeypatch)

    assert torch.equal(new.tokens, old.tokens)
    assert torch.equal(new.lengths, old.lengths)
    assert new.acceptance_lengths == old.acceptance_lengths
    assert torch.equal(new.stopped, old.stopped)
    assert (new.num_target_forwards, new.num_draft_forwards) == (old.num_target_forwards, old.num_draft_forwards)
    assert len(new_hidden) == len(old_hidden) >= new.num_draft_forwards > 2
    for cycle, (ours, theirs) in enumerate(zip(new_hidden, old_hidden)):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), f"cycle {cycle}"
