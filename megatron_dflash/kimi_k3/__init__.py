"""The Kimi K3 draft family: a dense, NoPE, multi-latent-attention draft for Kimi K3 targets.

Entry points (docs/design.md §16 Kimi K3 draft family):

* `KimiK3DraftConfig` (`to_hf_dict` / `from_hf_dict`, `from_target_config`): the config and its
  `config.json` as NeMo AutoModel writes `KimiK3DFlashDraftModel`.
* `KimiK3Body`: the body, with `DFlashBody`'s constructor and forward signature.
* `save_kimi_k3_checkpoint` / `load_kimi_k3_checkpoint`: the HF directory at any TP size.
"""

from .body import KimiK3Body
from .checkpoint import load_kimi_k3_checkpoint, save_kimi_k3_checkpoint
from .config import KIMI_K3_DRAFT_ARCHITECTURE, KimiK3DraftConfig, is_kimi_k3_draft_config

__all__ = [
    "KIMI_K3_DRAFT_ARCHITECTURE",
    "KimiK3Body",
    "KimiK3DraftConfig",
    "is_kimi_k3_draft_config",
    "load_kimi_k3_checkpoint",
    "save_kimi_k3_checkpoint",
]
