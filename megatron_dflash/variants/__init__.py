"""Variants of the DFlash draft on the same backbone (docs/design.md §12 Variants).

`registry` is the one place that knows which variants exist; `register_variant` adds one. `options` holds
what each variant takes from the command line, as plain data.

The names below load on first use (PEP 562): `training.arguments` reads `variants.options` to build the
parser, and `--help` must answer before torch loads.
"""

from __future__ import annotations

import importlib

_SOURCES = {
    "DFLASH2_ARCHITECTURE": "dflash2",
    "GREEDY_TEMPERATURE_EPS": "dflash2",
    "CandidateSelector": "dflash2",
    "DFlash2Body": "dflash2",
    "DFlash2Config": "dflash2",
    "DFlash2LossOutput": "dflash2",
    "DFlash2Metrics": "dflash2",
    "GroupedDynamicCausalConv": "dflash2",
    "dflash2_loss": "dflash2",
    "topk_vocab_parallel": "dflash2",
    "DOMINO_ARCHITECTURE": "domino",
    "DominoBody": "domino",
    "DominoConfig": "domino",
    "DominoHead": "domino",
    "DominoLossOutput": "domino",
    "DominoMetrics": "domino",
    "domino_block_targets": "domino",
    "domino_lambda": "domino",
    "domino_loss": "domino",
    "domino_propose": "domino",
    "domino_walk": "domino",
    "is_domino_hf_config": "domino",
    "DSPARK_ARCHITECTURE": "dspark",
    "DSparkBody": "dspark",
    "DSparkConfig": "dspark",
    "KimiK3DSparkBody": "dspark",
    "KimiK3DSparkConfig": "dspark",
    "MarkovHead": "dspark",
    "ConfidenceHead": "dspark",
    "dspark_prev_tokens": "dspark",
    "dspark_walk": "dspark",
    "DSparkWalk": "dspark",
    "confident_lengths": "dspark",
    "JetSpecConfig": "jetspec",
    "jetspec_config": "jetspec",
    "jetspec_loss": "jetspec",
    "teacher_argmax_ids": "jetspec",
    "Variant": "registry",
    "VariantLoss": "registry",
    "get_variant": "registry",
    "register_variant": "registry",
    "unregister_variant": "registry",
    "variant_for_hf_config": "registry",
    "variant_names": "registry",
    "variant_of": "registry",
}

__all__ = list(_SOURCES)


def __getattr__(name: str):
    module = _SOURCES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_SOURCES))
