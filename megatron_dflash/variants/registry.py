"""The draft variants: one typed registry, the only place that knows which variants exist.

A `Variant` says everything the rest of the package asks of a draft variant (docs/design.md §12):

* **what it is**: `name` (the `--dflash-variant` id), its config class and body class;
* **its HF files**: the architecture it writes, the names other trainers write for it (NeMo AutoModel's
  `Qwen3...` classes), and, where a name is shared, the rule that tells its files apart
  (`hf_match`: JetSpec is a causal `DFlashDraftModel`, the first SpecForge Domino layout a
  `DFlashDraftModel` with `projector_type: "domino"`);
* **its settings**: `options`, a `variants.options.VariantOptions`: its options dataclass and the flags
  that fill it, declared as data (`training.arguments` makes the parser options, `training.job` builds
  the run's record once);
* **its objective**: `loss`, a thin adapter from the micro-batch, the run's options record and the
  schedule's facts (step, total steps) to the variant's loss function, returning a `VariantLoss`;
* **its draft family**: the body family it builds (`draft_family`; "qwen3", the Qwen3-style draft of
  `draft/body.py`, unless it says otherwise). A target family names the draft family it is served by
  (`target.families.TargetFamily.draft_family`); `variant_for_draft_family` picks the variant that trains the
  requested objective on that family's body (`trains_as`);
* **its decoding**: `proposer`, which hands `decoding.generate.spec_generate` the function that turns one
  block's draft hidden states into draft tokens (None: each slot's own argmax or sample); how many tokens a
  block proposes (`proposes_every_slot`: DSpark's slot 0 proposes too); `confidence_proposer`, a proposer
  that stops a block at a confidence threshold;
* **its capabilities**: variable prefixes (D2SD), soft targets, the target's final hidden state,
  the weight dtypes it runs in, a forced in-block direction, uniform loss weights by default.

Who asks: `training.arguments` (choices and checks), `training.job` (config, options record, draft family), `training.loop` (body),
`training.step` (loss), `checkpoint` (HF save / load), `convert` (which variant a file is), `generate` (proposer) and
`tools/evaluate_acceptance.py` (dtype).

Adding a variant is one module (its config, body, loss) and one `register_variant(Variant(...))`; a
variant may be registered from outside the package the same way. Files are matched against the
variants registered last first, so a new variant may claim files a built-in one would read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch
from torch import nn

from ..draft.body import DFlashBody, default_parallel_config
from ..draft.config import DFLASH_ARCHITECTURE, DFlashConfig, resolve_causal
from ..draft.draft_vocab import read_vocab_tensors
from ..draft.kimi_k3.body import KimiK3Body
from ..draft.kimi_k3.config import KIMI_K3_DRAFT_ARCHITECTURE, KIMI_K3_DRAFT_FAMILY, KimiK3DraftConfig
from ..objectives.dflash_loss import AdditiveMetrics, dflash_loss
from .dflash2 import (
    DFLASH2_ARCHITECTURE,
    DFLASH2_DTYPES,
    NEMO_DFLASH2_ARCHITECTURE,
    DFlash2Body,
    DFlash2Config,
    dflash2_loss,
)
from .dspark import (
    DSPARK_ARCHITECTURE,
    KIMI_K3_DSPARK_ARCHITECTURE,
    DSparkBody,
    DSparkConfig,
    KimiK3DSparkBody,
    KimiK3DSparkConfig,
    dspark_variant_loss,
    is_dspark_hf_config,
    read_dspark_tensors,
)
from .domino import DOMINO_ARCHITECTURE, DominoBody, DominoConfig, domino_lambda, domino_loss, is_domino_hf_config
from .jetspec import JetSpecConfig, jetspec_loss
from .options import (
    DFLASH2_OPTIONS,
    DFLASH_OPTIONS,
    DOMINO_OPTIONS,
    DSPARK_OPTIONS,
    JETSPEC_OPTIONS,
    NoOptions,
    VariantOptions,
    declare_options,
    forget_options,
)

__all__ = [
    "Variant",
    "VariantLoss",
    "register_variant",
    "unregister_variant",
    "get_variant",
    "variant_names",
    "variant_of",
    "variant_for_hf_config",
    "variant_for_draft_family",
    "QWEN3_DRAFT_FAMILY",
    "config_from_hf_dict",
]

ALL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# (hidden [B, W, H], anchor_ids [B], head, embedding, temperature, generator) -> (tokens [B, T], probs or None
# [, lengths [B] or None]), T = `Variant.proposals_per_block(W)`; see `decoding.generate._propose`
ProposeFn = Callable[..., tuple]


@dataclass
class VariantLoss:
    """One micro-batch: `loss_sum` (differentiable), `weight_sum` (no grad), additive metrics.

    `metrics` is the variant's `objectives.dflash_loss.dflash_loss.AdditiveMetrics` (`DFlashMetrics`, `DFlash2Metrics`,
    `DominoMetrics`): the loop sums it over micro-batches and ranks and logs its `logged` ratios.
    """

    loss_sum: torch.Tensor
    weight_sum: torch.Tensor
    metrics: AdditiveMetrics


# The draft family of `draft/body.py`'s Qwen3-style body, which every variant builds unless it says otherwise.
QWEN3_DRAFT_FAMILY = "qwen3"


@dataclass(frozen=True)
class Variant:
    """One draft variant (see the module docstring).

    Fields:
        name: the `--dflash-variant` id, e.g. "dflash2".
        title: its name in messages, e.g. "DFlash 2".
        config_cls: a `DFlashConfig` subclass (or `DFlashConfig`): `from_hf_dict` / `from_pretrained`
            read its files, `to_hf_dict` writes them.
        body_cls: `body_cls(config, parallel_config=, tp_group=, attention_backend=)` builds the body.
        architecture: `architectures[0]` of the config.json it writes.
        loss: `loss(body, hidden, plan, input_ids, head, *, decay_gamma, weighting, chunk_slots, prefix_lengths,
            final_hidden, options, step, total_steps, embedding, input_mask) -> VariantLoss`; `options` is
            the run's record of `options.options_cls`, `total_steps` the schedule's iterations, `weighting` the
            run's `objectives.dflash_loss.dflash_loss.LossWeighting` (a D-PACE one only with `supports_dpace`).
        options: its settings and command-line flags, as data (`variants.options.VariantOptions`).
        hf_aliases: other `architectures[0]` names of the same draft (other trainers' class names).
        hf_match: a predicate on a config.json dict, for variants whose files cannot be told by name
            alone; replaces the name test when given.
        proposer: `proposer(body) -> ProposeFn` for decoding (see `decoding.generate.spec_generate`); None: each
            slot proposes its own argmax (or sample).
        proposes_every_slot: every slot of a block proposes a token, slot 0 (the anchor's) included: `W`
            proposals per block, verified by the target as `[anchor, d_1 .. d_W]` (DSpark); else slots
            `1..W-1` do (`W - 1` proposals, a verify block of `W`).
        confidence_proposer: `confidence_proposer(body, threshold) -> ProposeFn`, the proposer that stops each
            block at the first slot whose predicted acceptance is below `threshold` (returning each row's count;
            it checks the body can); None: the variant has no confidence head.
        draft_family: the body family it builds (`QWEN3_DRAFT_FAMILY`, or a target family's own draft).
        trains_as: for a draft family's own form of another variant's objective, that variant's name (e.g. the
            Kimi K3 MLA draft trains as "dflash"); such a variant is not asked for by name.
        supports_variable_prefix: trains with `--dflash-variable-prefix` (D2SD).
        supports_soft_targets: trains with `--dflash-soft-target` (the target's distribution).
        supports_dpace: trains with `--dflash-loss-weighting dpace` (its loss is the cross entropy with the
            label, weighted per slot).
        needs_final_hidden: its loss reads the target's final hidden state (distillation); it takes
            `--dflash-distill-temperature` when its options record reads that flag (JetSpec; not DSpark).
        dtypes: the weight dtypes it trains, converts and serves in.
        dtype_reason: why other dtypes are refused (for the message).
        causal: the in-block direction it forces on every layer (None: the config's).
        uniform_loss_weights: its published recipe weights every slot alike (no decay by default).
        hf_tensors: how it reads a HF file's tensors before loading them (drop what other trainers add beside the
            draft, refuse a foreign layout with its own message); None: as they are.
        anchor_lookahead: the batch plan's anchor rule (`plan.batch_plan.build_dflash_batch_plan`'s `lookahead`):
            a block is drawn when one of the positions ``p + 1 .. p + anchor_lookahead`` is supervised; None: any
            of the block's. DSpark: 1 (its supervision stops at the first unsupervised label, ``x_{p+1}`` first).
    """

    name: str
    title: str
    config_cls: type
    body_cls: type
    architecture: str
    loss: Callable[..., VariantLoss]
    hf_aliases: tuple[str, ...] = ()
    hf_match: Optional[Callable[[Mapping[str, Any]], bool]] = None
    proposer: Optional[Callable[[nn.Module], ProposeFn]] = None
    proposes_every_slot: bool = False
    confidence_proposer: Optional[Callable[[nn.Module, float], ProposeFn]] = None
    options: VariantOptions = VariantOptions(NoOptions)
    draft_family: str = QWEN3_DRAFT_FAMILY
    trains_as: Optional[str] = None
    supports_variable_prefix: bool = False
    supports_soft_targets: bool = False
    supports_dpace: bool = False
    needs_final_hidden: bool = False
    dtypes: tuple[torch.dtype, ...] = ALL_DTYPES
    dtype_reason: str = ""
    causal: Optional[bool] = None
    uniform_loss_weights: bool = False
    hf_tensors: Optional[Callable[[Mapping[str, torch.Tensor]], dict]] = None
    anchor_lookahead: Optional[int] = None

    # ------------------------------------------------------------------ HF files
    @property
    def hf_names(self) -> tuple[str, ...]:
        return (self.architecture, *self.hf_aliases)

    def accepts(self, data: Mapping[str, Any]) -> bool:
        """Whether this variant reads a config.json dict."""
        if self.hf_match is not None:
            try:
                return bool(self.hf_match(data))
            except (AttributeError, TypeError, ValueError):  # malformed: the config parser says what is wrong
                return False
        return _first_architecture(data) in self.hf_names

    def read_hf_tensors(self, tensors: Mapping[str, torch.Tensor], config=None) -> dict[str, torch.Tensor]:
        """A HF file's tensors as this variant's body loads them (`hf_tensors`); ``config`` (the file's) gives the
        sizes a reduced vocabulary's ``d2t`` / ``t2d`` are checked against."""
        tensors = read_vocab_tensors(tensors, config)  # a reduced vocabulary's d2t / t2d (docs/design.md §20)
        return tensors if self.hf_tensors is None else self.hf_tensors(tensors)

    def config_from_pretrained(self, directory: str) -> DFlashConfig:
        """The config of a HF draft directory, read as this variant."""
        return self.config_cls.from_pretrained(directory)

    def config_overrides(self, options) -> dict:
        """Config fields this variant sets for a training run (its forced direction, its architecture settings
        in `options`, the run's record of `self.options.options_cls`)."""
        out = {} if self.causal is None else {"causal": self.causal}
        out.update(self.options.config_overrides(options))
        return out

    # ------------------------------------------------------------------ bodies
    def build_body(self, config, parallel_config=None, tp_group=None, attention_backend: str = "auto") -> nn.Module:
        """A new body for `config` (weights initialised; any TP size the config allows)."""
        if parallel_config is not None:
            self.check_dtype(parallel_config.params_dtype)
        return self.body_cls(
            config, parallel_config=parallel_config or default_parallel_config(), tp_group=tp_group,
            attention_backend=attention_backend,
        )

    def check_dtype(self, dtype: Optional[torch.dtype], what: str = "weights") -> None:
        """Raise `ValueError` when this variant does not run in `dtype` (None: the default, allowed)."""
        if dtype is None or dtype in self.dtypes:
            return
        allowed = " or ".join(str(d).removeprefix("torch.") for d in self.dtypes)
        reason = f" ({self.dtype_reason})" if self.dtype_reason else ""
        raise ValueError(
            f"{self.title} cannot use {str(dtype).removeprefix('torch.')} {what}{reason}; train, convert and "
            f"serve it in {allowed} (e.g. --dtype bf16)."
        )

    def propose_fn(self, body: nn.Module, confidence_threshold: Optional[float] = None) -> Optional[ProposeFn]:
        """The decode proposer of `body` (None: per-slot argmax / sampling); with `confidence_threshold`, the one
        that stops blocks early (`confidence_proposer`).

        Raises:
            ValueError: a threshold for a variant without a confidence head (or a body without one).
        """
        if confidence_threshold is None:
            return None if self.proposer is None else self.proposer(body)
        if self.confidence_proposer is None:
            raise ValueError(f"{self.title} drafts have no confidence head, so a confidence threshold cannot stop "
                             "their blocks; leave it off (it is for DSpark drafts).")
        return self.confidence_proposer(body, confidence_threshold)

    def proposals_per_block(self, block_size: int) -> int:
        """Draft tokens one block proposes: `block_size` when every slot proposes, else `block_size - 1`."""
        return block_size if self.proposes_every_slot else block_size - 1


def _first_architecture(data: Mapping[str, Any]) -> str:
    return (data.get("architectures") or [DFLASH_ARCHITECTURE])[0]


# ================================================================================== the registry

_VARIANTS: dict[str, Variant] = {}
_BUILT_IN: set[str] = set()


def register_variant(variant: Variant) -> Variant:
    """Make `variant` known to training, HF save / load, conversion and decoding.

    Raises:
        ValueError: a variant of that name is registered already, or `variant` is not a `Variant`, or one of
            its flags is another variant's.
    """
    if not isinstance(variant, Variant):
        raise ValueError(f"register_variant takes a Variant, got {type(variant).__name__}.")
    if variant.name in _VARIANTS:
        raise ValueError(
            f"a draft variant named {variant.name!r} is registered already ({_VARIANTS[variant.name].title}); "
            "choose another name, or unregister_variant() the old one first."
        )
    if variant.trains_as is None:  # a family's form of another variant's objective takes that variant's flags
        declare_options(variant.name, variant.options)  # its flags reach the parser built from now on
    _VARIANTS[variant.name] = variant
    return variant


def unregister_variant(name: str) -> Variant:
    """Forget a variant registered with `register_variant` (the built-in ones stay)."""
    if name in _BUILT_IN:
        raise ValueError(f"{name!r} is a built-in draft variant; it cannot be unregistered.")
    if name not in _VARIANTS:
        raise ValueError(f"no draft variant named {name!r} is registered (registered: {variant_names()}).")
    forget_options(name)
    return _VARIANTS.pop(name)


def variant_names() -> list[str]:
    """The registered `--dflash-variant` ids, in registration order."""
    return list(_VARIANTS)


def get_variant(name: str) -> Variant:
    """The variant registered as `name`; `ValueError` listing the registered ones otherwise."""
    if name not in _VARIANTS:
        raise ValueError(f"unknown draft variant {name!r}; choose one of {variant_names()}.")
    return _VARIANTS[name]


def variant_of(body: nn.Module) -> Variant:
    """The variant of a built body: the one registered for its config's class (nearest base first),
    whose body class it must be.

    Raises:
        ValueError: no variant is registered for the config, or the body is not that variant's
            (e.g. a `DFlashBody` built with a `DominoConfig`: it has no Domino head).
    """
    config = getattr(body, "config", None)
    for cls in type(config).__mro__:
        candidates = [v for v in reversed(_VARIANTS.values()) if v.config_cls is cls]
        for variant in candidates:
            if isinstance(body, variant.body_cls):
                return variant
        if candidates:
            raise ValueError(
                f"a {type(body).__name__} with a {type(config).__name__} is not a {candidates[0].title} draft: "
                f"build it as a {candidates[0].body_cls.__name__}."
            )
    raise ValueError(
        f"{type(body).__name__} with {type(config).__name__} is not a registered draft variant; register it with "
        "megatron_dflash.variants.register_variant(Variant(...))."
    )


def variant_for_hf_config(data: Mapping[str, Any], source: str = "config") -> Variant:
    """The variant that reads a HF-layout config dict (checked last-registered first)."""
    for variant in reversed(_VARIANTS.values()):
        if variant.accepts(data):
            return variant
    known = sorted({n for v in _VARIANTS.values() for n in v.hf_names})
    raise ValueError(
        f"{source} has architectures={data.get('architectures')}, not a draft model (known draft architectures: "
        f"{known}); pass a DFlash drafter directory, or register a new variant with "
        "megatron_dflash.variants.register_variant(...)."
    )


def variant_for_draft_family(requested: Variant, draft_family: str) -> Variant:
    """The variant that trains `requested`'s objective on `draft_family`'s body: `requested` itself when it builds
    that family's body, else the family's own form of it (a variant with `trains_as` = `requested.name`).

    Raises:
        ValueError: the draft family has no form of `requested` (the message lists what it supports).
    """
    if requested.draft_family == draft_family and requested.trains_as is None:
        return requested
    for variant in reversed(_VARIANTS.values()):
        if variant.draft_family == draft_family and variant.trains_as == requested.name:
            return variant
    if draft_family == QWEN3_DRAFT_FAMILY:
        supported = "every variant of the Qwen3-style draft"
    else:
        supported = [v.trains_as or v.name for v in _VARIANTS.values() if v.draft_family == draft_family]
    raise ValueError(f"the {draft_family} draft family has no {requested.name} draft; it supports {supported}.")


def config_from_hf_dict(data: Mapping[str, Any], source: str = "config") -> tuple[Variant, DFlashConfig]:
    """`(variant, config)` of a HF-layout config dict; `ValueError` naming `source` when it is invalid."""
    variant = variant_for_hf_config(data, source)
    try:
        config = variant.config_cls.from_hf_dict(dict(data))
    except (TypeError, KeyError, ValueError, AttributeError) as err:
        raise ValueError(f"{source} is not a valid {variant.architecture} config: {err}") from err
    return variant, config


# ================================================================================== loss adapters
# Thin calls into each variant's loss function: the micro-batch and the run's options record in, a
# `VariantLoss` out.


def _no_prefix(title: str, prefix_lengths) -> None:
    if prefix_lengths is not None:
        raise ValueError(f"{title} does not train with variable prefixes.")


def _static_weights(title: str, weighting) -> None:
    if weighting is not None and weighting.dynamic:
        raise ValueError(f"{title} does not train with --dflash-loss-weighting {weighting.scheme}.")


def _dflash_loss(body, hidden, plan, input_ids, head, *, decay_gamma, chunk_slots, prefix_lengths=None,
                 final_hidden=None, options=None, weighting=None, **ctx) -> VariantLoss:
    options = options or DFLASH_OPTIONS.options_cls()
    soft = options.soft_target != "none"
    out = dflash_loss(hidden, plan, input_ids, head, decay_gamma=decay_gamma, chunk_slots=chunk_slots,
                      prefix_lengths=prefix_lengths, teacher_hidden=final_hidden if soft else None,
                      soft_target=options.soft_target, temperature=float(options.temperature), weighting=weighting)
    return VariantLoss(out.loss_sum, out.weight_sum, out.metrics)


def _dflash2_loss(body, hidden, plan, input_ids, head, *, decay_gamma, chunk_slots, prefix_lengths=None,
                  options=None, weighting=None, **ctx) -> VariantLoss:
    _no_prefix("DFlash 2", prefix_lengths)
    options = options or DFLASH2_OPTIONS.options_cls()
    out = dflash2_loss(hidden, plan, input_ids, head, body.candidate_selector, decay_gamma=decay_gamma,
                       chunk_slots=chunk_slots, selector_weight=float(options.selector_loss_weight),
                       weighting=weighting)
    return VariantLoss(out.loss_sum, out.weight_sum, out.metrics)


def _jetspec_loss(body, hidden, plan, input_ids, head, *, decay_gamma, chunk_slots, prefix_lengths=None,
                  final_hidden=None, options=None, weighting=None, **ctx) -> VariantLoss:
    _no_prefix("JetSpec", prefix_lengths)
    _static_weights("JetSpec", weighting)
    options = options or JETSPEC_OPTIONS.options_cls()
    out = jetspec_loss(hidden, plan, input_ids, head, final_hidden, decay_gamma=decay_gamma,
                       chunk_slots=chunk_slots, temperature=float(options.temperature))
    return VariantLoss(out.loss_sum, out.weight_sum, out.metrics)


def _domino_loss(body, hidden, plan, input_ids, head, *, decay_gamma, chunk_slots, prefix_lengths=None,
                 options=None, step=0, total_steps, embedding=None, input_mask=None, weighting=None,
                 **ctx) -> VariantLoss:
    """`total_steps`: the schedule's iterations (`--train-iters`), over which the curriculum decays."""
    _no_prefix("Domino", prefix_lengths)
    _static_weights("Domino", weighting)
    options = options or DOMINO_OPTIONS.options_cls()
    lam = domino_lambda(int(step), int(total_steps), lambda_start=options.lambda_start,
                        decay_ratio=options.decay_ratio)
    out = domino_loss(hidden, plan, input_ids, head, body.domino_head, embedding, lambda_base=lam,
                      decay_gamma=decay_gamma, input_embedding_scale=body.config.input_embedding_scale,
                      input_mask=input_mask, chunk_slots=chunk_slots)
    return VariantLoss(out.loss_sum, out.weight_sum, out.metrics)


def _dspark_loss(*args, **kwargs) -> VariantLoss:
    out = dspark_variant_loss(*args, **kwargs)
    return VariantLoss(out.loss_sum, out.weight_sum, out.metrics)


# ================================================================================== the built-in variants

# NeMo AutoModel names its drafters after its Qwen3 classes; they are the same drafts.
_NEMO_DFLASH_ARCHITECTURE = "Qwen3DFlashDraftModel"


def _is_causal_dflash_file(data: Mapping[str, Any]) -> bool:
    """A (NeMo or our) `DFlashDraftModel` file that declares causal in-block attention: JetSpec."""
    if _first_architecture(data) not in (DFLASH_ARCHITECTURE, _NEMO_DFLASH_ARCHITECTURE):
        return False
    dflash_config = data.get("dflash_config") or {}
    if dflash_config.get("projector_type", data.get("projector_type")) not in (None, "dflash"):
        return False
    return resolve_causal(data) is True


def _propose_block(body: nn.Module) -> ProposeFn:
    return body.propose_block


def _confidence_proposer(body: nn.Module, threshold: float) -> ProposeFn:
    return body.confidence_proposer(threshold)


for _variant in (
    Variant(
        name="dflash", title="DFlash", config_cls=DFlashConfig, body_cls=DFlashBody,
        architecture=DFLASH_ARCHITECTURE, hf_aliases=(_NEMO_DFLASH_ARCHITECTURE,), loss=_dflash_loss,
        options=DFLASH_OPTIONS, supports_variable_prefix=True, supports_soft_targets=True, supports_dpace=True,
    ),
    Variant(
        name="dflash2", title="DFlash 2", config_cls=DFlash2Config, body_cls=DFlash2Body,
        architecture=DFLASH2_ARCHITECTURE, hf_aliases=(NEMO_DFLASH2_ARCHITECTURE,),
        loss=_dflash2_loss, options=DFLASH2_OPTIONS, proposer=_propose_block, dtypes=DFLASH2_DTYPES, supports_dpace=True,
        dtype_reason="DFlash 2 overflows in float16: its acceptance drops to 0",
    ),
    Variant(
        name="jetspec", title="JetSpec", config_cls=JetSpecConfig, body_cls=DFlashBody,
        architecture=DFLASH_ARCHITECTURE, hf_aliases=(_NEMO_DFLASH_ARCHITECTURE,), hf_match=_is_causal_dflash_file,
        loss=_jetspec_loss, options=JETSPEC_OPTIONS, needs_final_hidden=True, causal=True, uniform_loss_weights=True,
    ),
    Variant(
        name="domino", title="Domino", config_cls=DominoConfig, body_cls=DominoBody,
        architecture=DOMINO_ARCHITECTURE, hf_match=is_domino_hf_config, loss=_domino_loss,
        options=DOMINO_OPTIONS, proposer=_propose_block,
    ),
    # The Kimi K3 MLA draft family (docs/design.md §16 Kimi K3 draft family): another body, trained with
    # the DFlash objective; the Kimi K3 target family (`target/families.py`) names this draft family.
    Variant(
        name="kimi_k3", title="DFlash (Kimi K3 MLA draft)", config_cls=KimiK3DraftConfig, body_cls=KimiK3Body,
        architecture=KIMI_K3_DRAFT_ARCHITECTURE, loss=_dflash_loss, options=DFLASH_OPTIONS,
        draft_family=KIMI_K3_DRAFT_FAMILY, trains_as="dflash", supports_dpace=True,
    ),
    # DSpark (docs/design.md §18 DSpark): the Markov and confidence heads on the Qwen3-style body, and the same
    # heads on the Kimi K3 MLA body (its family's form of the objective).
    Variant(
        name="dspark", title="DSpark", config_cls=DSparkConfig, body_cls=DSparkBody,
        architecture=DSPARK_ARCHITECTURE, hf_match=is_dspark_hf_config, loss=_dspark_loss, options=DSPARK_OPTIONS,
        proposer=_propose_block, proposes_every_slot=True, confidence_proposer=_confidence_proposer,
        needs_final_hidden=True, hf_tensors=read_dspark_tensors, supports_dpace=True, anchor_lookahead=1,
    ),
    Variant(
        name="kimi_k3_dspark", title="DSpark (Kimi K3 MLA draft)", config_cls=KimiK3DSparkConfig,
        body_cls=KimiK3DSparkBody, architecture=KIMI_K3_DSPARK_ARCHITECTURE, loss=_dspark_loss,
        options=DSPARK_OPTIONS, draft_family=KIMI_K3_DRAFT_FAMILY, trains_as="dspark", needs_final_hidden=True,
        proposer=_propose_block, proposes_every_slot=True, confidence_proposer=_confidence_proposer,
        hf_tensors=read_dspark_tensors, supports_dpace=True, anchor_lookahead=1,
    ),
):
    register_variant(_variant)
    _BUILT_IN.add(_variant.name)
del _variant
