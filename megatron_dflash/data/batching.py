"""From samples to batches: packing, collation, the resumable data-parallel sampler, and Megatron GPT batches
(docs/design.md §8 Data path).

Everything here produces or consumes one batch format, a Megatron-style dict of tensors:

=================  ===========  =================================================================
key                shape/dtype  meaning
=================  ===========  =================================================================
``tokens``         [B, S] long  token ids; padding = the tokenizer's pad id
``loss_mask``      [B, S] bool  supervised tokens (assistant turns for chat, every real token for
                                text); False on padding
``position_ids``   [B, S] long  RoPE positions, restarting at 0 at every packed document
                                (padding continues the count of the row's last document)
``document_ids``   [B, S] long  document of each token: 0, 1, ... per packed document, 0 for every
                                real token of an unpacked row, -1 on padding
``sample_ids``     [B] int64    stable, unique ID of the row (see ``data.samples.stable_sample_id``)
=================  ===========  =================================================================

``plan.data_hook.attach_dflash_plan`` adds the batch plan to such a batch.

Determinism: the sampler's order is a pure function of ``(seed, epoch)`` and resumes exactly at any
optimizer step; packing is deterministic; IDs of rows without sample IDs are hashed from their tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

import numpy as np
import torch

from ..common.hashing import M32 as _M32
from ..common.hashing import absorb, hash_elements, mix32
from .samples import Sample, check_seq_length, stable_sample_id

__all__ = [
    "PackedRow",
    "pack_samples",
    "collate",
    "Collator",
    "real_length",
    "trim_batch",
    "MicroBatchIterator",
    "content_sample_ids",
    "from_megatron_gpt_batch",
]


# --------------------------------------------------------------------------------------------------
# Packing and collation
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackedRow:
    """Documents packed into one row (unpadded, length <= seq_length).

    Attributes:
        input_ids, loss_mask: [L] concatenation of the documents.
        position_ids: [L] int64, restarting at 0 at each document.
        document_ids: [L] int64, 0, 1, ... in the order the documents were placed (contiguous runs).
        sample_id: ID of the row: the document's own ID for a single document, otherwise a hash of the
            documents' IDs in order.
        sample_ids: IDs of the documents, in row order.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    document_ids: torch.Tensor
    sample_id: int
    sample_ids: tuple

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def _as_sample(sample, seq_length: int, i: int) -> Sample:
    if isinstance(sample, Mapping):
        sample = Sample(torch.as_tensor(sample["input_ids"]), torch.as_tensor(sample["loss_mask"]),
                        int(sample["sample_id"]))
    if not hasattr(sample, "input_ids") or not hasattr(sample, "loss_mask") or not hasattr(sample, "sample_id"):
        raise TypeError(f"sample {i} must be a Sample (input_ids, loss_mask, sample_id), got {type(sample).__name__}.")
    ids = torch.as_tensor(sample.input_ids).reshape(-1)
    mask = torch.as_tensor(sample.loss_mask).reshape(-1)
    if ids.shape != mask.shape:
        raise ValueError(
            f"sample {i}: input_ids {tuple(ids.shape)} and loss_mask {tuple(mask.shape)} differ in length."
        )
    if ids.numel() == 0:
        raise ValueError(f"sample {i} (id {sample.sample_id}) has no tokens.")
    return Sample(ids[:seq_length].to(torch.int64), mask[:seq_length].to(torch.bool), int(sample.sample_id))


