"""The target's input embedding and output head alone, read from its safetensors files without building (or
loading) its decoder layers: what a run that reads the target's states from a cache needs of the target
(docs/design.md §8 Data path, "Training from cached target states").

Under draft TP > 1 the head is vocab-parallel as megatron's output layer is (`VocabShard`: this rank's rows of
the vocabulary padded as megatron pads it), so the loss kernels see the same shards as with the megatron
target; the embedding is whole on every rank (a lookup, equal to the vocab-parallel embedding's sum).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from safetensors import safe_open
from torch import nn

from ..common.safetensors_files import target_safetensors_files
from ..draft.config import DFlashConfig
from .head import OutputHead
from .megatron.config import padded_vocab_size

__all__ = ["VocabShard", "FrozenHeads", "load_frozen_heads", "target_weight_bytes"]


class VocabShard(nn.Module):
    """This rank's rows ``[rank * V_local, (rank + 1) * V_local)`` of a vocab-parallel output weight (zero rows
    past the real vocabulary), shaped like megatron's column-parallel output layer for `OutputHead`."""

    def __init__(self, weight: torch.Tensor, tp_group):
        super().__init__()
        self.output_size_per_partition = int(weight.shape[0])
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None
        self.tp_group = tp_group


@dataclass
class FrozenHeads:
    """``embedding`` (an ``nn.Embedding``) and ``head`` (`OutputHead`), frozen; ``loaded_bytes`` /
    ``skipped_bytes``: the target's weights read and left on disk, at the run's dtype."""

    embedding: nn.Module
    head: OutputHead
    loaded_bytes: int
    skipped_bytes: int


def _tensor_names(files: list) -> dict:
    """name -> (file, shape) of every tensor of the target's safetensors files (headers only)."""
    names = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                names[name] = (path, f.get_slice(name).get_shape())
    return names


def _embedding_name(names: dict) -> str:
    found = sorted(n for n in names if n.endswith("embed_tokens.weight"))
    if not found:
        raise ValueError("the target's safetensors files hold no '*embed_tokens.weight': its input embedding "
                         "cannot be read without the model code; train online (without a target-state cache).")
    return found[0]


def target_weight_bytes(names: dict, dtype: torch.dtype) -> int:
    """Bytes of the tensors `names` (`_tensor_names`) at `dtype`."""
    return sum(math.prod(shape) for _, shape in names.values()) * dtype.itemsize


def load_frozen_heads(target_dir: str, config: DFlashConfig, dtype: torch.dtype, tp_group, *, tied: bool,
                      vocab_parallel: bool) -> FrozenHeads:
    """The embedding and the output head of the target in `target_dir` at `dtype` (tied: the head is the
    embedding's weight, as ``tie_word_embeddings`` says). ``vocab_parallel`` (the megatron backend's head, any
    TP): this rank's rows of `tp_group`'s split of megatron's padded vocabulary; else a plain ``nn.Linear``."""
    names = _tensor_names(target_safetensors_files(target_dir))
    embed_name = _embedding_name(names)
    head_name = embed_name if tied or "lm_head.weight" not in names else "lm_head.weight"

    def read(name):
        with safe_open(names[name][0], framework="pt") as f:
            return f.get_tensor(name).to(dtype)

    embed_weight = read(embed_name)
    embedding = nn.Embedding(embed_weight.shape[0], embed_weight.shape[1], _weight=embed_weight, _freeze=True)
    head_weight = embed_weight if head_name == embed_name else read(head_name)
    if vocab_parallel:
        tp = tp_group.size()
        local = padded_vocab_size(head_weight.shape[0], tp) // tp
        start = tp_group.rank() * local
        rows = head_weight[start:start + local]
        shard = torch.zeros(local, head_weight.shape[1], dtype=dtype)
        shard[: rows.shape[0]] = rows
        layer = VocabShard(shard, tp_group)
    else:
        layer = nn.Linear(head_weight.shape[1], head_weight.shape[0], bias=False, dtype=dtype)
        layer.weight = nn.Parameter(head_weight, requires_grad=False)
    head = OutputHead.from_config(layer, config, tp_group=tp_group if vocab_parallel else None)
    used = {embed_name, head_name}
    loaded = target_weight_bytes({n: names[n] for n in used}, dtype)
    return FrozenHeads(embedding, head, loaded, target_weight_bytes(names, dtype) - loaded)
