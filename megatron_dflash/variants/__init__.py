"""Variants of the DFlash draft on the same backbone (docs/design.md §12 Variants).

`registry` is the one place that knows which variants exist; `register_variant` adds one.
"""

from .dflash2 import (
    DFLASH2_ARCHITECTURE,
    GREEDY_TEMPERATURE_EPS,
    CandidateSelector,
    DFlash2Body,
    DFlash2Config,
    DFlash2LossOutput,
    DFlash2Metrics,
    GroupedDynamicCausalConv,
    dflash2_loss,
    topk_vocab_parallel,
)
from .domino import (
    DOMINO_ARCHITECTURE,
    DominoBody,
    DominoConfig,
    DominoHead,
    DominoLossOutput,
    DominoMetrics,
    domino_block_targets,
    domino_lambda,
    domino_loss,
    domino_propose,
    domino_walk,
    is_domino_hf_config,
)
from .jetspec import JetSpecConfig, jetspec_config, jetspec_loss, teacher_argmax_ids
from .registry import (
    Variant,
    VariantLoss,
    get_variant,
    register_variant,
    unregister_variant,
    variant_for_hf_config,
    variant_names,
    variant_of,
)

__all__ = [
    "DFLASH2_ARCHITECTURE",
    "GREEDY_TEMPERATURE_EPS",
    "CandidateSelector",
    "DFlash2Body",
    "DFlash2Config",
    "DFlash2LossOutput",
    "DFlash2Metrics",
    "GroupedDynamicCausalConv",
    "dflash2_loss",
    "topk_vocab_parallel",
    "DOMINO_ARCHITECTURE",
    "DominoBody",
    "DominoConfig",
    "DominoHead",
    "DominoLossOutput",
    "DominoMetrics",
    "domino_block_targets",
    "domino_lambda",
    "domino_loss",
    "domino_propose",
    "domino_walk",
    "is_domino_hf_config",
    "JetSpecConfig",
    "jetspec_config",
    "jetspec_loss",
    "teacher_argmax_ids",
    "Variant",
    "VariantLoss",
    "get_variant",
    "register_variant",
    "unregister_variant",
    "variant_for_hf_config",
    "variant_names",
    "variant_of",
]