def pack_samples(samples: Sequence, seq_length: int) -> list[PackedRow]:
    """Pack documents into rows of at most ``seq_length`` tokens: greedy first fit, in order.

    Each sample (truncated to ``seq_length``) goes into the first row, in creation order, with room for
    it; a new row is opened when none has. Deterministic; no token is dropped beyond the truncation.
    """
    seq_length = check_seq_length(seq_length)
    docs = [_as_sample(s, seq_length, i) for i, s in enumerate(samples)]
    rows: list[list[Sample]] = []
    free: list[int] = []
    for doc in docs:
        n = len(doc)
        for r, room in enumerate(free):
            if room >= n:
                rows[r].append(doc)
                free[r] -= n
                break
        else:
            rows.append([doc])
            free.append(seq_length - n)
    out = []
    for members in rows:
        ids = [d.sample_id for d in members]
        out.append(PackedRow(
            input_ids=torch.cat([d.input_ids for d in members]),
            loss_mask=torch.cat([d.loss_mask for d in members]),
            position_ids=torch.cat([torch.arange(len(d), dtype=torch.int64) for d in members]),
            document_ids=torch.cat([torch.full((len(d),), j, dtype=torch.int64) for j, d in enumerate(members)]),
            sample_id=ids[0] if len(ids) == 1 else stable_sample_id("packed", *ids),
            sample_ids=tuple(ids),
        ))
    return out


def collate(samples: Sequence, pad_id: int, seq_length: int, pack: bool = False) -> dict:
    """Stack samples into a batch dict (see the module docstring), padded to ``seq_length``.

    Without packing every sample is one row (B = len(samples)); with ``pack=True`` the samples are packed
    by ``pack_samples`` and B is the number of packed rows (<= len(samples)).
    """
    seq_length = check_seq_length(seq_length)
    if isinstance(pad_id, bool) or not isinstance(pad_id, (int, np.integer)):
        raise ValueError(f"pad_id must be an int (the tokenizer's pad id), got {pad_id!r}.")
    if len(samples) == 0:
        raise ValueError("collate needs at least one sample.")
    if pack:
        rows = pack_samples(samples, seq_length)
    else:
        rows = []
        for i, s in enumerate(samples):
            s = _as_sample(s, seq_length, i)
            n = len(s)
            rows.append(PackedRow(s.input_ids, s.loss_mask, torch.arange(n, dtype=torch.int64),
                                  torch.zeros(n, dtype=torch.int64), s.sample_id, (s.sample_id,)))
    b = len(rows)
    tokens = torch.full((b, seq_length), int(pad_id), dtype=torch.int64)
    loss_mask = torch.zeros(b, seq_length, dtype=torch.bool)
    position_ids = torch.zeros(b, seq_length, dtype=torch.int64)
    document_ids = torch.full((b, seq_length), -1, dtype=torch.int64)
    for r, row in enumerate(rows):
        n = len(row)
        tokens[r, :n] = row.input_ids
        loss_mask[r, :n] = row.loss_mask
        position_ids[r, :n] = row.position_ids
        document_ids[r, :n] = row.document_ids
        last = int(row.position_ids[-1]) + 1
        position_ids[r, n:] = torch.arange(last, last + seq_length - n, dtype=torch.int64)
    return {
        "tokens": tokens,
        "loss_mask": loss_mask,
        "position_ids": position_ids,
        "document_ids": document_ids,
        "sample_ids": torch.tensor([row.sample_id for row in rows], dtype=torch.int64),
    }


@dataclass(frozen=True)
class Collator:
    """Picklable ``collate_fn`` (for ``MicroBatchIterator`` or a torch ``DataLoader``)."""

    pad_id: int
    seq_length: int
    pack_sequences: bool = False

    def __call__(self, samples: Sequence) -> dict:
        return collate(samples, self.pad_id, self.seq_length, pack=self.pack_sequences)


