"""The Kimi K3 draft family: a dense, NoPE, multi-latent-attention draft for Kimi K3 targets.

Entry points (docs/design.md §16 Kimi K3 draft family):

* `KimiK3DraftConfig` (`to_hf_dict` / `from_hf_dict`, `from_target_config`): the config and its
  `config.json` as NeMo AutoModel writes `KimiK3DFlashDraftModel`.
* `KimiK3Body`: the body, a `draft.body.DraftBody` with K3's layers (`DFlashBody`'s constructor and forward signature).
* HF directories at any TP size through the one writer and reader (`checkpoint.hf.save_hf_checkpoint` /
  `load_hf_checkpoint`): the variant registry knows the family as `kimi_k3` (docs/design.md §12 Variants).
"""

from .body import KimiK3Body
from .config import KIMI_K3_DRAFT_ARCHITECTURE, KimiK3DraftConfig, is_kimi_k3_draft_config

__all__ = [
    "KIMI_K3_DRAFT_ARCHITECTURE",
    "KimiK3Body",
    "KimiK3DraftConfig",
    "is_kimi_k3_draft_config",
]
