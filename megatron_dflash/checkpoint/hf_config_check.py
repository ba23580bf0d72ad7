"""A draft's `config.json` read from disk, checked before anything is built from it (docs/design.md §14).

A body is built from its config and only then filled with the file's weights, so a config that lies
(`hidden_size` 1e9 over 64-wide weights, `num_hidden_layers` 1e12, `markov_rank: "256"`) would be an
exabyte allocation or a type error deep inside a constructor. Two checks come first, each failure one
`CheckpointError` line naming the file, the field and its value:

* `check_config_fields(data, source)`: every field this package reads from a draft's `config.json`
  (at the top level and in `dflash_config`) has its JSON type (an integer is not a bool, a float or a
  string; `architectures` and `layer_types` are lists of strings, ...) and a value in a sane range
  (`FIELDS`): bounds no published draft comes near, small enough that no field alone can size an
  impossible tensor. `checkpoint.architectures.config_from_dict` calls it before any variant reads the dict.
* `check_config_shapes(config, shapes, source, weights)`: the parsed config against the tensor shapes of
  its weights (from the safetensors headers, `hf_tensor_shapes`, or the `torch_dist` metadata): every field
  that sizes a weight (`hidden_size`, the taps, the layer count, heads, KV heads, `head_dim`,
  `intermediate_size`, each variant's own widths, the vocabulary rows of its heads, `markov_rank`) must agree with one tensor that has it (`_dims`). After it, the body a loader builds
  is as large as the file; the loader's full comparison (`draft.sharding.check_tensor_shapes`) then
  checks every other tensor.

No torch: the command lines' readers call these before a model exists.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from ..common.errors import CheckpointError
from ..common.safetensors_files import safetensors_files, safetensors_header_bytes

__all__ = ["FIELDS", "check_config_fields", "check_config_shapes", "hf_tensor_shapes"]

_MAX_WIDTH = 1 << 16  # hidden sizes, ranks, head widths: 8x the widest published model
_MAX_VOCAB = 1 << 22  # vocabularies: 16x the largest published one
_MAX_POSITIONS = 1 << 26


@dataclass(frozen=True)
class Field:
    """The JSON type of one field and, for numbers, its range. `kind`: "int", "number", "bool", "str",
    "object", "strings" (a list of strings) or "ints" (a list of integers, each in the range)."""

    kind: str
    low: Optional[float] = None
    high: Optional[float] = None
    null: bool = True  # JSON null allowed (the field is then absent, as its reader takes it)

    def what(self) -> str:
        kinds = {"int": "an integer", "number": "a finite number", "bool": "true or false", "str": "a string",
                 "object": "a JSON object", "strings": "a list of strings", "ints": "a list of integers"}
        text = kinds[self.kind]
        if self.kind == "number" and self.low is not None:  # exclusive bounds
            text += f" > {self.low:g}" + (f" and < {self.high:g}" if self.high is not None else "")
        elif self.low is not None:
            text += f" in {self.low:d}..{self.high:d}"
        return text + (" (or null)" if self.null else "")


def _int(low: int, high: int, null: bool = True) -> Field:
    return Field("int", low, high, null)


# Every field of a draft's config.json this package (or a variant config) reads, wherever it lives.
FIELDS: dict[str, Field] = {
    "architectures": Field("strings"), "model_type": Field("str"), "dflash_config": Field("object"),
    "hidden_size": _int(1, _MAX_WIDTH), "intermediate_size": _int(1, 16 * _MAX_WIDTH),
    "num_hidden_layers": _int(1, 1024), "num_attention_heads": _int(1, 4096), "num_key_value_heads": _int(1, 4096),
    "head_dim": _int(1, 4096), "max_position_embeddings": _int(1, _MAX_POSITIONS),
    "vocab_size": _int(1, _MAX_VOCAB), "draft_vocab_size": _int(1, _MAX_VOCAB),
    "block_size": _int(2, 1024), "mask_token_id": _int(0, _MAX_VOCAB), "num_target_layers": _int(1, 4096),
    "target_layer_ids": Field("ints", 0, 4095), "layer_types": Field("strings"),
    "sliding_window": _int(1, _MAX_POSITIONS), "is_causal": Field("bool"), "causal": Field("bool"),
    "rms_norm_eps": Field("number", 0, 1), "rope_theta": Field("number", 0), "rope_scaling": Field("object"),
    "rope_parameters": Field("object"), "attention_bias": Field("bool"), "hidden_act": Field("str"),
    "initializer_range": Field("number"), "input_embedding_scale": Field("number"),
    "output_multiplier": Field("number"), "final_logit_softcapping": Field("number"),
    # DFlash 2
    "conv_kernel_size": _int(1, 1024), "conv_group_size": _int(1, _MAX_WIDTH), "selector_rank": _int(1, _MAX_WIDTH),
    "selector_top_k": _int(1, _MAX_VOCAB),
    # Domino
    "emb_dim": _int(1, _MAX_WIDTH), "gru_hidden_dim": _int(1, _MAX_WIDTH), "shift_label": Field("bool"),
    "pure_draft_prefix_len": _int(0, 1024), "projector_type": Field("str"),
    # DSpark
    "markov_rank": _int(0, _MAX_WIDTH), "markov_head_type": Field("str"), "enable_confidence_head": Field("bool"),
    "confidence_head_with_markov": Field("bool"), "confidence_head_alpha": Field("number"),
    # the Kimi K3 MLA draft
    "q_lora_rank": _int(1, _MAX_WIDTH), "kv_lora_rank": _int(1, _MAX_WIDTH), "qk_nope_head_dim": _int(1, 4096),
    "qk_rope_head_dim": _int(1, 4096), "v_head_dim": _int(1, 4096), "mla_use_nope": Field("bool"),
    "mla_use_output_gate": Field("bool"), "activation_situ_beta": Field("number"),
    "activation_situ_linear_beta": Field("number"),
}


def _shown(value: Any) -> str:
    """A value as a message shows it: JSON, cut short (a hostile file's content is not echoed)."""
    text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _field_error(spec: Field, value: Any) -> bool:
    """Whether `value` is not what `spec` allows."""
    if value is None:
        return not spec.null
    if spec.kind in ("strings", "ints"):
        test = _is_int if spec.kind == "ints" else (lambda v: isinstance(v, str))
        items_ok = isinstance(value, list) and all(test(v) for v in value)
        return not items_ok or (spec.kind == "ints" and any(not spec.low <= v <= spec.high for v in value))
    if spec.kind == "int":
        return not _is_int(value) or not spec.low <= value <= spec.high
    if spec.kind == "number":
        if not _is_number(value):
            return True
        return spec.low is not None and not (value > spec.low and (spec.high is None or value < spec.high))
    kinds = {"bool": bool, "str": str, "object": dict}
    return not isinstance(value, kinds[spec.kind])


def check_config_fields(data: Mapping[str, Any], source: str) -> None:
    """Raise `CheckpointError` naming `source`, the first field of the `config.json` dict `data` (top level,
    then `dflash_config`) whose JSON type or range is wrong (`FIELDS`), its value and what it must be."""
    places = [("", data)]
    if isinstance(data.get("dflash_config"), dict):
        places.append(("dflash_config.", data["dflash_config"]))
    for prefix, place in places:
        for name, spec in FIELDS.items():
            if name in place and _field_error(spec, place[name]):
                value = place[name]
                huge = spec.kind == "int" and _is_int(value) and value > spec.high
                raise CheckpointError(
                    f"{source}: {prefix}{name} is {_shown(value)}; it must be {spec.what()}"
                    + ("; no real draft comes near it, fix the file." if huge else "; fix the file.")
                )


# ------------------------------------------------------------------------------------------ the weights

# (field, tensor, axis, the size the config gives that axis, how: for the message)
Dim = tuple[str, str, int, int, str]
_LAYER = re.compile(r"layers\.(\d+)\.")


def _qwen3_dims(c) -> list[Dim]:
    """The Qwen3-style body (`draft/layers.py`): attention, KV heads and MLP of layer 0."""
    a = "layers.0.self_attn."
    return [
        ("head_dim", a + "q_norm.weight", 0, c.head_dim, "head_dim"),
        ("num_attention_heads", a + "q_proj.weight", 0, c.num_attention_heads * c.head_dim,
         "num_attention_heads x head_dim"),
        ("num_key_value_heads", a + "k_proj.weight", 0, c.num_key_value_heads * c.head_dim,
         "num_key_value_heads x head_dim"),
    ]


def _kimi_k3_dims(c) -> list[Dim]:
    """The Kimi K3 MLA body (`draft/kimi_k3/attention.py`)."""
    a = "layers.0.self_attn."
    dims = [
        ("kv_lora_rank", a + "kv_a_layernorm.weight", 0, c.kv_lora_rank, "kv_lora_rank"),
        ("qk_rope_head_dim", a + "kv_a_proj_with_mqa.weight", 0, c.kv_lora_rank + c.qk_rope_head_dim,
         "kv_lora_rank + qk_rope_head_dim"),
        ("num_attention_heads", a + "o_proj.weight", 1, c.num_attention_heads * c.v_head_dim,
         "num_attention_heads x v_head_dim"),
        ("qk_nope_head_dim", a + "kv_b_proj.weight", 0, c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim),
         "num_attention_heads x (qk_nope_head_dim + v_head_dim)"),
    ]
    if c.q_lora_rank is not None:
        dims.append(("q_lora_rank", a + "q_a_proj.weight", 0, c.q_lora_rank, "q_lora_rank"))
    query = a + ("q_b_proj.weight" if c.q_lora_rank is not None else "q_proj.weight")
    dims.append(("qk_nope_head_dim", query, 0, c.num_attention_heads * c.q_head_dim,
                 "num_attention_heads x (qk_nope_head_dim + qk_rope_head_dim)"))
    return dims