def real_length(document_ids: torch.Tensor, multiple: int = 1) -> int:
    """The columns a batch's real tokens reach: one past the last non-padding position of its longest row
    (``document_ids >= 0``), rounded up to a multiple of ``multiple`` and at most ``S`` (at least 1).

    Padding is always a row's tail (`collate`), so ``[:, :real_length]`` holds every real token."""
    B, S = document_ids.shape
    real = (document_ids >= 0).any(dim=0).nonzero()
    n = int(real[-1]) + 1 if real.numel() else 1
    return min(S, -(-n // multiple) * multiple)


def trim_batch(batch: Mapping, length: int) -> dict:
    """``batch`` with its ``[B, S]`` tensors cut to their first ``length`` columns (others as they are)."""
    S = batch["tokens"].shape[1]
    return {k: (v[:, :length] if isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape[1] == S else v)
            for k, v in batch.items()}


# --------------------------------------------------------------------------------------------------
# DP-aware deterministic sampler
# --------------------------------------------------------------------------------------------------


def _check_count(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}.")
    return int(value)


class MicroBatchIterator:
    """The micro-batches of one data-parallel rank, step after step, in a seeded order.

    The samples form one endless stream: epoch ``e`` is the permutation
    ``numpy.random.default_rng([seed, e]).permutation(len(dataset))``, epochs follow each other. Optimizer
    step ``t`` consumes stream positions ``[t * G, (t + 1) * G)`` (G = global batch size); within it,
    micro-batch ``m`` of DP rank ``r`` is ``t * G + m * (M * D) + r * M + [0, M)`` (M = micro batch size,
    D = DP size), Megatron's layout. So every sample is seen once per epoch across the DP ranks, and
    starting at ``start_step`` jumps straight to position ``start_step * G`` without touching earlier ones.

    Iterating yields ``num_micro_batches = G / (M * D)`` micro-batches per step, flat (the way a Megatron
    training loop calls ``next`` on its data iterator); each is ``collate_fn(list of samples)``, or the
    list itself without a ``collate_fn``.
    """

    def __init__(self, dataset, *, micro_batch_size: int, global_batch_size: int, dp_rank: int, dp_size: int,
                 seed: int, start_step: int = 0, collate_fn: Optional[Callable] = None):
        self.micro_batch_size = _check_count("micro_batch_size", micro_batch_size, 1)
        self.global_batch_size = _check_count("global_batch_size", global_batch_size, 1)
        self.dp_size = _check_count("dp_size", dp_size, 1)
        self.dp_rank = _check_count("dp_rank", dp_rank, 0)
        if self.dp_rank >= self.dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be < dp_size={dp_size}.")
        per_micro = self.micro_batch_size * self.dp_size
        if self.global_batch_size % per_micro:
            raise ValueError(
                f"global_batch_size={global_batch_size} must be divisible by micro_batch_size * dp_size = "
                f"{micro_batch_size} * {dp_size} = {per_micro}."
            )
        self.num_micro_batches = self.global_batch_size // per_micro
        self.seed = _check_count("seed", seed, 0)
        self.start_step = _check_count("start_step", start_step, 0)
        self.dataset = dataset
        self.num_samples = len(dataset)
        if self.num_samples == 0:
            raise ValueError("MicroBatchIterator: the dataset is empty.")
        self.collate_fn = collate_fn
        self.step = self.start_step  # the step the next micro-batch belongs to
        self.micro = 0  # index of the next micro-batch within the step
        self._perms: dict[int, np.ndarray] = {}

    # ---- pure index arithmetic -------------------------------------------------------------------

    def permutation(self, epoch: int) -> np.ndarray:
        """Sample order of ``epoch`` (cached, at most two epochs kept)."""
        perm = self._perms.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = perm
        return perm

    def micro_batch_indices(self, step: int, micro: int) -> list[int]:
        """Dataset indices of micro-batch ``micro`` of ``step`` on this DP rank."""
        if not 0 <= micro < self.num_micro_batches:
            raise ValueError(f"micro={micro} out of range [0, {self.num_micro_batches}).")
        first = (step * self.global_batch_size + micro * self.micro_batch_size * self.dp_size
                 + self.dp_rank * self.micro_batch_size)
        out = []
        for g in range(first, first + self.micro_batch_size):
            epoch, offset = divmod(g, self.num_samples)
            out.append(int(self.permutation(epoch)[offset]))
        return out

    def step_indices(self, step: int) -> list[list[int]]:
        """The ``num_micro_batches`` micro-batches (dataset indices) of ``step`` on this DP rank."""
        return [self.micro_batch_indices(step, m) for m in range(self.num_micro_batches)]

    def epoch_of(self, step: int) -> int:
        """Epoch of the first sample of ``step``."""
        return step * self.global_batch_size // self.num_samples

    @property
    def consumed_samples(self) -> int:
        """Samples consumed by all DP ranks before the next step (Megatron's ``consumed_train_samples``)."""
        return self.step * self.global_batch_size

    # ---- iteration -------------------------------------------------------------------------------

    def __iter__(self) -> "MicroBatchIterator":
        return self

    def __next__(self):
        indices = self.micro_batch_indices(self.step, self.micro)
        self.micro += 1
        if self.micro == self.num_micro_batches:
            self.step, self.micro = self.step + 1, 0
        samples = [self.dataset[i] for i in indices]
        return self.collate_fn(samples) if self.collate_fn is not None else samples


# --------------------------------------------------------------------------------------------------
# Megatron GPT batches
# --------------------------------------------------------------------------------------------------

_STAGE_CONTENT_LO = 0x2545F491
_STAGE_CONTENT_HI = 0x9E3779B1
_STAGE_CHECK = 0x4F1BBCDD


def content_sample_ids(tokens: torch.Tensor) -> torch.Tensor:
    """[B] int64 row IDs hashed from the tokens on the device (for batches that carry no sample IDs).

    Row ``i``'s ID depends only on ``tokens[i]`` (not on the batch, the device or the rank); identical
    rows get identical IDs. Non-negative, < 2**63. No host synchronisation.
    """
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        raise ValueError(f"tokens must be a [batch, seq] tensor, got {getattr(tokens, 'shape', type(tokens))}.")
    tokens = tokens.to(torch.int64)
    pos = torch.arange(tokens.shape[1], dtype=torch.int64, device=tokens.device)[None, :]
    lo = hash_elements(tokens, _STAGE_CONTENT_LO, pos).sum(dim=1) & _M32  # order-aware through positions
    hi = hash_elements(tokens, _STAGE_CONTENT_HI, pos).sum(dim=1) & _M32
    lo, hi = mix32(lo), mix32(absorb(hi, lo, _STAGE_CHECK))
    return ((hi & 0x7FFFFFFF) << 32) | lo


def from_megatron_gpt_batch(batch: Mapping[str, torch.Tensor], *, eod_token_id: Optional[int] = None) -> dict:
    """Convert a Megatron ``GPTDataset`` batch (label-aligned ``loss_mask``) to this module's format.

    Megatron's ``loss_mask[i]`` weights the prediction of ``labels[i] = tokens[i + 1]``; the DFlash plan
    wants the token-aligned mask, ``loss_mask[j] = megatron_loss_mask[j - 1]`` (False at j = 0).
    Documents start at position 0 (``reset_position_ids``) and, with ``eod_token_id``, after every EOD
    token. Sample IDs are taken from ``batch["sample_ids"]`` when present, else hashed from the tokens.
    All on the device of the batch, no host synchronisation. Other keys are passed through.
    """
    for key in ("tokens", "loss_mask", "position_ids"):
        if key not in batch:
            raise KeyError(f"Megatron GPT batch has no '{key}' (keys: {sorted(batch)}).")
    tokens = batch["tokens"]
    position_ids = batch["position_ids"]
    megatron_mask = batch["loss_mask"]
    if tokens.dim() != 2 or position_ids.shape != tokens.shape or megatron_mask.shape != tokens.shape:
        raise ValueError(
            f"tokens, position_ids and loss_mask must all be [batch, seq]; got {tuple(tokens.shape)}, "
            f"{tuple(position_ids.shape)}, {tuple(megatron_mask.shape)}."
        )
    loss_mask = torch.zeros(tokens.shape, dtype=torch.bool, device=tokens.device)
    loss_mask[:, 1:] = megatron_mask[:, :-1] > 0
    starts = position_ids == 0
    if eod_token_id is not None:
        starts[:, 1:] |= tokens[:, :-1] == eod_token_id
    starts[:, 0] = True
    document_ids = starts.to(torch.int64).cumsum(dim=1) - 1
    out = dict(batch)
    out.update(
        tokens=tokens,
        loss_mask=loss_mask,
        position_ids=position_ids,
        document_ids=document_ids,
        sample_ids=batch["sample_ids"] if "sample_ids" in batch else content_sample_ids(tokens),
    )
    return out
