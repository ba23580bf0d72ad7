"""Target families: which draft a target gets, built how, trained with what (docs/design.md §17 Target families).

A *target family* groups the target architectures one draft family serves. The registry is keyed by the
architecture names a HF ``config.json`` declares (``architectures[0]``); each entry says

* which **draft family** is trained for it (``qwen3``: the Qwen3-style draft of `draft/body.py`; ``kimi_k3``: a dense
  non-causal Kimi K3 multi-latent-attention draft),
* how the **draft config** is derived from the target's *text* config (`resolve_text_config` unwraps the
  ``text_config`` of multimodal checkpoints) and which target layers are **tapped** by default,
* which **draft attention backends** and which **target backends** its draft family can use, whether packed
  sequences work,
* how the frozen target is **loaded** in one process (the transformers auto class, or a family's own loader),
  and whether it keeps a KV cache speculative decoding can roll back (else decoding recomputes it; also for
  targets with linear-attention layers, `target_keeps_kv_cache`).

Nothing else in the package maps architecture names to behaviour: `pretrain_dflash.py` (through
`training/job.py`), the training loop, and `tools/evaluate_acceptance.py` ask `resolve_target_family`.
A family names its draft family, never a variant: the variant registry maps a draft family to the variant that
trains the requested objective on it (`variants.registry.variant_for_draft_family`), so this module does not
import the registry (nor torch).

A ``config.json`` without ``architectures`` is resolved by its ``model_type``; one with neither is read as a
Qwen3/Llama-shaped decoder (the fields `qwen3_draft_config` reads), as it always was. An architecture that is
named but not registered is refused with the list of supported ones.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from ..common.safetensors_files import target_safetensors_files
from ..draft.config import default_target_layer_ids, read_rope_parameters, resolve_text_config

__all__ = [
    "TargetFamily",
    "TARGET_FAMILIES",
    "TargetFamilyError",
    "resolve_text_config",
    "target_architecture",
    "resolve_target_family",
    "supported_architectures",
    "target_keeps_kv_cache",
    "qwen3_draft_config",
    "kimi_k3_draft_config",
]

ALL_ATTENTION_BACKENDS = ("auto", "chunked", "flex", "dense")


class TargetFamilyError(ValueError):
    """A target this version cannot train a draft for, or a run its draft family cannot do."""


def target_architecture(config: Mapping) -> Optional[str]:
    """``architectures[0]`` of a target ``config.json`` dict (None when it names none)."""
    names = config.get("architectures") or []
    return str(names[0]) if names else None


# ------------------------------------------------------------------------------------------ draft configs


def qwen3_draft_config(
    text_config: Mapping,
    *,
    config_cls: type,
    num_layers: int,
    block_size: int,
    mask_token_id: int,
    target_layer_ids: Optional[list[int]],
    **overrides: Any,
):
    """A Qwen3-style draft with the target's attention/MLP shapes, RoPE and vocabulary (the published recipe).

    Reads the fields Qwen3, Qwen3-MoE, Qwen3.5, Qwen3-VL (text), Llama-like and DeepSeek-V3 text configs share:
    ``hidden_size``, ``intermediate_size``, ``num_attention_heads``, ``num_key_value_heads`` (default: the
    heads), ``head_dim`` (default ``hidden_size // heads``), ``rms_norm_eps``, RoPE (``rope_theta`` /
    ``rope_scaling`` or ``rope_parameters``), ``max_position_embeddings``, ``vocab_size``,
    ``num_hidden_layers``; the token ids serving runtimes read are kept. Only the depth is the draft's own.
    """
    hf = dict(text_config)
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    theta, scaling = read_rope_parameters(dict(hf))
    extra = {k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if hf.get(k) is not None}
    kwargs = dict(
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hidden // heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(hf.get("max_position_embeddings", 40960)),
        vocab_size=int(hf["vocab_size"]),
        block_size=block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=target_layer_ids,
        num_target_layers=int(hf["num_hidden_layers"]),
        extra_hf_fields=extra,
    )
    kwargs.update(overrides)
    return config_cls(**kwargs)


def kimi_k3_draft_config(text_config: Mapping, *, config_cls: type, num_layers: int, **kwargs: Any):
    """A Kimi K3 MLA draft of a K3 text config (``model_type: kimi_linear``): the draft family's own derivation
    (`kimi_k3.KimiK3DraftConfig.from_target_config`: MLA sizes, SiTU, hidden size, vocabulary; NoPE, so no RoPE).

    Raises:
        TargetFamilyError: for a field the K3 draft does not have (a Qwen3-style `--dflash-*` flag).
    """
    try:
        return config_cls.from_target_config(text_config, num_hidden_layers=num_layers, **kwargs)
    except TypeError as err:  # an override naming a field of the Qwen3-style draft only
        raise TargetFamilyError(f"the kimi_k3 draft does not take that setting ({err}); drop the flag.") from None


# ------------------------------------------------------------------------------------------ target loading


def _load_with(auto_class: str) -> Callable:
    def load(directory: str, dtype):
        import transformers

        # safetensors only: a local directory of pickles is refused in one line before transformers sees it, and
        # a hub id is never fetched as pickles (`common.safetensors_files.TargetWeightsError`)
        if os.path.isdir(directory):
            target_safetensors_files(directory)
        cls = getattr(transformers, auto_class)
        try:
            model = cls.from_pretrained(directory, dtype=dtype, use_safetensors=True)
        except TypeError:  # transformers < 4.56 spells it torch_dtype
            model = cls.from_pretrained(directory, torch_dtype=dtype, use_safetensors=True)
        return model.eval()

    load.__name__ = f"load_with_{auto_class}"
    return load


def _load_kimi_k3(directory: str, dtype):
    # here: only a Kimi K3 target needs NeMo AutoModel's model code (an optional install) and torch
    from .kimi_k3 import load_kimi_k3_target

    return load_kimi_k3_target(directory, dtype=dtype)


# ------------------------------------------------------------------------------------------ the registry


@dataclass(frozen=True)
class TargetFamily:
    """How drafts are trained for one family of target architectures.

    Attributes:
        name: the target family (``qwen3``, ``kimi_k3``).
        architectures: ``config.json`` architecture names served, text-only and multimodal wrappers alike.
        model_types: ``model_type`` values that identify the family when ``architectures`` is absent.
        build_draft_config: ``(text_config, *, config_cls, num_layers, block_size, mask_token_id,
            target_layer_ids, **overrides) -> config``: the draft config from the target's text config.
        draft_family: the draft family trained for its targets (``qwen3``: the Qwen3-style body every variant
            builds; ``kimi_k3``: the K3 MLA draft); the variant registry says which variant trains the requested
            objective on it (`variants.registry.variant_for_draft_family`).
        attention_backends: the `--dflash-attention-backend` values its draft can run.
        target_backends: the `--target-backend` values that can run its targets.
        packed_sequences: whether `--pack-sequences` (per-document masks and positions) works with its targets.
        target_kv_cache: whether its targets keep a KV cache that speculative decoding can roll back
            (`decoding.generate.spec_generate` then runs each verify over the block only); False: their model code keeps
            none, and `spec_generate` recomputes the target over the committed tokens every cycle.
        load_hf_target: ``(directory, dtype) -> causal LM`` for the single-process (``hf``) target backend,
            with whatever extra loading arguments the family needs.
        default_taps: ``(num_target_layers, num_draft_layers) -> target_layer_ids``.
        notes: what a user of this family should know (shown by errors and docs).
        loader_by_architecture: loaders for the architectures that need their own (e.g. no causal-LM auto class).
    """

    name: str
    architectures: tuple
    model_types: tuple
    build_draft_config: Callable
    draft_family: str
    attention_backends: tuple
    target_backends: tuple
    load_hf_target: Callable
    packed_sequences: bool = True
    target_kv_cache: bool = True
    default_taps: Callable = default_target_layer_ids
    notes: str = ""
    loader_by_architecture: Mapping = field(default_factory=dict)

    def loader(self, architecture: Optional[str]) -> Callable:
        """The single-process loader for ``architecture`` (some wrappers need their own auto class)."""
        return self.loader_by_architecture.get(architecture, self.load_hf_target)

    def check_run(self, *, target_backend: str = "hf", attention_backend: str = "auto",
                  pack_sequences: bool = False, text_config: Optional[Mapping] = None) -> None:
        """Refuse, before anything is built, a run this family's draft (or this target, ``text_config``) cannot do.
        (Whether its draft family has the requested variant is the variant registry's to say.)

        Raises:
            TargetFamilyError: naming the family, the refused choice and the supported ones.
        """
        if target_backend not in self.target_backends:
            raise TargetFamilyError(
                f"--target-backend {target_backend}: {self.name} targets run with {list(self.target_backends)} only."
            )
        if attention_backend not in self.attention_backends:
            raise TargetFamilyError(
                f"--dflash-attention-backend {attention_backend}: the {self.name} draft runs "
                f"{list(self.attention_backends)}."
            )
        if pack_sequences and not self.packed_sequences:
            raise TargetFamilyError(
                f"--pack-sequences: {self.name} targets are not run with per-document masks here; drop "
                "--pack-sequences (each row is then one document)."
            )
        recurrent = sorted({t for t in (text_config or {}).get("layer_types") or () if t == "linear_attention"})
        if pack_sequences and recurrent:
            # A per-document attention mask does not reach a recurrent layer's state: documents would leak.
            raise TargetFamilyError(
                "--pack-sequences: this target has linear-attention layers (layer_types), whose recurrent state "
                "would carry one document into the next; drop --pack-sequences."
            )

    def draft_config(self, target_config: Mapping, *, config_cls: type, **kwargs: Any):
        """The draft config for ``target_config`` (a full ``config.json`` dict; its text config is used), of
        ``config_cls``: the config class of the variant that trains this family's draft family."""
        return self.build_draft_config(resolve_text_config(target_config), config_cls=config_cls, **kwargs)


QWEN3 = TargetFamily(
    name="qwen3",
    architectures=(
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "Qwen3_5ForCausalLM",
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForCausalLM",
        "Qwen3_5MoeForConditionalGeneration",
        "Qwen3VLForConditionalGeneration",
        "Qwen3VLMoeForConditionalGeneration",
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "DeepseekV3ForCausalLM",
    ),
    model_types=("qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_vl",
                 "qwen3_vl_moe", "llama", "mistral", "qwen2", "deepseek_v3"),
    build_draft_config=qwen3_draft_config,
    draft_family="qwen3",
    attention_backends=ALL_ATTENTION_BACKENDS,
    target_backends=("hf", "megatron"),
    load_hf_target=_load_with("AutoModelForCausalLM"),
    # transformers has no causal-LM class for Qwen3-VL: the image-text model holds the text decoder and head.
    loader_by_architecture={
        "Qwen3VLForConditionalGeneration": _load_with("AutoModelForImageTextToText"),
        "Qwen3VLMoeForConditionalGeneration": _load_with("AutoModelForImageTextToText"),
    },
    notes="The megatron target backend converts qwen3, llama, qwen3_moe and deepseek_v3 checkpoints only.",
)

KIMI_K3 = TargetFamily(
    name="kimi_k3",
    architectures=("KimiK3ForCausalLM", "KimiK3ForConditionalGeneration"),
    model_types=("kimi_k3", "kimi_linear"),
    build_draft_config=kimi_k3_draft_config,
    draft_family="kimi_k3",
    attention_backends=ALL_ATTENTION_BACKENDS,
    target_backends=("hf",),
    load_hf_target=_load_kimi_k3,
    packed_sequences=False,
    target_kv_cache=False,
    notes="K3 targets run on NeMo AutoModel's K3 model code (pip install --no-deps nemo-automodel==0.7.0); "
          "its KDA layers need flash-linear-attention (CUDA).",
)

TARGET_FAMILIES: dict[str, TargetFamily] = {family.name: family for family in (QWEN3, KIMI_K3)}

_BY_ARCHITECTURE = {arch: family for family in TARGET_FAMILIES.values() for arch in family.architectures}
_BY_MODEL_TYPE = {mt: family for family in TARGET_FAMILIES.values() for mt in family.model_types}


def supported_architectures() -> list[str]:
    return sorted(_BY_ARCHITECTURE)


def resolve_target_family(config: Mapping) -> TargetFamily:
    """The family of a target ``config.json`` dict: by ``architectures``, else ``model_type``, else Qwen3-shaped.

    Raises:
        TargetFamilyError: for an architecture (or, without one, a ``model_type``) that is not registered,
            with the list of supported architectures.
    """
    arch = target_architecture(config)
    if arch is not None:
        family = _BY_ARCHITECTURE.get(arch)
        if family is None:
            raise TargetFamilyError(
                f"target architecture {arch!r} has no draft family; supported architectures: "
                f"{supported_architectures()}."
            )
        return family
    model_type = config.get("model_type")
    if model_type is None:
        return QWEN3
    family = _BY_MODEL_TYPE.get(model_type)
    if family is None:
        raise TargetFamilyError(
            f"target model_type {model_type!r} (no architectures in config.json) has no draft family; supported "
            f"architectures: {supported_architectures()}."
        )
    return family


def target_keeps_kv_cache(config: Any) -> bool:
    """Whether speculative decoding keeps a KV cache of a target with this config and rolls it back on rejection.

    False when its family keeps none (`TargetFamily.target_kv_cache`: Kimi K3), and when its text config has
    linear-attention layers (``layer_types``, Qwen3.5): a recurrent state cannot drop rejected tokens. Such
    targets are recomputed over the committed tokens every cycle (`decoding.generate.spec_generate`). An architecture
    no family registers is a transformers causal LM as far as decoding is concerned: its HF cache is used.

    Args:
        config: a ``config.json`` dict or a loaded model's config object (a wrapper's or its text config).
    """
    data = config if isinstance(config, Mapping) else (config.to_dict() if hasattr(config, "to_dict") else vars(config))
    if "linear_attention" in (resolve_text_config(data).get("layer_types") or ()):
        return False
    try:
        return resolve_target_family(data).target_kv_cache
    except TargetFamilyError:
        return True
