"""`DFlashConfig`: every field of a DFlash draft, its validation, and HF `config.json` in/out.

The draft is a small Qwen3-style decoder stack. Its `config.json` is a Qwen3 config
(`model_type: qwen3`) with the DFlash fields that the published drafters and the
serving runtimes read (docs/design.md §11 HF export format)::

    {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": ...,
     "num_target_layers": 36, "block_size": 16,
     "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33],
                       "block_size": 16}}

One layout, every reader. The published writers disagree on where a field lives, and each
reader looks in one place only:

* **z-lab `dflash` reference**: architectures `DFlashDraftModel` / `DFlash2DraftModel`; every
  field from `dflash_config`, then the top level; in-block direction from the top-level
  `is_causal` only (absent: sliding layers causal, full-attention layers bidirectional).
* **NeMo AutoModel 0.7.0**: writes `Qwen3DFlashDraftModel` (DFlash, Domino and JetSpec alike)
  or `Qwen3DFlash2DraftModel`, `block_size` at both places, `is_causal: false` at the top
  level always, and for JetSpec `dflash_config.causal: true` (what it trained with, and what
  vLLM reads); it loads by class and reads `block_size` from `dflash_config` first.
* **SpecForge 0.2.0**: `DFlashDraftModel` / `DominoDraftModel`; `block_size` at the top level
  only, `mask_token_id` / `target_layer_ids` / Domino fields from `dflash_config`; ignores
  `is_causal`, so every full-attention layer runs bidirectionally.

We write `block_size` both at the top level and in `dflash_config`, `is_causal` at the top level
and `dflash_config.causal` whenever the direction is fixed, and the architecture names of the
z-lab and SpecForge entries (NeMo loads by class and does not read the name). We read all of the
above: the variant registry (`variants.registry`) maps every writer's architecture name onto a
variant, `resolve_causal` says which direction flag wins. RoPE is read either as
`rope_theta`/`rope_scaling` (transformers 4) or as `rope_parameters` (transformers 5) and written
as the former.

SpecForge runs a causal (JetSpec) drafter bidirectionally: serve those with the z-lab reference
or vLLM (which reads `dflash_config.causal`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

DFLASH_ARCHITECTURE = "DFlashDraftModel"
LAYER_TYPES = ("full_attention", "sliding_attention")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")

# Keys of `dflash_config` in config.json (besides block_size) that map 1:1 to fields.
_DFLASH_CONFIG_KEYS = (
    "mask_token_id",
    "target_layer_ids",
    "input_embedding_scale",
    "output_multiplier",
    "final_logit_softcapping",
)


def resolve_text_config(config: Any) -> Any:
    """The decoder-stack config of a target: ``text_config`` of a multimodal wrapper, else the config itself.

    Multimodal checkpoints (``Qwen3_5ForConditionalGeneration``, ``Qwen3VLForConditionalGeneration``,
    ``KimiK3ForConditionalGeneration``) keep ``num_hidden_layers``, ``hidden_size``, ``vocab_size`` and the
    attention shapes on a nested ``text_config``; causal LMs keep them at the top level. Works on a
    ``config.json`` dict and on a transformers config object alike.
    """
    if isinstance(config, Mapping):
        inner = config.get("text_config")
        return dict(inner) if isinstance(inner, Mapping) and inner else config
    inner = getattr(config, "text_config", None)
    return inner if inner is not None else config


def resolve_causal(data: dict[str, Any]) -> Optional[bool]:
    """In-block direction a `config.json` dict declares: True, False, or None (per-layer default).

    `dflash_config.causal` wins over the top-level `is_causal` (then `causal`): NeMo AutoModel
    writes `is_causal: false` on every drafter it trains, JetSpec included, and records the
    causal in-block attention its JetSpec drafters were trained with only as
    `dflash_config.causal: true` (which vLLM reads too). Files written by us or by the z-lab
    reference never disagree.
    """
    dflash = data.get("dflash_config") or {}
    for source, key in ((dflash, "causal"), (data, "is_causal"), (data, "causal"), (dflash, "is_causal")):
        if source.get(key) is not None:
            return bool(source[key])
    return None


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target layers to tap, spread over the target's depth (the published formula).

    One draft layer taps the middle layer `N // 2`; otherwise layer `i` of `D` taps
    `round(1 + i * (N - 4) / (D - 1))`, i.e. from layer 1 up to layer `N - 3`, which
    keeps clear of the last layer (its pre-final-norm output is something serving
    engines cannot provide).

    Raises:
        ValueError: if the target is too shallow to give `num_draft_layers` distinct
            layers that are not its last one.
    """
    if num_target_layers < 2:
        raise ValueError(
            f"num_target_layers={num_target_layers}: the target needs at least 2 layers to be "
            "tapped (its last layer is never tapped)."
        )
    if num_draft_layers < 1:
        raise ValueError(f"num_draft_layers={num_draft_layers} must be >= 1.")
    if num_draft_layers == 1:
        ids = [num_target_layers // 2]
    else:
        span = num_target_layers - 4
        ids = [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]
    try:
        check_target_layer_ids(ids, num_target_layers)
    except ValueError as err:
        raise ValueError(
            f"the default target layers for a {num_target_layers}-layer target and "
            f"{num_draft_layers} draft layers would be {ids}: {err} Pass target_layer_ids "
            "explicitly or use fewer draft layers."
        ) from None
    return ids


def check_draft_fields(config) -> None:
    """Check the fields every draft family shares (block, MASK token, target taps, the target head's
    output transform) and normalise `mask_token_id` to an int; `ValueError` naming the field otherwise."""
    block_size = config.block_size
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 2:
        raise ValueError(
            f"block_size={block_size!r} must be an integer >= 2 (one anchor slot plus at least one predicted slot)."
        )
    if config.mask_token_id is None:
        raise ValueError(
            "mask_token_id is required: pass the id of an existing row of the target's input "
            "embedding to use as the MASK token (it is never guessed)."
        )
    if not (0 <= int(config.mask_token_id) < config.vocab_size):
        raise ValueError(
            f"mask_token_id={config.mask_token_id} is not a row of the target embedding "
            f"(vocab_size={config.vocab_size})."
        )
    config.mask_token_id = int(config.mask_token_id)
    check_target_layer_ids(config.target_layer_ids, config.num_target_layers)
    if not (config.input_embedding_scale > 0):
        raise ValueError(f"input_embedding_scale={config.input_embedding_scale} must be > 0.")
    if not (math.isfinite(config.output_multiplier) and config.output_multiplier > 0):
        raise ValueError(
            f"output_multiplier={config.output_multiplier} must be finite and > 0: the draft's logits are "
            "multiplied by it, and a negative factor reverses every argmax (zero flattens them). Use the "
            "target's own positive multiplier, or 1.0 when it has none."
        )
    if config.final_logit_softcapping is not None and not (config.final_logit_softcapping > 0):
        raise ValueError(f"final_logit_softcapping={config.final_logit_softcapping} must be > 0 or None.")


def check_target_layer_ids(ids: list[int], num_target_layers: int) -> None:
    if len(ids) == 0:
        raise ValueError("target_layer_ids is empty; at least one target layer must be tapped.")
    if any(not isinstance(i, int) or isinstance(i, bool) for i in ids):
        raise ValueError(f"target_layer_ids={ids} must be integers.")
    if len(set(ids)) != len(ids):
        raise ValueError(f"target_layer_ids={ids} has duplicates; each layer may be tapped once.")
    last = num_target_layers - 1
    bad = [i for i in ids if i < 0 or i > last]
    if bad:
        raise ValueError(
            f"target_layer_ids={ids}: {bad} outside the target's layers 0..{last} "
            f"(num_target_layers={num_target_layers})."
        )
    if last in ids:
        raise ValueError(
            f"target_layer_ids={ids} includes the target's last layer {last}: its output is the "
            "pre-final-norm state that serving engines cannot provide. Tap an earlier layer."
        )


@dataclass
class DFlashConfig:
    """All fields of a DFlash draft body.

    Sizes follow HF Qwen3 names. `block_size` is `gamma + 1`: slot 0 holds the anchor
    token, slots `1..gamma` the MASK token. `target_layer_ids` are 0-based target decoder
    layers whose outputs (HF `hidden_states[i + 1]`) are concatenated into the context
    feature, so `fc` maps `len(target_layer_ids) * hidden_size -> hidden_size`.

    In-block direction: `causal=None` follows the published drafters (a layer is causal
    in-block iff it is a sliding-window layer); `True`/`False` forces every layer
    (JetSpec trains causal, DFlash 2 writes `is_causal: false`). `layer_attention(i)`
    is the single resolver used by training masks and decoding alike.
    """

    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 5
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 40960
    vocab_size: int = 151936
    block_size: int = 16
    mask_token_id: Optional[int] = None
    target_layer_ids: Optional[list[int]] = None
    num_target_layers: int = 28
    layer_types: Optional[list[str]] = None
    sliding_window: Optional[int] = None
    causal: Optional[bool] = None
    attention_bias: bool = False
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: Optional[float] = None
    # A reduced draft vocabulary (docs/design.md §20 Reduced draft vocabulary): the draft's own head over K of
    # the target's `vocab_size` rows; None (or K = vocab_size) proposes over the whole target vocabulary.
    draft_vocab_size: Optional[int] = None
    # Fields of the target config that serving runtimes read from the draft's config.json
    # (token ids, dtype); kept verbatim, never interpreted here.
    extra_hf_fields: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.target_layer_ids is None:
            self.target_layer_ids = default_target_layer_ids(
                self.num_target_layers, self.num_hidden_layers
            )
        else:
            self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        else:
            self.layer_types = list(self.layer_types)
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise `ValueError` naming the first inconsistent field and how to fix it."""
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
            "vocab_size",
            "num_target_layers",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads} (grouped-query attention)."
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings.")
        if not (self.rms_norm_eps > 0):
            raise ValueError(f"rms_norm_eps={self.rms_norm_eps} must be > 0.")
        if not (self.rope_theta > 0):
            raise ValueError(f"rope_theta={self.rope_theta} must be > 0.")
        _validate_rope_scaling(self.rope_scaling)
        check_draft_fields(self)
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers="
                f"{self.num_hidden_layers}; give one type per draft layer."
            )
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"layer_types contains {unknown}; allowed: {list(LAYER_TYPES)}.")
        if "sliding_attention" in self.layer_types:
            if not isinstance(self.sliding_window, int) or self.sliding_window < 1:
                raise ValueError(
                    f"sliding_window={self.sliding_window!r}: a positive window is required when "
                    "layer_types contains 'sliding_attention'."
                )
        if self.causal is not None and not isinstance(self.causal, bool):
            raise ValueError(f"causal={self.causal!r} must be True, False or None.")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act={self.hidden_act!r}: only 'silu' (SwiGLU) is supported.")
        if self.draft_vocab_size == self.vocab_size:  # what speculators writes for a full vocabulary
            self.draft_vocab_size = None
        K = self.draft_vocab_size
        if K is not None and (not isinstance(K, int) or isinstance(K, bool) or not 1 <= K < self.vocab_size):
            raise ValueError(f"draft_vocab_size={K!r} must be an integer in [1, vocab_size={self.vocab_size}] "
                             "(or None for the full vocabulary).")

    def validate_tensor_parallel(self, tp_size: int) -> None:
        """Check that `tp_size` splits heads, KV heads and the MLP evenly."""
        if tp_size < 1:
            raise ValueError(f"tensor_model_parallel_size={tp_size} must be >= 1.")
        if self.num_key_value_heads % tp_size:
            divisors = [d for d in range(1, self.num_key_value_heads + 1) if self.num_key_value_heads % d == 0]
            raise ValueError(
                f"tensor_model_parallel_size={tp_size} must divide num_key_value_heads="
                f"{self.num_key_value_heads}: this draft supports TP in {divisors} "
                f"(at most {self.num_key_value_heads})."
            )
        if self.num_attention_heads % tp_size:
            raise ValueError(
                f"tensor_model_parallel_size={tp_size} must divide num_attention_heads="
                f"{self.num_attention_heads}."
            )
        if self.intermediate_size % tp_size:
            raise ValueError(
                f"tensor_model_parallel_size={tp_size} must divide intermediate_size="
                f"{self.intermediate_size}."
            )

    # ------------------------------------------------------------------ derived
    @property
    def gamma(self) -> int:
        """Number of predicted slots per block (`block_size - 1`)."""
        return self.block_size - 1

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    def layer_attention(self, layer_idx: int) -> tuple[bool, Optional[int]]:
        """`(causal_in_block, sliding_window)` of draft layer `layer_idx`.

        The one resolver of in-block direction: training masks and decoding both call it.
        Matches the published drafters: unless `causal` forces a direction, sliding-window
        layers are causal in-block and full-attention layers bidirectional.
        """
        is_sliding = self.layer_types[layer_idx] == "sliding_attention"
        causal = is_sliding if self.causal is None else self.causal
        return causal, (self.sliding_window if is_sliding else None)

    # ------------------------------------------------------------------ HF format
    def to_hf_dict(self, architecture: str = DFLASH_ARCHITECTURE) -> dict[str, Any]:
        """The published `config.json` layout (docs/design.md §11 HF export format)."""
        dflash_config: dict[str, Any] = {
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
            "block_size": self.block_size,
        }
        if self.input_embedding_scale != 1.0:
            dflash_config["input_embedding_scale"] = self.input_embedding_scale
        if self.output_multiplier != 1.0:
            dflash_config["output_multiplier"] = self.output_multiplier
        if self.final_logit_softcapping is not None:
            dflash_config["final_logit_softcapping"] = self.final_logit_softcapping
        out: dict[str, Any] = dict(self.extra_hf_fields)
        out.update(
            {
                "architectures": [architecture],
                "model_type": "qwen3",
                "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size,
                "num_hidden_layers": self.num_hidden_layers,
                "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_key_value_heads,
                "head_dim": self.head_dim,
                "hidden_act": self.hidden_act,
                "rms_norm_eps": self.rms_norm_eps,
                "rope_theta": self.rope_theta,
                "rope_scaling": self.rope_scaling,
                "max_position_embeddings": self.max_position_embeddings,
                "vocab_size": self.vocab_size,
                "attention_bias": self.attention_bias,
                "attention_dropout": 0.0,
                "initializer_range": self.initializer_range,
                "tie_word_embeddings": False,
                "layer_types": list(self.layer_types),
                "sliding_window": self.sliding_window,
                "use_sliding_window": "sliding_attention" in self.layer_types,
                "max_window_layers": self.num_hidden_layers,
                "num_target_layers": self.num_target_layers,
                "dflash_config": dflash_config,
            }
        )
        # Both places: SpecForge reads `block_size` only at the top level.
        out["block_size"] = self.block_size
        if self.draft_vocab_size is not None:  # vLLM's drafter reads it at the top level, with `d2t`
            out["draft_vocab_size"] = self.draft_vocab_size
        if self.causal is not None:
            out["is_causal"] = self.causal
            dflash_config["causal"] = self.causal
        return out

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any], **overrides: Any) -> "DFlashConfig":
        """Read a published `config.json` of any writer (see the module docstring)."""
        data = dict(data)
        dflash = dict(data.pop("dflash_config", None) or {})
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for name in known - {"extra_hf_fields", "rope_theta", "rope_scaling", "causal"}:
            if name in data:
                kwargs[name] = data.pop(name)
        for name in _DFLASH_CONFIG_KEYS:
            if name in dflash:
                kwargs[name] = dflash.pop(name)
        if "block_size" in dflash:  # the published place wins over the top level
            kwargs["block_size"] = dflash.pop("block_size")
        if "num_target_layers" not in kwargs and "num_target_layers" in dflash:
            kwargs["num_target_layers"] = dflash.pop("num_target_layers")
        if "num_target_layers" not in kwargs:
            raise ValueError("config.json has no num_target_layers; the draft cannot know its target's depth.")
        causal = resolve_causal({**data, "dflash_config": dflash})
        if causal is not None:
            kwargs["causal"] = causal
        for source in (data, dflash):
            source.pop("is_causal", None)
            source.pop("causal", None)
        kwargs["rope_theta"], kwargs["rope_scaling"] = read_rope_parameters(data)
        if kwargs.get("head_dim") is None:  # Qwen3 files may omit it: hidden / heads
            kwargs["head_dim"] = int(kwargs.get("hidden_size", 1024)) // int(kwargs.get("num_attention_heads", 16))
        data.pop("use_sliding_window", None)
        # The DFlash 2 / variant fields are read by their own configs; keep the rest verbatim.
        for key in ("architectures", "model_type", "attention_dropout", "tie_word_embeddings",
                    "max_window_layers", "rope_parameters", "transformers_version", "auto_map",
                    "use_cache"):
            data.pop(key, None)
        kwargs["extra_hf_fields"] = {k: v for k, v in data.items() if k in _PASSTHROUGH_HF_FIELDS}
        kwargs.update(overrides)
        return cls(**kwargs)

    def save_pretrained(self, directory: str, architecture: str = DFLASH_ARCHITECTURE) -> None:
        write_config_json(self, directory, architecture)

    @classmethod
    def from_pretrained(cls, directory: str, **overrides: Any) -> "DFlashConfig":
        return read_config_json(cls, directory, **overrides)


# Target-derived fields that serving runtimes read from the draft's config.json.
_PASSTHROUGH_HF_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "dtype")


def read_rope_parameters(data: dict[str, Any]) -> tuple[float, Optional[dict]]:
    """(rope_theta, rope_scaling) from either `rope_theta`/`rope_scaling` or `rope_parameters`."""
    params = data.pop("rope_parameters", None)
    theta = data.pop("rope_theta", None)
    scaling = data.pop("rope_scaling", None)
    if params:
        params = dict(params)
        theta = params.pop("rope_theta", theta)
        if params.get("rope_type", params.get("type", "default")) != "default":
            scaling = params
    if scaling is not None:
        scaling = dict(scaling)
        if "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
        if scaling.get("rope_type", "default") == "default":
            scaling = None
    return float(theta if theta is not None else 10000.0), scaling


def _validate_rope_scaling(scaling: Optional[dict]) -> None:
    if scaling is None:
        return
    if not isinstance(scaling, dict):
        raise ValueError(f"rope_scaling={scaling!r} must be a dict or None.")
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported; supported: {list(ROPE_TYPES)}.")
    if rope_type != "default" and not (float(scaling.get("factor", 0)) > 0):
        raise ValueError(f"rope_scaling={scaling}: a positive 'factor' is required for {rope_type!r}.")
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in scaling:
                raise ValueError(f"rope_scaling={scaling}: llama3 scaling needs {key!r}.")


def write_config_json(config, directory: str, architecture: str) -> None:
    """`directory/config.json` of any draft config with `to_hf_dict(architecture)` (sorted keys)."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config.to_hf_dict(architecture), f, indent=2, sort_keys=True)
        f.write("\n")


def read_config_json(cls, directory: str, **overrides: Any):
    """`cls.from_hf_dict` of `directory/config.json`; a missing, non-JSON or malformed file is one
    error naming the path (FileNotFoundError / ValueError)."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist: not a HF draft directory.")
    try:
        with open(path) as f:
            data = json.load(f)
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object.")
    try:
        return cls.from_hf_dict(data, **overrides)
    except (TypeError, AttributeError, KeyError, ValueError) as err:  # a malformed or missing field
        detail = err if isinstance(err, ValueError) else f"{type(err).__name__}: {err}"
        raise ValueError(f"{path} is not a valid {cls.__name__} config: {detail}") from None
