"""A reduced draft vocabulary: the draft proposes among ``K`` of the target's ``V`` tokens (docs/design.md §20
Reduced draft vocabulary).

`DraftVocabulary` is the mapping, in the layout the serving runtimes and the published trainers share:
``d2t [K]`` int64 *offsets* (draft id ``i`` is target id ``i + d2t[i]``; the draft ids are the chosen target
ids in increasing order) and ``t2d [V]`` bool (which target ids the draft can propose). `DraftLMHead` is the
draft's own output layer over those ``K`` rows of the target's head, vocab-parallel like the target's: rank
``k`` of the tensor-parallel group holds rows ``[k * chunk, min(K, (k + 1) * chunk))`` with ``chunk =
ceil(K / TP)`` (an uneven split, `draft.sharding.mark_uneven_split`), so a file written at one TP size loads at
any other. `check_vocab_tensors` is the one check of a file's ``d2t`` / ``t2d`` (dtype, shape, range, order, their
agreement with each other and with the config's sizes): the loader, the converters and the serving check apply it.

Shapes: K draft vocabulary, V target vocabulary, H hidden size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from ..common.errors import CheckpointError
from ..common.parallel import tensor_parallel_group
from ..data.token_counts import bad_draft_id
from .sharding import mark_uneven_split, uneven_split_rows

__all__ = ["DraftVocabulary", "DraftLMHead", "check_vocab_tensors", "read_vocab_tensors"]

# d2t holds signed offsets (target id - draft id): any integer dtype of safetensors; a bool is a mask, not offsets
_INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


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
        """From the serving layout: ``d2t [K]`` offsets (and, when given, the ``t2d [V]`` bool mask), checked by
        `check_vocab_tensors`."""
        return check_vocab_tensors(d2t, t2d, target_vocab_size=target_vocab_size)

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


def _tensor_problem(name: str, tensor, dtypes: tuple, what: str, size: Optional[int], field_name: str) -> Optional[str]:
    """Why ``tensor`` is not a non-empty 1-D tensor of one of ``dtypes`` with ``size`` entries (the config's
    ``field_name``; any number when None), or None."""
    if not isinstance(tensor, torch.Tensor):
        return f"{name} is {type(tensor).__name__}, not a tensor ({what})"
    if tensor.dtype not in dtypes or tensor.dim() != 1:
        dtype = str(tensor.dtype).removeprefix("torch.")
        return f"{name} has dtype {dtype} and shape {list(tensor.shape)}; it must be a 1-D {what}"
    if size is not None and tensor.numel() != size:
        return f"{name} has {tensor.numel()} entries; {field_name} is {size} (the config's)"
    if tensor.numel() < 1:
        return f"{name} is empty"
    return None


_D2T = "integer tensor of offsets (target id = draft id + d2t[draft id])"
_T2D = "bool mask over the target vocabulary"


def _check_t2d(t2d, V: Optional[int]) -> None:
    problem = _tensor_problem("t2d", t2d, (torch.bool, *_INTEGER_DTYPES), _T2D, V, "vocab_size")
    if problem is None and t2d.dtype != torch.bool and bool(((t2d != 0) & (t2d != 1)).any()):
        problem = f"t2d holds values other than 0 and 1 (e.g. {int(t2d[(t2d != 0) & (t2d != 1)][0])}); it is a mask"
    if problem:
        raise CheckpointError(problem + ".")


def check_vocab_tensors(d2t, t2d=None, *, draft_vocab_size: Optional[int] = None,
                        target_vocab_size: Optional[int] = None) -> DraftVocabulary:
    """The `DraftVocabulary` of a file's ``d2t [K]`` (and ``t2d [V]``, when it has one), or `CheckpointError`
    saying which tensor and which entry breaks the serving layout (docs/design.md §20): ``d2t`` a 1-D integer
    tensor (no bool, no float) of ``draft_vocab_size`` offsets whose target ids ``i + d2t[i]`` lie in
    ``[0, target_vocab_size)`` and increase strictly (`data.token_counts.bad_draft_id`); ``t2d`` a 1-D bool mask
    of ``target_vocab_size`` entries (or 0/1 integers) marking exactly those ids. A size that is None is taken
    from the tensors (V from ``t2d``; without either, the range is checked from below only)."""
    V = target_vocab_size
    if t2d is not None:
        _check_t2d(t2d, V)
        V = t2d.numel() if V is None else V
    problem = _tensor_problem("d2t", d2t, _INTEGER_DTYPES, _D2T, draft_vocab_size, "draft_vocab_size")
    if problem:
        raise CheckpointError(problem + ".")
    offsets = d2t.detach().cpu().to(torch.int64)
    ids = offsets + torch.arange(offsets.numel(), dtype=torch.int64)
    bad = bad_draft_id(ids.tolist(), int(V) if V is not None else int(ids.max()) + 1)
    if bad is not None:
        i, what = bad
        raise CheckpointError(f"d2t[{i}] = {int(offsets[i])}: draft id {i}'s target id (i + d2t[i]) {what}.")
    vocab = DraftVocabulary(ids, int(V) if V is not None else int(ids[-1]) + 1)
    if t2d is not None:
        marked = t2d.detach().cpu().bool()
        diff = torch.nonzero(marked != vocab.t2d).view(-1)
        if diff.numel():
            j = int(diff[0])
            side = "marks target id {j}, which d2t does not map to" if marked[j] else \
                "does not mark target id {j}, which d2t maps a draft id to"
            raise CheckpointError(f"t2d {side.format(j=j)} (t2d marks {int(marked.sum())} ids, d2t maps "
                                  f"{vocab.size}); the two tensors must describe the same draft vocabulary.")
    return vocab


def read_vocab_tensors(tensors: dict, config=None) -> dict:
    """A HF file's tensors with the vocabulary mapping as the body holds it: ``d2t`` kept (derived from ``t2d``
    when a file has only the mask), ``t2d`` checked against it and dropped (the body derives it; vLLM skips it,
    speculators and SpecForge write both). Both are checked by `check_vocab_tensors`, against ``config``'s
    ``draft_vocab_size`` and ``vocab_size`` when given (`CheckpointError` naming the tensor and the entry)."""
    tensors = dict(tensors)
    t2d = tensors.pop("t2d", None)
    K = getattr(config, "draft_vocab_size", None)
    V = getattr(config, "vocab_size", None) if config is not None else None
    if "d2t" in tensors:
        check_vocab_tensors(tensors["d2t"], t2d, draft_vocab_size=K, target_vocab_size=V)
    elif t2d is not None:
        _check_t2d(t2d, V)
        ids = torch.nonzero(t2d.bool()).view(-1).to(torch.int64)
        if ids.numel() == 0:
            raise CheckpointError("t2d marks no target id: the draft vocabulary it describes is empty.")
        if K is not None and ids.numel() != K:
            raise CheckpointError(f"t2d marks {ids.numel()} target ids, but the config's draft_vocab_size is {K} (a "
                                  "file without d2t takes its draft vocabulary from t2d).")
        d2t = ids - torch.arange(ids.numel(), dtype=torch.int64)
        tensors["d2t"] = check_vocab_tensors(d2t, t2d, draft_vocab_size=K, target_vocab_size=V).d2t
    return tensors
