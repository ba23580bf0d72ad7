"""The draft head copied from a vocab-parallel target head (docs/design.md §20): at TP=2 each rank's rows of the
draft head are the target head's rows of the chosen ids (which lie in either rank's shard), and `d2t` is set."""

from __future__ import annotations

import torch

VOCAB, PADDED, HIDDEN = 97, 98, 8


def _install_at_tp2(rank: int, world_size: int) -> dict:
    from megatron.core import parallel_state

    from megatron_dflash.draft.body import DFlashBody, default_parallel_config
    from megatron_dflash.draft.config import DFlashConfig
    from megatron_dflash.draft.draft_vocab import DraftVocabulary
    from megatron_dflash.draft.layers import column_parallel
    from megatron_dflash.target.head import OutputHead
    from megatron_dflash.training.draft_vocab import install_draft_vocab

    group = parallel_state.get_tensor_model_parallel_group()
    full = torch.randn(PADDED, HIDDEN, generator=torch.Generator().manual_seed(0))
    layer = column_parallel(HIDDEN, PADDED, bias=False, parallel_config=default_parallel_config(), tp_group=group,
                            std=0.02)
    shard = PADDED // world_size
    with torch.no_grad():
        layer.weight.copy_(full[rank * shard: (rank + 1) * shard])
    ids = [0, 5, 40, 48, 49, 50, 60, 96]  # both shards
    config = DFlashConfig(hidden_size=HIDDEN, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=2, head_dim=4, vocab_size=VOCAB, block_size=4, mask_token_id=96,
                          num_target_layers=4, draft_vocab_size=len(ids))
    body = DFlashBody(config, tp_group=group)
    vocab = DraftVocabulary.from_ids(ids, VOCAB)
    install_draft_vocab(body, vocab, OutputHead(layer, VOCAB, tp_group=group), trainable=False)
    rows = body.lm_head.weight.detach()
    start = rank * 4
    return {"rows": float((rows - full[torch.tensor(ids)][start: start + rows.shape[0]]).abs().max()),
            "count": rows.shape[0], "d2t": body.d2t.tolist(), "frozen": not body.lm_head.weight.requires_grad}


def test_draft_head_rows_from_a_vocab_parallel_target_head(tp_pool):
    for rank, report in enumerate(tp_pool(2).run(_install_at_tp2)):
        assert report["rows"] == 0.0 and report["count"] == 4 and report["frozen"], (rank, report)
        assert report["d2t"] == [t - i for i, t in enumerate([0, 5, 40, 48, 49, 50, 60, 96])]
