"""What a draft variant takes from the command line, as plain data (docs/design.md §12).

A variant declares its settings as a `VariantOptions`: its own options dataclass, the command-line
flags that fill it (`Flag`: name, type, default, help, choices, the value check, and, for a setting of
the drafter's architecture, the config field it sets) and the general flags it reads too (`shared`,
e.g. the distillation temperature). `training.arguments` turns every declared flag into a parser
option and checks it; `training.job` builds the run's options record once (`VariantOptions.build`)
and the Job hands it to the variant's loss adapter. No variant reads the parsed arguments.

This module is torch-free, and so are the built-in variants' declarations below: `pretrain_dflash.py`
answers `--help` and usage errors before torch loads, and the parser needs every flag. The variant
registry (`registry.register_variant`) declares the options of a variant registered from outside
the package here too, so its flags reach the parser built after it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

__all__ = [
    "Flag",
    "VariantOptions",
    "NoOptions",
    "DFlashOptions",
    "DFlash2Options",
    "JetSpecOptions",
    "DominoOptions",
    "DSparkOptions",
    "VALUE_CHECKS",
    "BUILT_IN_OPTIONS",
    "declare_options",
    "forget_options",
    "declared_options",
]


# A value check of a flag: (accepts(value), what the message says after "--flag=value must be").
VALUE_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "positive_int": (lambda v: v >= 1, "an integer >= 1"),
    "non_negative_int": (lambda v: v >= 0, ">= 0"),
    "finite_non_negative": (lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0"),
    "unit_interval": (lambda v: math.isfinite(v) and 0.0 <= v <= 1.0, "in [0, 1]"),
}


@dataclass(frozen=True)
class Flag:
    """One command-line flag of a variant, as data (`training.arguments` makes the parser option).

    Fields:
        name: the flag, e.g. "--dflash-selector-rank" (the parsed arguments hold it as `dest`).
        field: the options dataclass field it fills.
        type: int, float or str; bool makes an on/off pair (``--x`` / ``--no-x``).
        default: the published recipe's value (the same for a run with `--target` and the embedded job).
        help: one line for `--help`.
        choices: the values allowed (None: any of `type`).
        check: a key of `VALUE_CHECKS` (None: no check beyond `type` and `choices`).
        config_field: the draft config field it sets, for a setting of the drafter's architecture: with
            `--dflash-init-from` it comes from the drafter (None unless given, and then it must agree).
    """

    name: str
    field: str
    type: type = str
    default: Any = None
    help: str = ""
    choices: Optional[tuple] = None
    check: Optional[str] = None
    config_field: Optional[str] = None

    def __post_init__(self):
        if not self.name.startswith("--"):
            raise ValueError(f"flag {self.name!r} must start with '--'.")
        if self.check is not None and self.check not in VALUE_CHECKS:
            raise ValueError(f"flag {self.name}: unknown check {self.check!r}; choose one of {sorted(VALUE_CHECKS)}.")

    @property
    def dest(self) -> str:
        """The attribute of the parsed arguments that holds its value."""
        return self.name[2:].replace("-", "_")

    def error(self, value) -> Optional[str]:
        """The one-line message for a value its check refuses (None: accepted, or not set)."""
        if value is None or self.check is None:
            return None
        accepts, what = VALUE_CHECKS[self.check]
        return None if accepts(value) else f"{self.name}={value} must be {what}."


@dataclass(frozen=True)
class VariantOptions:
    """A variant's settings: its options dataclass, its own flags, the general flags it reads.

    Fields:
        options_cls: a dataclass; one instance per run (`build`) reaches the variant's loss adapter.
        flags: the variant's own flags (refused for the other variants when given).
        shared: options field -> the parsed-arguments attribute of a general flag (declared by `training.arguments`).
    recipe_defaults: the parsed-arguments attribute of a general flag -> `(with --target, embedded job)`: the
        variant's published recipe where it differs from the general default (e.g. its block size); a value
        None keeps the general default. Applies only to flags left at their default.
        decode: a keyword of `decoding.generate.spec_generate` -> the options field that gives it: the run's
            decoding settings, which its decode evaluation passes (e.g. DSpark's confidence threshold).
    """

    options_cls: type
    flags: tuple[Flag, ...] = ()
    shared: Mapping[str, str] = field(default_factory=dict)
    recipe_defaults: Mapping[str, tuple] = field(default_factory=dict)
    decode: Mapping[str, str] = field(default_factory=dict)

    def build(self, values: Mapping[str, Any]):
        """The options record of one run from the parsed (and resolved) arguments, `vars(args)`."""
        kwargs = {flag.field: values[flag.dest] for flag in self.flags}
        kwargs.update({name: values[dest] for name, dest in self.shared.items()})
        return self.options_cls(**kwargs)

    def decode_kwargs(self, options) -> dict:
        """The `spec_generate` keywords of the run's settings (`decode`)."""
        return {keyword: getattr(options, name) for keyword, name in self.decode.items()}

    def config_overrides(self, options) -> dict:
        """Draft config fields the run's settings give (the architecture flags that hold a value)."""
        out = {}
        for flag in self.flags:
            value = getattr(options, flag.field)
            if flag.config_field is not None and value is not None:
                out[flag.config_field] = value
        return out


# ================================================================================== the built-in variants


@dataclass(frozen=True)
class NoOptions:
    """A variant without settings of its own."""


@dataclass(frozen=True)
class DFlashOptions:
    """DFlash: train on the data tokens, or against the target's distribution (`soft_target` "ce" / "kl" at
    `temperature`)."""

    soft_target: str = "none"
    temperature: float = 1.0


@dataclass(frozen=True)
class DFlash2Options:
    """DFlash 2: the selector's and convolutions' sizes (None: the drafter's) and the selector loss weight."""

    selector_loss_weight: float = 1.0
    selector_rank: Optional[int] = 256
    selector_top_k: Optional[int] = 16
    conv_kernel_size: Optional[int] = 2
    conv_group_size: Optional[int] = 16


@dataclass(frozen=True)
class JetSpecOptions:
    """JetSpec: the temperature of its distillation to the target."""

    temperature: float = 1.0


@dataclass(frozen=True)
class DominoOptions:
    """Domino: the correction head's sizes (None: the drafter's) and the backbone-loss curriculum."""

    lambda_start: float = 1.0
    decay_ratio: float = 0.5
    projector_type: str = "domino"
    emb_dim: Optional[int] = 256
    gru_hidden_dim: Optional[int] = 1024
    shift_label: Optional[bool] = True
    pure_draft_prefix_len: Optional[int] = 1


@dataclass(frozen=True)
class DSparkOptions:
    """DSpark: the Markov head's and confidence head's architecture (None: the drafter's), the three loss
    weights (CE on the data, L1 to the target's distribution, BCE of the confidence head) and the decoding
    confidence threshold (None: every drafted token is proposed)."""

    markov_rank: Optional[int] = 256
    markov_head_type: Optional[str] = "vanilla"
    confidence_head: Optional[bool] = True
    confidence_head_with_markov: Optional[bool] = True
    ce_loss_weight: float = 0.1
    l1_loss_weight: float = 0.9
    bce_loss_weight: float = 1.0
    confidence_threshold: Optional[float] = None


DFLASH_OPTIONS = VariantOptions(
    DFlashOptions, shared={"soft_target": "dflash_soft_target", "temperature": "dflash_distill_temperature"},
)

DFLASH2_OPTIONS = VariantOptions(DFlash2Options, flags=(
    Flag("--dflash-selector-rank", "selector_rank", int, 256, check="positive_int", config_field="selector_rank",
         help="DFlash 2: width of the candidate selector's codebooks."),
    Flag("--dflash-selector-top-k", "selector_top_k", int, 16, check="positive_int", config_field="selector_top_k",
         help="DFlash 2: candidates per drafted position."),
    Flag("--dflash-conv-kernel-size", "conv_kernel_size", int, 2, check="positive_int",
         config_field="conv_kernel_size", help="DFlash 2: taps of the in-block convolutions."),
    Flag("--dflash-conv-group-size", "conv_group_size", int, 16, check="positive_int",
         config_field="conv_group_size", help="DFlash 2: channels sharing one dynamic convolution coefficient."),
    Flag("--dflash-selector-loss-weight", "selector_loss_weight", float, 1.0, check="finite_non_negative",
         help="DFlash 2: weight of the candidate-selection loss."),
))

JETSPEC_OPTIONS = VariantOptions(JetSpecOptions, shared={"temperature": "dflash_distill_temperature"})

DOMINO_OPTIONS = VariantOptions(DominoOptions, flags=(
    Flag("--dflash-domino-lambda-start", "lambda_start", float, 1.0, check="unit_interval",
         help="Domino: initial weight of the backbone-only loss (curriculum)."),
    Flag("--dflash-domino-decay-ratio", "decay_ratio", float, 0.5, check="unit_interval",
         help="Domino: fraction of training over which that weight decays to 0."),
    Flag("--dflash-domino-projector-type", "projector_type", str, "domino", choices=("domino",),
         help="Domino: the correction head (the only one published)."),
    Flag("--dflash-domino-emb-dim", "emb_dim", int, 256, check="positive_int", config_field="emb_dim",
         help="Domino: width of the correction MLP."),
    Flag("--dflash-domino-gru-hidden-dim", "gru_hidden_dim", int, 1024, check="positive_int",
         config_field="gru_hidden_dim", help="Domino: GRU state size."),
    Flag("--dflash-domino-shift-label", "shift_label", bool, True, config_field="shift_label",
         help="Domino: slot k of a block at p predicts x[p + 1 + k] (slot 0 included), not x[p + k]."),
    Flag("--dflash-domino-pure-draft-prefix-len", "pure_draft_prefix_len", int, 1, check="non_negative_int",
         config_field="pure_draft_prefix_len", help="Domino: leading predicted slots left uncorrected."),
))

DSPARK_OPTIONS = VariantOptions(DSparkOptions, flags=(
    Flag("--dflash-markov-rank", "markov_rank", int, 256, check="non_negative_int", config_field="markov_rank",
         help="DSpark: width r of the Markov head (W1 [V, r], W2 [V, r]); 0: no Markov head."),
    Flag("--dflash-markov-head-type", "markov_head_type", str, "vanilla", choices=("vanilla", "gated", "rnn"),
         config_field="markov_head_type",
         help="DSpark: the Markov head's form: W1[prev] (vanilla), gated by the hidden state, or a recurrence (rnn)."),
    Flag("--dflash-confidence-head", "confidence_head", bool, True, config_field="enable_confidence_head",
         help="DSpark: train the confidence head (the per-slot acceptance predictor)."),
    Flag("--dflash-confidence-head-with-markov", "confidence_head_with_markov", bool, True,
         config_field="confidence_head_with_markov",
         help="DSpark: the confidence head also reads W1[prev] (input H + r instead of H)."),
    Flag("--dflash-ce-loss-weight", "ce_loss_weight", float, 0.1, check="finite_non_negative",
         help="DSpark: weight of the cross entropy on the data tokens."),
    Flag("--dflash-l1-loss-weight", "l1_loss_weight", float, 0.9, check="finite_non_negative",
         help="DSpark: weight of the L1 distance to the target's distribution."),
    Flag("--dflash-bce-loss-weight", "bce_loss_weight", float, 1.0, check="finite_non_negative",
         help="DSpark: weight of the confidence head's binary cross entropy."),
    Flag("--dflash-confidence-threshold", "confidence_threshold", float, None, check="unit_interval",
         help="DSpark decoding: stop a drafted block at the first slot whose predicted acceptance is below this "
         "(off by default)."),
), recipe_defaults={
    # The published DSpark recipe: 7 predicted slots per block (slot 0 predicts too), 5 layers, decay 4.
    "dflash_block_size": (7, 7),
    "dflash_num_layers": (5, None),
    "dflash_decay_gamma": (4.0, 4.0),
    "dflash_anchors_per_sample": (512, None),
}, decode={"confidence_threshold": "confidence_threshold"})

# The built-in variants a user asks for by `--dflash-variant`, in the order `--help` lists them.
BUILT_IN_OPTIONS: dict[str, VariantOptions] = {
    "dflash": DFLASH_OPTIONS,
    "dflash2": DFLASH2_OPTIONS,
    "domino": DOMINO_OPTIONS,
    "jetspec": JETSPEC_OPTIONS,
    "dspark": DSPARK_OPTIONS,
}


# ================================================================================== declared options

_DECLARED: dict[str, VariantOptions] = dict(BUILT_IN_OPTIONS)


def declare_options(name: str, options: VariantOptions) -> None:
    """Make variant `name`'s flags known to the parser (`registry.register_variant` calls it).

    Raises:
        ValueError: `options` is not a `VariantOptions`, or one of its flags is another variant's.
    """
    if not isinstance(options, VariantOptions):
        raise ValueError(f"variant {name!r}: options must be a VariantOptions, got {type(options).__name__}.")
    for other, declared in _DECLARED.items():
        if other == name:
            continue
        taken = {f.name for f in declared.flags} & {f.name for f in options.flags}
        if taken:
            raise ValueError(f"variant {name!r} declares {sorted(taken)[0]}, a flag of variant {other!r} already; "
                             "name the flag after the variant.")
    _DECLARED[name] = options


def forget_options(name: str) -> None:
    """Drop the flags of a variant that is unregistered (the built-in ones stay)."""
    if name not in BUILT_IN_OPTIONS:
        _DECLARED.pop(name, None)


def declared_options() -> dict[str, VariantOptions]:
    """Variant name -> its declared options, built-in ones first."""
    return dict(_DECLARED)