def _variant_dims(c) -> list[Dim]:
    """The variants' own modules (DFlash 2, Domino, DSpark)."""
    dims: list[Dim] = []
    if hasattr(c, "selector_rank"):  # DFlash 2 (variants/dflash2.py)
        s, conv = "candidate_selector.", "layers.0.attention_conv."
        dims += [("vocab_size", s + "predecessor_codebook", 0, c.vocab_size, "vocab_size"),
                 ("selector_rank", s + "predecessor_codebook", 1, c.selector_rank, "selector_rank"),
                 ("conv_kernel_size", conv + "base_kernel", 1, c.conv_kernel_size, "conv_kernel_size"),
                 ("conv_group_size", conv + "kernel_projection.weight", 0,
                  2 * c.conv_kernel_size * c.hidden_size // c.conv_group_size,
                  "2 x conv_kernel_size x hidden_size / conv_group_size")]
    if hasattr(c, "gru_hidden_dim"):  # Domino (variants/domino.py)
        dims += [("gru_hidden_dim", "prefix_gru.weight_hh_l0", 1, c.gru_hidden_dim, "gru_hidden_dim"),
                 ("emb_dim", "embed_proj.0.weight", 0, c.emb_dim, "emb_dim"),
                 ("vocab_size", "embed_proj.2.weight", 0, c.vocab_size, "vocab_size")]
    if getattr(c, "markov_rank", 0):  # DSpark's Markov head (variants/dspark.py)
        dims += [("vocab_size", "markov_head.markov_w1.weight", 0, c.vocab_size, "vocab_size"),
                 ("markov_rank", "markov_head.markov_w1.weight", 1, c.markov_rank, "markov_rank")]
    # A reduced draft vocabulary's head and `d2t` are checked by their own reader (docs/design.md §20).
    return dims


