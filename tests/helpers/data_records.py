"""Small records for the data tests: a multi-turn chat and a `Sample` from plain token lists."""

from __future__ import annotations

import torch

from megatron_dflash.data.samples import Sample

MULTI_TURN = [
    {"role": "user", "content": "count from 3 to 7"},
    {"role": "assistant", "content": "3 4 5 6 7"},
    {"role": "user", "content": "spell the word cat"},
    {"role": "assistant", "content": "c a t"},
]


def make_sample(ids, mask=None, sid=0):
    ids = torch.as_tensor(ids, dtype=torch.int64)
    mask = torch.ones_like(ids, dtype=torch.bool) if mask is None else torch.as_tensor(mask, dtype=torch.bool)
    return Sample(ids, mask, sid)
