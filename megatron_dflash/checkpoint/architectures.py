"""Which draft variant a checkpoint file holds: the variant registry, seen from the file formats.

The HF loader's neighbours that must answer before torch loads (the torch_dist layout in
`checkpoint/torch_dist.py`, the converter in `checkpoint/conversion.py` / `checkpoint/convert.py`) ask here which variant a
`config.json` / `dflash_config.json` describes, which variant a body is, and how to build a body
that a checkpoint then overwrites. Every answer comes from `variants.registry` (docs/design.md §12
Variants), imported on first use: the registry loads torch, and the command line reports bad paths
before torch loads.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Mapping, Optional

from .hf_config_check import check_config_fields, check_config_shapes, hf_tensor_shapes, hf_weights_name

if TYPE_CHECKING:
    from ..variants.registry import Variant

__all__ = ["architecture_of", "architecture_for_config", "known_architectures", "build_body_for_checkpoint",
           "read_json_object", "config_from_dict", "read_hf_draft_config", "architecture_hint"]


def _registry():
    # here: command lines read which variant a config names before torch loads (see the module docstring)
    from ..variants import registry

    return registry


def known_architectures() -> list[str]:
    """Every `architectures[0]` name a registered variant reads (its own and the aliases)."""
    registry = _registry()
    return sorted({name for v in registry.variant_names() for name in registry.get_variant(v).hf_names})


def read_json_object(path: str) -> dict:
    """The JSON object in the file `path` (a config); ValueError naming `path` when it is not valid JSON or
    not an object."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    except RecursionError:  # nested deeper than the parser goes: no config is
        raise ValueError(f"{path} is not a config: its JSON is nested too deeply.") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object.")
    return data


def config_from_dict(data: Mapping[str, Any], source: str):
    """`(Variant, config)` of a HF-layout config dict; ValueError naming `source` otherwise (`CheckpointError`
    for a field of the wrong JSON type or out of range, checked before any variant reads the dict)."""
    check_config_fields(data, source)
    return _registry().config_from_hf_dict(data, source)


def read_hf_draft_config(directory: str, shapes: Optional[Mapping[str, Any]] = None):
    """`(Variant, config)` of the HF draft directory `directory`: its `config.json` read by `config_from_dict`
    and checked against the tensor shapes `{name: shape}` of its safetensors headers (`shapes`, default: read
    here) (`hf_config_check.check_config_shapes`), so that a body built from it is the file's size. Nothing is
    built and no tensor is read."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist: not a HF draft directory.")
    variant, config = config_from_dict(read_json_object(path), path)
    shapes = hf_tensor_shapes(directory) if shapes is None else shapes
    if variant.hf_tensors is not None:  # a foreign layout is refused by its name first (ModelOpt's DSpark)
        try:
            variant.hf_tensors(dict.fromkeys(shapes))  # the names only: the weights are not read yet
        except (AttributeError, TypeError):  # a reader that needs the tensors: the loader calls it with them
            pass
    check_config_shapes(config, shapes, path, hf_weights_name(directory))
    return variant, config


def architecture_for_config(data: Mapping[str, Any]) -> "Variant":
    """The registered variant that reads this HF-layout config dict."""
    return _registry().variant_for_hf_config(data)


def architecture_of(body) -> "Variant":
    """The registered variant of a draft body (ValueError for an unregistered body class)."""
    return _registry().variant_of(body)


def build_body_for_checkpoint(architecture: "Variant", config, *, params_dtype=None, parallel_config=None,
                              tp_group=None, attention_backend: str = "auto", initialize: bool = False):
    """A body of `architecture` whose weights a checkpoint overwrites next.

    Without `parallel_config`, megatron's initialisation is skipped unless `initialize` (it is what
    marks split weights for megatron's optimizer, so a body that will train asks for it).
    """
    import torch

    # here: command lines read which variant a config names before torch loads (see the module docstring)
    from ..draft.body import default_parallel_config

    if parallel_config is None:
        parallel_config = default_parallel_config(
            perform_initialization=initialize, params_dtype=params_dtype or torch.float32
        )
    return architecture.build_body(
        config, parallel_config=parallel_config, tp_group=tp_group, attention_backend=attention_backend
    )



def architecture_hint(architecture: Optional["Variant"], unexpected: list[str]) -> Optional[str]:
    """When the unexpected tensors are neither an embedding/LM head nor prefixed, they likely
    belong to another variant whose file was labelled with this architecture (docs/design.md §15 Pitfalls)."""
    if architecture is None:
        return None
    foreign = [n for n in unexpected if not (n.startswith(("lm_head", "model.")) or "embed_tokens" in n)]
    if not foreign:
        return None
    return (
        f"the config says architectures=[{architecture.architecture!r}] but tensors such as {foreign[0]} belong "
        f"to another variant; if so, set `architectures` to it (known: {known_architectures()})"
    )
