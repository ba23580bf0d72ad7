"""The target's attention masks, built in one place for both conventions its backends take
(docs/design.md §7).

* megatron (`MegatronTarget`, the pipeline): bool, **True = masked**, ``[1 or B, 1, S, S]``. Megatron builds
  its own causal default on CUDA only, so CPU callers pass `causal_mask` explicitly.
* HF (``--target-backend hf``): additive, ``0`` where a query attends and the dtype's minimum where it does not,
  ``[B, 1, S, S]`` in the model's dtype.

Packed rows (``document_ids [B, S]``, negative = padding) attend causally within their own document; padding
attends to padding only.
"""

from __future__ import annotations

import torch

__all__ = ["causal_mask", "document_mask", "hf_document_mask"]


def causal_mask(seq_length: int, device="cpu") -> torch.Tensor:
    """``[1, 1, S, S]`` bool, True = masked (megatron's convention): the causal mask megatron builds on CUDA."""
    return torch.ones(seq_length, seq_length, dtype=torch.bool, device=device).triu(1)[None, None]


def _document_allowed(document_ids: torch.Tensor) -> torch.Tensor:
    """``[B, 1, S, S]`` bool, True = attend: causal and same document."""
    S = document_ids.shape[1]
    causal = torch.ones(S, S, dtype=torch.bool, device=document_ids.device).tril()
    same = document_ids[:, :, None] == document_ids[:, None, :]
    return (causal[None] & same)[:, None]


def document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """``[B, 1, S, S]`` bool, True = masked (megatron's convention), of packed rows ``document_ids [B, S]``."""
    return ~_document_allowed(document_ids)


def hf_document_mask(document_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B, 1, S, S]`` additive mask in ``dtype`` (HF's convention), of packed rows ``document_ids [B, S]``."""
    allowed = _document_allowed(document_ids)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=document_ids.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)
