"""The target's embedding and output head read alone from its files (`target/frozen_heads.py`) against the loaded
model's: the same lookups and logits; the vocab-parallel head holds megatron's padded rows of its rank."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_dflash.draft.config import DFlashConfig
from megatron_dflash.target.frozen_heads import load_frozen_heads
from megatron_dflash.target.megatron.config import padded_vocab_size


class FakeGroup:
    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


@pytest.fixture(scope="module")
def target(tiny_target):
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    cfg = model.config
    config = DFlashConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                          num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                          intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size, num_hidden_layers=1,
                          num_target_layers=cfg.num_hidden_layers, target_layer_ids=[1, 3], block_size=8,
                          mask_token_id=2)
    return model, config


def test_the_heads_equal_the_loaded_targets(tiny_target, target):
    model, config = target
    heads = load_frozen_heads(tiny_target, config, torch.float32, None, tied=True, vocab_parallel=False)
    ids = torch.arange(config.vocab_size).view(4, -1)
    assert torch.equal(heads.embedding(ids), model.get_input_embeddings()(ids))
    hidden = torch.randn(3, config.hidden_size)
    assert torch.equal(heads.head.local_logits(hidden), model.get_output_embeddings()(hidden))
    total = sum(p.numel() * 4 for p in model.parameters())
    assert heads.loaded_bytes == config.vocab_size * config.hidden_size * 4  # tied: one matrix
    assert heads.loaded_bytes + heads.skipped_bytes == total


@pytest.mark.parametrize("tp", [1, 2])
def test_the_vocab_parallel_head_holds_its_ranks_padded_rows(tiny_target, target, tp):
    model, config = target
    weight = model.get_output_embeddings().weight
    local = padded_vocab_size(config.vocab_size, tp) // tp
    hidden = torch.randn(3, config.hidden_size)
    shards = []
    for rank in range(tp):
        heads = load_frozen_heads(tiny_target, config, torch.float32, FakeGroup(rank, tp), tied=True,
                                  vocab_parallel=True)
        assert heads.head.vocab_range == (rank * local, (rank + 1) * local)
        shards.append(heads.head.local_logits(hidden))
    logits = torch.cat(shards, dim=-1)
    assert logits.shape[-1] == padded_vocab_size(config.vocab_size, tp)
    assert torch.equal(logits[:, :config.vocab_size], hidden @ weight.T)
    assert torch.isinf(logits[:, config.vocab_size:]).all()
