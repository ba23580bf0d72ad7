"""The draft variants a checkpoint can hold, and how a HF-layout config dict picks one.

`ARCHITECTURES` maps a variant id to its `DraftArchitecture` (config class, body class, the
`architectures[0]` name it is written under, whether it allows float16); the HF loader
(`checkpoint.py`), the torch_dist layout (`torch_dist.py`) and the converter (`convert.py`) ask it
which variant a `config.json` / `dflash_config.json` describes, and which variant a body is.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from typing import Any, Mapping, Optional

from .config import architecture_name, resolve_causal


@dataclasses.dataclass(frozen=True)
class DraftArchitecture:
    """How to recognise and build one draft variant.

    Fields:
        name: the `architectures[0]` its config.json carries (several variants may share one:
            JetSpec is written as `DFlashDraftModel` with `is_causal: true`).
        config_class / body_class: classes or lazy `"module:attribute"` references.
            `config_class.from_hf_dict(dict)` reads the config; `body_class(config,
            parallel_config=, tp_group=, attention_backend=)` builds the body.
        allows_fp16: False refuses float16 weights (DFlash 2 overflows in fp16, docs/design.md §15 Pitfalls).
        matches: optional predicate (or `"module:function"`) on a config.json dict; without one a
            dict matches when its `architectures[0]` is `name` (`DFlashDraftModel` when absent).
    """

    name: str
    config_class: Any
    body_class: Any
    allows_fp16: bool = True
    matches: Any = None

    @staticmethod
    def _resolve(ref: Any):
        if isinstance(ref, str):
            module, _, attribute = ref.partition(":")
            return getattr(importlib.import_module(module), attribute)
        return ref

    def config_cls(self):
        return self._resolve(self.config_class)

    def body_cls(self):
        return self._resolve(self.body_class)

    def accepts(self, data: Mapping[str, Any]) -> bool:
        if self.matches is not None:
            try:
                matches = self._resolve(self.matches)
            except (ImportError, AttributeError):  # the variant's module is unavailable
                return False
            try:
                return bool(matches(data))
            except (AttributeError, TypeError, ValueError):  # malformed: the config parser says what is wrong
                return False
        return _architecture_name(data) == self.name


_DFLASH = "DFlashDraftModel"
_FP16_MESSAGE = (
    "{name} overflows in float16 (its acceptance drops to 0); train, convert and serve it in "
    "bfloat16 (--dtype bf16) or float32."
)


def _architecture_name(data: Mapping[str, Any]) -> str:
    return architecture_name(data)


def _is_jetspec_config(data: Mapping[str, Any]) -> bool:
    """A `DFlashDraftModel` file that declares causal in-block attention (what
    `JetSpecConfig.from_hf_dict` accepts)."""
    if _architecture_name(data) != _DFLASH:
        return False
    dflash = data.get("dflash_config") or {}
    if dflash.get("projector_type", data.get("projector_type")) not in (None, "dflash"):
        return False
    return resolve_causal(data) is True


# Checked in order; the first variant that accepts a config.json builds it. Keys are variant ids.
ARCHITECTURES: dict[str, DraftArchitecture] = {
    "domino": DraftArchitecture(
        "DominoDraftModel",
        "megatron_dflash.variants.domino:DominoConfig",
        "megatron_dflash.variants.domino:DominoBody",
        matches="megatron_dflash.variants.domino:is_domino_hf_config",
    ),
    "dflash2": DraftArchitecture(
        "DFlash2DraftModel",
        "megatron_dflash.variants.dflash2:DFlash2Config",
        "megatron_dflash.variants.dflash2:DFlash2Body",
        allows_fp16=False,
    ),
    "jetspec": DraftArchitecture(
        _DFLASH,
        "megatron_dflash.variants.jetspec:JetSpecConfig",
        "megatron_dflash.body:DFlashBody",
        matches=_is_jetspec_config,
    ),
    "dflash": DraftArchitecture(_DFLASH, "megatron_dflash.config:DFlashConfig", "megatron_dflash.body:DFlashBody"),
}


def register_architecture(
    key: str,
    name: str,
    config_class: Any,
    body_class: Any,
    *,
    allows_fp16: bool = True,
    matches: Any = None,
    replace: bool = False,
) -> DraftArchitecture:
    """Make a draft variant convertible (see `DraftArchitecture`). It is checked before the
    variants registered so far, so a predicate may claim files another variant would accept."""
    if key in ARCHITECTURES and not replace:
        raise ValueError(f"variant {key!r} is already registered; pass replace=True to change it.")
    entry = DraftArchitecture(name, config_class, body_class, allows_fp16, matches)
    rest = {k: v for k, v in ARCHITECTURES.items() if k != key}
    ARCHITECTURES.clear()
    ARCHITECTURES.update({key: entry, **rest})
    return entry


def _known_names() -> list[str]:
    return sorted({entry.name for entry in ARCHITECTURES.values()})


def architecture_for_config(data: Mapping[str, Any], source: str = "config") -> DraftArchitecture:
    """The registered variant that reads a HF-layout config dict."""
    for entry in ARCHITECTURES.values():
        if entry.accepts(data):
            return entry
    raise ValueError(
        f"{source} has architectures={data.get('architectures')}, not a draft model (known draft architectures: "
        f"{_known_names()}); pass a DFlash drafter directory, or register a new variant with "
        "megatron_dflash.architectures.register_architecture(...)."
    )


def architecture_of(body) -> DraftArchitecture:
    """The registered variant of `body`, by the class of its config (nearest base first)."""
    for cls in type(body.config).__mro__:
        for entry in ARCHITECTURES.values():
            try:
                config_cls, body_cls = entry.config_cls(), entry.body_cls()
            except (ImportError, AttributeError):  # an unavailable variant cannot be this body's
                continue
            if config_cls is cls and isinstance(body, body_cls):
                return entry
    raise ValueError(
        f"{type(body).__name__} with {type(body.config).__name__} is not a registered draft variant; register "
        "it with megatron_dflash.architectures.register_architecture(...)."
    )


def _config_from_dict(data: Mapping[str, Any], source: str):
    architecture = architecture_for_config(data, source)
    try:
        config = architecture.config_cls().from_hf_dict(dict(data))
    except (TypeError, KeyError, ValueError, AttributeError) as err:
        raise ValueError(f"{source} is not a valid {architecture.name} config: {err}") from err
    return architecture, config


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object.")
    return data


def _build_body(architecture: DraftArchitecture, config, *, params_dtype=None, parallel_config=None,
                tp_group=None, attention_backend: str = "auto", initialize: bool = False):
    import torch

    from .body import default_parallel_config

    if parallel_config is None:
        # Every weight is overwritten by the checkpoint: skip megatron's initialisation.
        parallel_config = default_parallel_config(
            perform_initialization=initialize, params_dtype=params_dtype or torch.float32
        )
    return architecture.body_cls()(
        config, parallel_config=parallel_config, tp_group=tp_group, attention_backend=attention_backend
    )


def _architecture_hint(architecture: Optional["DraftArchitecture"], unexpected: list[str]) -> Optional[str]:
    """When the unexpected tensors are neither an embedding/LM head nor prefixed, they likely
    belong to another variant whose file was labelled with this architecture (docs/design.md §15 Pitfalls)."""
    if architecture is None:
        return None
    foreign = [n for n in unexpected if not (n.startswith(("lm_head", "model.")) or "embed_tokens" in n)]
    if not foreign:
        return None
    return (
        f"the config says architectures=[{architecture.name!r}] but tensors such as {foreign[0]} belong "
        f"to another variant; if so, set `architectures` to it (known: {_known_names()})"
    )
