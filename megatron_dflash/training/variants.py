"""What the training loop needs of each draft variant: config, body, loss, HF export.

One `VariantSpec` per `--dflash-variant`. The loop only sees this interface::

    body = spec.build_body(config, parallel_config, attention_backend)
    out = spec.loss(body, hidden, plan, input_ids, head, decay_gamma=..., chunk_slots=...,
                    prefix_lengths=..., final_hidden=...)      # -> VariantLoss
    spec.save_hf(body, directory)

Variants whose module is missing in this installation are refused with a clear error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..config import DFlashConfig
from ..objectives import AdditiveMetrics
from .arguments import ArgumentError

__all__ = ["VariantLoss", "VariantSpec", "get_variant"]


@dataclass
class VariantLoss:
    """One micro-batch: `loss_sum` (differentiable), `weight_sum` (no grad), additive metrics.

    `metrics` is the variant's `objectives.AdditiveMetrics` (`DFlashMetrics`, `DFlash2Metrics`,
    `DominoMetrics`): the loop sums it over micro-batches and ranks and logs its `logged` ratios.
    """

    loss_sum: torch.Tensor
    weight_sum: torch.Tensor
    metrics: AdditiveMetrics


@dataclass
class VariantSpec:
    name: str
    config_cls: type
    build_body: Callable
    loss: Callable
    save_hf: Callable
    config_from_pretrained: Callable
    load_hf: Callable
    config_overrides: Callable = lambda args: {}
    needs_final_hidden: bool = False
    supports_prefix: bool = False


# ------------------------------------------------------------------------------------------ DFlash


def _dflash_body(config, parallel_config, attention_backend):
    from ..body import DFlashBody

    return DFlashBody(config, parallel_config=parallel_config, attention_backend=attention_backend)


def _dflash_loss(body, hidden, plan, input_ids, head, *, decay_gamma, chunk_slots, prefix_lengths=None,
                 final_hidden=None, args=None, **ctx):
    from ..objectives import dflash_loss

    soft_target = getattr(args, "dflash_soft_target", "none")
    out = dflash_loss(hidden, plan, input_ids, head, decay_gamma=decay_gamma, chunk_slots=chunk_slots,
                      prefix_lengths=prefix_lengths, teacher_hidden=final_hidden if soft_target != "none" else None,
                      soft_target=soft_target, temperature=float(getattr(args, "dflash_distill_temperature", 1.0)))
    return VariantLoss(out.loss_sum, out.weight_sum, out.metrics)


def _dflash_save(body, directory, dtype=None, overwrite=False):
    from ..checkpoint import save_hf_checkpoint

    save_hf_checkpoint(body, directory, dtype=dtype, overwrite=overwrite)


def _dflash_load(directory, tp_group=None, attention_backend="auto"):
    from ..checkpoint import load_hf_checkpoint

    return load_hf_checkpoint(directory, tp_group=tp_group, attention_backend=attention_backend)


# ------------------------------------------------------------------------------------------ DFlash 2


def _dflash2_body(config, parallel_config, attention_backend):
    from ..variants.dflash2 import DFlash2Body

    return DFlash2Body(config, parallel_config=parallel_config, attention_backend=attention_backend)


def _dflash2_loss(body, hidden, plan, input_ids, head, *, decay_gamma, chunk_slots, prefix_lengths=None,
                  final_hidden=None, args=None, **ctx):
    from ..variants.dflash2 import dflash2_loss

    if prefix_lengths is not None:
        raise ValueError("DFlash 2 does not train with variable prefixes.")
    out = dflash2_loss(hidden, plan, input_ids, head, body.candidate_selector, decay_gamma=decay_gamma,
                       chunk_slots=chunk_slots,
                       selector_weight=float(getattr(args, "dflash_selector_loss_weight", 1.0)))
    return VariantLoss(out.loss_sum, out.weight_sum, out.metrics)


def _dflash2_save(body, directory, dtype=None, overwrite=False):
    from ..variants.dflash2 import save_dflash2_checkpoint

    save_dflash2_checkpoint(body, directory, dtype=dtype, overwrite=overwrite)


def _dflash2_config_from_pretrained(directory):
    from ..variants.dflash2 import DFlash2Config

    return DFlash2Config.from_pretrained(directory)


def _dflash2_load(directory, tp_group=None, attention_backend="auto"):
    from ..variants.dflash2 import load_dflash2_checkpoint

    return load_dflash2_checkpoint(directory, tp_group=tp_group, attention_backend=attention_backend)


def _dflash2_cls():
    from ..variants.dflash2 import DFlash2Config

    return DFlash2Config


# ------------------------------------------------------------------------------------------ registry


def _dflash() -> VariantSpec:
    return VariantSpec(
        name="dflash", config_cls=DFlashConfig, build_body=_dflash_body, loss=_dflash_loss, save_hf=_dflash_save,
        config_from_pretrained=DFlashConfig.from_pretrained, load_hf=_dflash_load, supports_prefix=True,
    )


def _dflash2() -> VariantSpec:
    return VariantSpec(
        name="dflash2", config_cls=_dflash2_cls(), build_body=_dflash2_body, loss=_dflash2_loss,
        save_hf=_dflash2_save, config_from_pretrained=_dflash2_config_from_pretrained, load_hf=_dflash2_load,
    )


# ------------------------------------------------------------------------------------------ JetSpec


def _jetspec_loss(body, hidden, plan, input_ids, head, *, decay_gamma, chunk_slots, prefix_lengths=None,
                  final_hidden=None, args=None, **ctx):
    from ..variants.jetspec import jetspec_loss

    if prefix_lengths is not None:
        raise ValueError("JetSpec does not train with variable prefixes.")
    out = jetspec_loss(hidden, plan, input_ids, head, final_hidden, decay_gamma=decay_gamma, chunk_slots=chunk_slots,
                       temperature=float(getattr(args, "dflash_distill_temperature", 1.0)))
    return VariantLoss(out.loss_sum, out.weight_sum, out.metrics)


def _jetspec() -> VariantSpec:
    from ..variants.jetspec import JetSpecConfig

    return VariantSpec(
        name="jetspec", config_cls=JetSpecConfig, build_body=_dflash_body, loss=_jetspec_loss, save_hf=_dflash_save,
        config_from_pretrained=JetSpecConfig.from_pretrained, load_hf=_jetspec_load, needs_final_hidden=True,
        config_overrides=lambda args: {"causal": True},
    )


def _jetspec_load(directory, tp_group=None, attention_backend="auto"):
    from ..body import DFlashBody, default_parallel_config
    from ..checkpoint import load_hf_state_dict_into, read_safetensors
    from ..variants.jetspec import JetSpecConfig

    body = DFlashBody(JetSpecConfig.from_pretrained(directory), parallel_config=default_parallel_config(),
                      tp_group=tp_group, attention_backend=attention_backend)
    load_hf_state_dict_into(body, read_safetensors(directory))
    return body


# ------------------------------------------------------------------------------------------ Domino


def _domino_body(config, parallel_config, attention_backend):
    from ..variants.domino import DominoBody

    return DominoBody(config, parallel_config=parallel_config, attention_backend=attention_backend)


def _domino_loss(body, hidden, plan, input_ids, head, *, decay_gamma, chunk_slots, prefix_lengths=None,
                 final_hidden=None, args=None, step=0, embedding=None, input_mask=None, **ctx):
    from ..variants.domino import domino_lambda, domino_loss

    if prefix_lengths is not None:
        raise ValueError("Domino does not train with variable prefixes.")
    lam = domino_lambda(int(step), int(args.train_iters), lambda_start=args.dflash_domino_lambda_start,
                        decay_ratio=args.dflash_domino_decay_ratio)
    out = domino_loss(hidden, plan, input_ids, head, body.domino_head, embedding, lambda_base=lam,
                      decay_gamma=decay_gamma, input_embedding_scale=body.config.input_embedding_scale,
                      input_mask=input_mask, chunk_slots=chunk_slots)
    return VariantLoss(out.loss_sum, out.weight_sum, out.metrics)


def _domino_save(body, directory, dtype=None, overwrite=False):
    from ..variants.domino import save_domino_checkpoint

    save_domino_checkpoint(body, directory, dtype=dtype, overwrite=overwrite)


def _domino_load(directory, tp_group=None, attention_backend="auto"):
    from ..variants.domino import load_domino_checkpoint

    return load_domino_checkpoint(directory, tp_group=tp_group, attention_backend=attention_backend)


def _domino() -> VariantSpec:
    from ..variants.domino import DominoConfig

    return VariantSpec(
        name="domino", config_cls=DominoConfig, build_body=_domino_body, loss=_domino_loss, save_hf=_domino_save,
        config_from_pretrained=DominoConfig.from_pretrained, load_hf=_domino_load,
    )


_REGISTRY = {"dflash": _dflash, "dflash2": _dflash2, "jetspec": _jetspec, "domino": _domino}


def get_variant(name: str) -> VariantSpec:
    if name not in _REGISTRY:
        raise ArgumentError(f"--dflash-variant={name!r}: unknown; choose one of {sorted(_REGISTRY)}.")
    try:
        return _REGISTRY[name]()
    except (ImportError, AttributeError) as err:
        raise ArgumentError(
            f"--dflash-variant {name} is not available in this installation ({type(err).__name__}: {err})."
        ) from None