def _dims(c) -> list[Dim]:
    """Every (field, tensor, axis, size) the config `c` fixes, the single-field ones before the products."""
    dims: list[Dim] = [
        ("hidden_size", "fc.weight", 0, c.hidden_size, "hidden_size"),
        ("target_layer_ids", "fc.weight", 1, c.num_taps * c.hidden_size, "len(target_layer_ids) x hidden_size"),
        ("intermediate_size", "layers.0.mlp.gate_proj.weight", 0, c.intermediate_size, "intermediate_size"),
    ]
    dims += _kimi_k3_dims(c) if hasattr(c, "kv_lora_rank") else _qwen3_dims(c)
    return dims + _variant_dims(c)


def check_config_shapes(config, shapes: Mapping[str, Sequence[int]], source: str, weights: str) -> None:
    """Raise `CheckpointError` when the parsed draft config `config` (of `source`) contradicts the tensor
    shapes `{name: shape}` of its weights (`weights`, for the message): the layer count, then each field that
    sizes a weight (module docstring), named with its value and the tensor's shape."""
    layers = sorted({int(m.group(1)) for name in shapes for m in [_LAYER.match(name)] if m})
    if layers != list(range(config.num_hidden_layers)):
        held = f"layers {layers[0]}..{layers[-1]}" if layers else "no layers.N tensors"
        raise CheckpointError(f"{source}: num_hidden_layers {config.num_hidden_layers} contradicts {weights}, "
                              f"which holds {held}.")
    for field, tensor, axis, size, how in _dims(config):
        value = getattr(config, field)
        if tensor not in shapes:
            raise CheckpointError(f"{source}: {weights} has no {tensor}, which a draft of this config has (sized by "
                                  f"its {field} {_shown(value)}); the weights are not this config's.")
        shape = list(shapes[tensor])
        if len(shape) <= axis or shape[axis] != size:
            raise CheckpointError(
                f"{source}: {field} {_shown(value)} contradicts {tensor} {shape} in {weights} (its dimension "
                f"{axis} would be {how} = {size}); fix the config or load the weights it was written with."
            )


def hf_tensor_shapes(directory: str) -> dict[str, list[int]]:
    """`{name: shape}` of every tensor of the HF directory's safetensors files, from their headers only;
    `CheckpointError` naming a file whose header is not a safetensors header."""
    out: dict[str, list[int]] = {}
    for path in safetensors_files(directory):
        try:
            header = json.loads(safetensors_header_bytes(path))
        except (ValueError, OSError, MemoryError, OverflowError) as err:
            raise CheckpointError(f"{path} is not a readable safetensors file (header: {type(err).__name__}).") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path} is not a readable safetensors file (its header is no JSON object).")
        for name, entry in header.items():
            shape = entry.get("shape") if isinstance(entry, dict) else None
            if name == "__metadata__":
                continue
            if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
                raise CheckpointError(f"{path} is not a readable safetensors file (tensor {_shown(name)} has no "
                                      "shape).")
            out[name] = shape
    return out


def hf_weights_name(directory: str) -> str:
    """The weights of a HF draft directory as messages name them (its model.safetensors, or its index)."""
    files = safetensors_files(directory)
    return files[0] if len(files) == 1 else os.path.join(directory, "model.safetensors.index.json")
