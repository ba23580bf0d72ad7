"""The draw of one proposed token from a draft's logits, shared by the variants' decode walks (Domino's
corrected slots, DSpark's Markov walk): greedy at temperature 0, else a sample of ``softmax(logits / T)``
whose distribution the lossless verification needs (docs/design.md §12 Variants)."""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["draw_token"]


def draw_token(logits: torch.Tensor, temperature: float,
               generator: Optional[torch.Generator]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(token [B] int64, q [B, V] or None)`` from fp32 ``logits [B, V]``: the argmax when ``temperature`` is 0
    (no distribution), else one draw of ``q = softmax(logits / temperature)`` with `generator`."""
    if temperature == 0:
        return logits.argmax(dim=-1), None
    q = torch.softmax(logits / temperature, dim=-1)
    return torch.multinomial(q, 1, generator=generator)[:, 0], q
