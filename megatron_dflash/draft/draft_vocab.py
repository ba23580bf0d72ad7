"""A reduced draft vocabulary: the draft proposes among ``K`` of the target's ``V`` tokens (docs/design.md §20
Reduced draft vocabulary).

`DraftVocabulary` is the mapping, in the layout the serving runtimes and the published trainers share:
``d2t [K]`` int64 *offsets* (draft id ``i`` is target id ``i + d2t[i]``; the draft ids are the chosen target
ids in increasing order) and ``t2d [V]`` bool (which target ids the draft can propose). `DraftLMHead` is the
draft's own output layer over those ``K`` rows of the target's head, vocab-parallel like the target's: rank
``k`` of the tensor-parallel group holds rows ``[k * chunk, min(K, (k + 1) * chunk))`` with ``chunk =
ceil(K / TP)`` (an uneven split, `draft.sharding.mark_uneven_split`), so a file written at one TP size loads at
any other.

Shapes: K draft vocabulary, V target vocabulary, H hidden size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ..common.parallel import tensor_parallel_group
from .sharding import mark_uneven_split, uneven_split_rows

__all__ = ["DraftVocabulary", "DraftLMHead", "read_vocab_tensors"]


@dataclass(frozen=True)
class DraftVocabulary:
    """``K`` target token ids the draft proposes among (``ids [K]`` int64, strictly increasing) out of ``V``.

    Draft id ``i`` is target id ``ids[i]``; `d2t` stores that as the offset ``ids[i] - i`` (the serving layout).
    """

    ids: torch.Tensor
    target_vocab_size: int
    # `draft_index` per device, built once: the losses map every micro-batch's labels through it
    _index: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ids, V = self.ids, int(self.target_vocab_size)
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype != torch.int64 or ids.numel() < 1:
            raise ValueError("DraftVocabulary.ids must be a non-empty 1-D int64 tensor of target token ids.")
        if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError("DraftVocabulary.ids must be strictly increasing (each target id once, in order).")
        if int(ids[0]) < 0 or int(ids[-1]) >= V:
            raise ValueError(f"DraftVocabulary.ids must lie in [0, {V}) (the target vocabulary); got "
                             f"[{int(ids[0])}, {int(ids[-1])}].")

    @classmethod
    def from_ids(cls, ids, target_vocab_size: int) -> "DraftVocabulary":
        """From any collection of distinct target ids (sorted here)."""
        ids = torch.as_tensor(list(ids) if not isinstance(ids, torch.Tensor) else ids, dtype=torch.int64)
        return cls(torch.sort(ids.cpu()).values, int(target_vocab_size))

    @classmethod
    def from_d2t(cls, d2t: torch.Tensor, target_vocab_size: int, t2d=None) -> "DraftVocabulary":
        """From the serving layout: ``d2t [K]`` offsets (and, when given, the ``t2d [V]`` bool mask, checked)."""
        if not isinstance(d2t, torch.Tensor) or d2t.dim() != 1 or d2t.dtype.is_floating_point:
            raise ValueError("d2t must be a 1-D integer tensor of offsets (target id = draft id + d2t[draft id]).")
        ids = d2t.detach().cpu().to(torch.int64) + torch.arange(d2t.numel(), dtype=torch.int64)
        vocab = cls(ids, int(target_vocab_size))
        if t2d is not None:
            if tuple(t2d.shape) != (vocab.target_vocab_size,) or not torch.equal(t2d.detach().cpu().bool(), vocab.t2d):
                raise ValueError(f"t2d {tuple(t2d.shape)} does not mark exactly the target ids d2t maps to "
                                 f"(expected a [{vocab.target_vocab_size}] bool mask with {vocab.size} entries set).")
        return vocab

    @property
    def size(self) -> int:
        """K."""
        return int(self.ids.numel())

    @property
    def d2t(self) -> torch.Tensor:
        """``[K]`` int64 offsets: target id = draft id + ``d2t[draft id]``."""
        return self.ids - torch.arange(self.size, dtype=torch.int64, device=self.ids.device)

    @property
    def t2d(self) -> torch.Tensor:
        """``[V]`` bool: the target ids the draft can propose."""
        mask = torch.zeros(self.target_vocab_size, dtype=torch.bool)
        mask[self.ids.cpu()] = True
        return mask

    def draft_index(self, device=None) -> torch.Tensor:
        """``[V]`` int64: the draft id of each target id, -1 outside the draft vocabulary (built once per
        device)."""
        device = torch.device(device if device is not None else "cpu")
        index = self._index.get(device)
        if index is None:
            index = torch.full((self.target_vocab_size,), -1, dtype=torch.int64, device=device)
            index[self.ids.to(device)] = torch.arange(self.size, dtype=torch.int64, device=device)
            self._index[device] = index
        return index

    def to(self, device) -> "DraftVocabulary":
        return DraftVocabulary(self.ids.to(device), self.target_vocab_size)


def _chunk(size: int, tp: int) -> int:
    return math.ceil(size / tp)


class DraftLMHead(nn.Module):
    """The draft's output layer ``weight [K, H]`` (rows: the target head's rows of the draft vocabulary),
    vocab-parallel: this rank holds rows `uneven_split_rows(K, chunk, rank)` and reads as a column-parallel
    layer of ``output_size_per_partition = chunk`` columns (a last rank with fewer rows is padded with zero
    rows by `target.head.OutputHead.of_draft`, its padding columns set to ``-inf``)."""

    def __init__(self, draft_vocab_size: int, hidden_size: int, *, tp_group=None, dtype=None):
        super().__init__()
        self.tp_group = tensor_parallel_group(tp_group)
        tp, rank = self.tp_group.size(), self.tp_group.rank()
        K = int(draft_vocab_size)
        self.output_size_per_partition = _chunk(K, tp)
        if uneven_split_rows(K, self.output_size_per_partition, tp - 1)[0] >= K:
            raise ValueError(f"draft_vocab_size={K} is too small for TP={tp}: the last ranks would hold no row of "
                             "the draft head; use a larger draft vocabulary or a smaller TP size.")
        start, end = uneven_split_rows(K, self.output_size_per_partition, rank)
        self.weight = nn.Parameter(torch.zeros(end - start, hidden_size, dtype=dtype), requires_grad=False)
        mark_uneven_split(self.weight, 0, K, self.output_size_per_partition)
        self.bias = None

    @torch.no_grad()
    def copy_target_rows(self, full_rows: torch.Tensor) -> None:
        """Set the weight from the target head's ``[K, H]`` rows of the draft vocabulary (this rank's part)."""
        K = self.weight.uneven_split[0]
        if tuple(full_rows.shape) != (K, self.weight.shape[1]):
            raise ValueError(f"the draft head takes [{K}, {self.weight.shape[1]}] target rows, got "
                             f"{tuple(full_rows.shape)}.")
        start, end = uneven_split_rows(K, self.output_size_per_partition, self.tp_group.rank())
        self.weight.copy_(full_rows[start:end].to(device=self.weight.device, dtype=self.weight.dtype))


def read_vocab_tensors(tensors: dict) -> dict:
    """A HF file's tensors with the vocabulary mapping as the body holds it: ``d2t`` kept (derived from ``t2d``
    when a file has only the mask), ``t2d`` checked against it and dropped (the body derives it; vLLM skips it,
    speculators and SpecForge write both)."""
    tensors = dict(tensors)
    t2d = tensors.pop("t2d", None)
    if t2d is None:
        return tensors
    if t2d.dim() != 1:
        raise ValueError(f"t2d must be a [target vocabulary] bool mask, got shape {tuple(t2d.shape)}.")
    if "d2t" not in tensors:
        ids = torch.nonzero(t2d.bool()).view(-1)
        tensors["d2t"] = DraftVocabulary(ids.to(torch.int64), t2d.numel()).d2t
    else:
        DraftVocabulary.from_d2t(tensors["d2t"], t2d.numel(), t2d)
    return tensors
