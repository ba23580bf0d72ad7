"""HF directories of the Kimi K3 draft: the project's one writer and reader, under K3's name.

The layout is NeMo AutoModel's `KimiK3DFlashDraftModel` (docs/design.md §16 Kimi K3 draft
family): `config.json` as `KimiK3DraftConfig.to_hf_dict` writes it, `model.safetensors` with
whole tensors under the module names (`fc.weight`, `hidden_norm.weight`, `norm.weight`, `layers.N.self_attn.{q_a_proj,
q_a_layernorm, q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj, g_proj}.weight`,
`layers.N.mlp.{gate,up,down}_proj.weight`, `layers.N.{input,post_attention}_layernorm.weight`).
Saving gathers the tensor-parallel shards and loading slices them (`checkpoint.py`), so a
directory written at one TP size loads at any other the config allows.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..checkpoint import load_hf_checkpoint, save_hf_checkpoint
from .body import KimiK3Body
from .config import KIMI_K3_DRAFT_ARCHITECTURE


def save_kimi_k3_checkpoint(
    body: KimiK3Body, directory: str, *, dtype: Optional[torch.dtype] = None, overwrite: bool = False
) -> None:
    """Write `body` (any TP size; a collective over its TP group) as a `KimiK3DFlashDraftModel`
    directory, atomically, from TP rank 0 of data-parallel replica 0 (`checkpoint.save_hf_checkpoint`).

    Args:
        dtype: cast the weights (e.g. `torch.bfloat16` for serving); None keeps theirs.
        overwrite: replace a non-empty existing directory.
    """
    if not isinstance(body, KimiK3Body):
        raise TypeError(f"save_kimi_k3_checkpoint needs a KimiK3Body, got {type(body).__name__}.")
    save_hf_checkpoint(body, directory, dtype=dtype, architecture=KIMI_K3_DRAFT_ARCHITECTURE, overwrite=overwrite)


def load_kimi_k3_checkpoint(
    directory: str, *, parallel_config=None, tp_group=None, attention_backend: str = "auto"
) -> KimiK3Body:
    """Build the `KimiK3Body` of a `KimiK3DFlashDraftModel` directory (ours or NeMo AutoModel's)
    and load its weights, each rank keeping its own shard (`checkpoint.load_hf_checkpoint`).

    Raises:
        ValueError: the directory holds another draft family, or its weights do not match its config.
    """
    body = load_hf_checkpoint(
        directory, parallel_config=parallel_config, tp_group=tp_group, attention_backend=attention_backend
    )
    if not isinstance(body, KimiK3Body):
        raise ValueError(
            f"{directory} holds a {type(body).__name__} draft, not a Kimi K3 draft (architectures "
            f"{KIMI_K3_DRAFT_ARCHITECTURE!r}); load it with checkpoint.load_hf_checkpoint."
        )
    return body
