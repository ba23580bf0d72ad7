"""Batch plan for DFlash training: which anchors each row trains on, and how the blocks are laid out.

A *block* is ``block_size = W = gamma + 1`` consecutive slots at sequence positions ``p .. p + W - 1``.
Slot 0 holds the real anchor token ``x_p``; slot ``k >= 1`` predicts the token at ``p + k``. A block sees
the target context strictly before ``p`` (from ``context_start``, the start of the anchor's document
when sequences are packed) and the slots of its own block.

Determinism contract
--------------------
``build_dflash_batch_plan`` is a pure function of ``(input_mask, sample_ids, document_ids,
anchors_per_sample, block_size, optimizer_step, seed)``, evaluated row by row:

* the anchors of a row depend only on that row's mask / documents, its sample ID, the step and the seed;
  not on the batch size, the order of the rows, the device, the tensor layout or the rank;
* rows with the same sample ID (and the same mask / documents) get the same anchors, so every rollout
  row should carry a unique sample ID;
* a different step or seed gives an independent draw.

Why hashing and not a random generator: a global RNG (``torch.randint``, ``torch.randperm``) produces
different streams on CPU and CUDA, advances with every call (so one extra call anywhere changes every
later plan), and couples a row's draw to its neighbours in the batch. Instead every candidate position
``p`` gets a key from an integer hash of ``(seed, step, sample_id, p)`` and the ``N`` largest keys win,
which is sampling without replacement with a per-row, per-step random order that anyone can recompute.

The hash mixes 32-bit lanes stored in int64 tensors. Every multiplication uses a constant below 2**31
on a value below 2**32, so no product overflows int64 and CPU and CUDA compute bit-identical keys.
A key is ``hash << 31 | p``: the hash decides the order, the position in the low bits makes every key
unique, so ``topk`` has no ties and its result does not depend on the device's tie breaking. Positions
that cannot anchor a block get key ``-1``.

The builder runs entirely on the device of its inputs: no Python loop over tokens or rows and no host
synchronisation (no ``.item()``, ``.tolist()``, ``nonzero`` or shape-changing boolean indexing), so it
can sit inside a training step without stalling the GPU.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Optional, Union

import torch

from ..common.hashing import M32 as _M32
from ..common.hashing import absorb, mix32, seed_step_hash

__all__ = ["DFlashBatchPlan", "build_dflash_batch_plan"]

_MAX_SEQ_LENGTH = (1 << 31) - 1  # positions live in the low 31 bits of a key
# Upper bounds far above any draft (published block sizes are 8-16; a few hundred anchors per row), so
# that a typo ends in a clear error instead of an allocation of [batch, blocks, block_size] tensors.
MAX_BLOCK_SIZE = 1 << 12
MAX_BLOCKS_PER_ROW = 1 << 20
MAX_PLAN_SLOTS = 1 << 27  # batch * blocks * block_size: each [B, N, W] int64 field stays below 1 GiB


def _check_plan_size(batch: int, num_blocks: int, block_size: int) -> None:
    slots = batch * num_blocks * block_size
    if slots > MAX_PLAN_SLOTS:
        raise ValueError(
            f"the plan would hold batch x blocks x block_size = {batch} x {num_blocks} x {block_size} = {slots} slots, "
            f"more than {MAX_PLAN_SLOTS}; use fewer anchors per sample or smaller micro-batches."
        )

# Per-stage constants (arbitrary odd 32-bit values) so that absorbing the same value at different
# stages (e.g. seed == step) does not cancel out.
_STAGE_SAMPLE_LO = 0x165667B1
_STAGE_SAMPLE_HI = 0xD3A2646C
_STAGE_SECOND = 0xFD7046C5


def _position_hashes(base: int, sample_ids: torch.Tensor, seq_length: int) -> torch.Tensor:
    """32-bit hash of (seed, step, sample_id, p) for every row and position.

    Args:
        base: ``seed_step_hash(seed, step)``.
        sample_ids: [B] int64.
    Returns:
        [B, S] int64 with values in ``[0, 2**32)``.
    """
    # Both halves of the int64 sample ID; & 0xFFFFFFFF takes the two's complement bits of negative IDs.
    lo = sample_ids & _M32
    hi = (sample_ids >> 32) & _M32
    row = absorb(absorb(base, lo, _STAGE_SAMPLE_LO), hi, _STAGE_SAMPLE_HI)  # [B]
    # A second, independent row hash keyed in after the position: with one round only, two rows would
    # order positions by the same function of ``row ^ p``.
    row2 = absorb(row, 0, _STAGE_SECOND)  # [B]
    positions = torch.arange(seq_length, dtype=torch.int64, device=sample_ids.device)
    h = mix32(row[:, None] ^ positions[None, :])  # [B, S]
    return mix32((h + row2[:, None]) & _M32)


# --------------------------------------------------------------------------------------------------
# Input validation
# --------------------------------------------------------------------------------------------------


def _check_int(name: str, value, *, minimum: Optional[int] = None) -> int:
    if isinstance(value, bool) or isinstance(value, torch.Tensor):
        raise ValueError(
            f"{name} must be a Python int, got {type(value).__name__}; pass a plain integer "
            f"(e.g. int(...) on the host before the training step)."
        )
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r} of type {type(value).__name__}.") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}.")
    return value


def _describe(value) -> str:
    return str(tuple(value.shape)) if isinstance(value, torch.Tensor) else type(value).__name__


def _check_device(name: str, tensor: torch.Tensor, other: str, device: torch.device) -> None:
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device} but {other} is on {device}; move both to one device.")


def _is_integer_dtype(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _check_input_mask(input_mask) -> torch.Tensor:
    if not isinstance(input_mask, torch.Tensor):
        raise ValueError(
            f"input_mask must be a torch.Tensor of shape [batch, seq_length], got {type(input_mask).__name__}."
        )
    if input_mask.dim() != 2:
        raise ValueError(
            f"input_mask must have shape [batch, seq_length], got shape {tuple(input_mask.shape)}; "
            f"add a batch dimension with input_mask.unsqueeze(0) for a single sample."
        )
    if input_mask.dtype != torch.bool:
        raise ValueError(
            f"input_mask must be a bool tensor (True = token is supervised), got dtype {input_mask.dtype}; "
            f"convert it with input_mask.bool() or (input_mask != 0)."
        )
    if input_mask.shape[1] < 1:
        raise ValueError("input_mask has seq_length 0; every row needs at least one position.")
    if input_mask.shape[1] > _MAX_SEQ_LENGTH:
        raise ValueError(f"seq_length {input_mask.shape[1]} is too large; at most {_MAX_SEQ_LENGTH} is supported.")
    return input_mask


def _check_document_ids(document_ids, batch: int, seq_length: int, device: torch.device) -> Optional[torch.Tensor]:
    if document_ids is None:
        return None
    if not isinstance(document_ids, torch.Tensor):
        raise ValueError(
            f"document_ids must be a torch.Tensor of shape [batch, seq_length] or None, "
            f"got {type(document_ids).__name__}."
        )
    if tuple(document_ids.shape) != (batch, seq_length):
        raise ValueError(
            f"document_ids must have the same shape as input_mask, [batch, seq_length] = {(batch, seq_length)}, "
            f"got {tuple(document_ids.shape)}."
        )
    if not _is_integer_dtype(document_ids.dtype):
        raise ValueError(
            f"document_ids must be an integer tensor (negative = padding), got dtype {document_ids.dtype}; "
            f"convert it with document_ids.long()."
        )
    _check_device("document_ids", document_ids, "input_mask", device)
    return document_ids.to(torch.int64)


def _check_block_size(block_size) -> int:
    block_size = _check_int("block_size", block_size)
    if block_size < 2:
        raise ValueError(
            f"block_size must be >= 2 (one anchor slot plus at least one predicted slot, block_size = gamma + 1), "
            f"got {block_size}."
        )
    if block_size > MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be <= {MAX_BLOCK_SIZE}, got {block_size}.")
    return block_size


# --------------------------------------------------------------------------------------------------
# Document structure and derived fields
# --------------------------------------------------------------------------------------------------


def _runs(document_ids: Optional[torch.Tensor], batch: int, seq_length: int, device: torch.device):
    """Contiguous runs of equal document id.

    Returns:
        run_start: [B, S] int64, index of the first token of the run that contains each token (0 unpacked).
        run_id:    [B, S] int64, ordinal of that run within the row (all 0 unpacked).
    """
    positions = torch.arange(seq_length, dtype=torch.int64, device=device)
    if document_ids is None:
        zeros = torch.zeros(batch, seq_length, dtype=torch.int64, device=device)
        return zeros, zeros
    boundary = torch.ones(batch, seq_length, dtype=torch.bool, device=device)
    boundary[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    run_id = boundary.to(torch.int64).cumsum(dim=1)
    # The start of the current run is the latest boundary at or before each token.
    run_start = torch.where(boundary, positions[None, :], torch.zeros_like(positions)[None, :]).cummax(dim=1).values
    return run_start, run_id


def _derive_fields(
    anchor_positions: torch.Tensor,
    block_valid: torch.Tensor,
    input_mask: torch.Tensor,
    run_start: torch.Tensor,
    block_size: int,
):
    """Fields that follow from the anchors.

    Args:
        anchor_positions: [B, N] int64 (0 for invalid blocks).
        block_valid: [B, N] bool.
        input_mask: [B, S] bool.
        run_start: [B, S] int64 start of each token's document run (zeros when unpacked).
    Returns:
        context_start [B, N], position_ids [B, N, W], context_position_ids [B, S], loss_mask [B, N, W].
    """
    seq_length = input_mask.shape[1]
    device = input_mask.device
    positions = torch.arange(seq_length, dtype=torch.int64, device=device)
    context_position_ids = positions[None, :] - run_start  # [B, S]
    context_start = torch.gather(run_start, 1, anchor_positions)  # [B, N]
    offsets = torch.arange(block_size, dtype=torch.int64, device=device)  # [W]
    position_ids = torch.gather(context_position_ids, 1, anchor_positions)[:, :, None] + offsets  # [B, N, W]
    # Invalid blocks may reach past the sequence (anchor 0 with W > S); clamp only to keep gather in range,
    # those slots are masked out by block_valid anyway.
    token_indices = (anchor_positions[:, :, None] + offsets).clamp(max=seq_length - 1)  # [B, N, W]
    batch, num_blocks = anchor_positions.shape
    supervised = torch.gather(input_mask, 1, token_indices.reshape(batch, num_blocks * block_size))
    supervised = supervised.reshape(batch, num_blocks, block_size)
    loss_mask = supervised & block_valid[:, :, None] & (offsets >= 1)
    return context_start, position_ids, context_position_ids, loss_mask


# --------------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DFlashBatchPlan:
    """Where the draft blocks of a batch sit and what each of their slots sees and learns.

    Shapes: B = batch, S = sequence length, N = blocks per row, W = block_size = gamma + 1.

    Attributes:
        anchor_positions: [B, N] int64, sequence index of slot 0 of each block (0 for invalid blocks).
            Plans from ``build_dflash_batch_plan`` list the valid anchors of a row in ascending order,
            followed by the invalid blocks.
        block_valid: [B, N] bool, whether the block is trained on.
        context_start: [B, N] int64, first sequence index the block may see: the start of its anchor's
            document (contiguous run of equal document id) when packed, 0 otherwise. The visible context
            is ``[context_start, anchor)``.
        position_ids: [B, N, W] int64, RoPE position of slot k = ``context_position_ids[anchor] + k``.
        context_position_ids: [B, S] int64, RoPE position of each context token (restarting at 0 at every
            document start when packed, ``arange(S)`` otherwise).
        loss_mask: [B, N, W] bool, False at slot 0, at every slot of an invalid block, and wherever
            ``input_mask[anchor + k]`` is False.
        block_size: W.
    """

    anchor_positions: torch.Tensor
    block_valid: torch.Tensor
    context_start: torch.Tensor
    position_ids: torch.Tensor
    context_position_ids: torch.Tensor
    loss_mask: torch.Tensor
    block_size: int

    def __post_init__(self) -> None:
        # Cheap metadata checks only (no data-dependent work, no host sync).
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 2:
            raise ValueError(f"DFlashBatchPlan.block_size must be an int >= 2, got {self.block_size!r}.")
        if self.anchor_positions.dim() != 2:
            raise ValueError(
                f"anchor_positions must have shape [batch, blocks], got {tuple(self.anchor_positions.shape)}."
            )
        b, n = self.anchor_positions.shape
        w = self.block_size
        expected = {
            "block_valid": (b, n),
            "context_start": (b, n),
            "position_ids": (b, n, w),
            "loss_mask": (b, n, w),
        }
        for name, shape in expected.items():
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise ValueError(f"DFlashBatchPlan.{name} must have shape {shape}, got {got}.")
        if self.context_position_ids.dim() != 2 or self.context_position_ids.shape[0] != b:
            raise ValueError(
                f"DFlashBatchPlan.context_position_ids must have shape [batch={b}, seq_length], "
                f"got {tuple(self.context_position_ids.shape)}."
            )

    # ---- derived properties ------------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        """B."""
        return self.anchor_positions.shape[0]

    @property
    def num_blocks(self) -> int:
        """N, blocks per row (valid or not)."""
        return self.anchor_positions.shape[1]

    @property
    def seq_length(self) -> int:
        """S, length of the target context."""
        return self.context_position_ids.shape[1]

    @property
    def gamma(self) -> int:
        """Number of predicted slots per block, W - 1."""
        return self.block_size - 1

    @property
    def device(self) -> torch.device:
        return self.anchor_positions.device

    @property
    def token_indices(self) -> torch.Tensor:
        """[B, N, W] int64 sequence index whose token slot k predicts, ``anchor + k``.

        Slot 0 is the anchor token itself. For invalid blocks the indices are clamped into ``[0, S)`` so
        that gathering labels with them never goes out of range; they are never supervised.
        """
        offsets = torch.arange(self.block_size, dtype=torch.int64, device=self.device)
        return (self.anchor_positions[:, :, None] + offsets).clamp(max=self.seq_length - 1)

    # ---- construction and movement -----------------------------------------------------------------

    @classmethod
    def from_anchors(
        cls,
        anchor_positions: torch.Tensor,
        *,
        block_size: int,
        seq_length: Optional[int] = None,
        block_valid: Optional[torch.Tensor] = None,
        input_mask: Optional[torch.Tensor] = None,
        document_ids: Optional[torch.Tensor] = None,
    ) -> "DFlashBatchPlan":
        """Build a plan from explicitly chosen anchors (tests, evaluation, decoding).

        The anchors keep the order given. Unlike the builder this validates the data and therefore
        synchronises with the host; it is not meant for the training hot path.

        Args:
            anchor_positions: [B, N] integer tensor, slot-0 sequence index of each block.
            block_size: W = gamma + 1 (>= 2).
            seq_length: S; required when ``input_mask`` is not given, must match it otherwise.
            block_valid: [B, N] bool, default all True. Anchors of invalid blocks are ignored and set to 0.
            input_mask: [B, S] bool, which tokens are supervised; default all True.
            document_ids: [B, S] integer document id per token (negative = padding) or None (unpacked).

        Raises:
            ValueError: on malformed inputs, or when a valid block does not fit inside the sequence, or
                (with ``document_ids``) crosses a document boundary or starts in padding.
        """
        block_size = _check_block_size(block_size)
        _check_anchor_positions(anchor_positions)
        device = anchor_positions.device
        batch, num_blocks = anchor_positions.shape
        _check_plan_size(batch, num_blocks, block_size)
        input_mask, seq_length = _resolve_input_mask(input_mask, seq_length, batch, device)
        block_valid = _resolve_block_valid(block_valid, batch, num_blocks, device)
        document_ids = _check_document_ids(document_ids, batch, seq_length, device)
        zero = torch.zeros((), dtype=torch.int64, device=device)
        anchors = torch.where(block_valid, anchor_positions.to(torch.int64), zero)
        _check_blocks_fit(anchors, block_valid, block_size, seq_length)
        run_start, run_id = _runs(document_ids, batch, seq_length, device)
        if document_ids is not None:
            _check_blocks_in_documents(anchors, block_valid, block_size, document_ids, run_id)

        return cls._with_derived_fields(anchors, block_valid, input_mask, run_start, block_size)

    @classmethod
    def _with_derived_fields(cls, anchors: torch.Tensor, block_valid: torch.Tensor, input_mask: torch.Tensor,
                             run_start: torch.Tensor, block_size: int) -> "DFlashBatchPlan":
        """The plan of checked `anchors [B, N]` / `block_valid [B, N]`, with its context starts, positions and
        loss mask derived from them (`_derive_fields`): the last step of both constructors."""
        context_start, position_ids, context_position_ids, loss_mask = _derive_fields(
            anchors, block_valid, input_mask, run_start, block_size
        )
        return cls(
            anchor_positions=anchors,
            block_valid=block_valid,
            context_start=context_start,
            position_ids=position_ids,
            context_position_ids=context_position_ids,
            loss_mask=loss_mask,
            block_size=block_size,
        )

    @classmethod
    def for_decoding(
        cls, anchors: torch.Tensor, context_positions: torch.Tensor, *, block_size: int
    ) -> "DFlashBatchPlan":
        """The plan of one decoding forward with a `DraftKVCache`: one block per row, nothing supervised.

        Sequence indices are positions (the cache holds position ``t`` at entry ``t``): the block of row
        ``b`` sits at positions ``anchors[b] + k`` and sees the cached positions ``< anchors[b]``. No
        checks and no host sync; the decoder keeps the values consistent.

        Args:
            anchors: [B] int64, position of each row's slot 0 (its committed length).
            context_positions: [B, S] int64, positions of the context committed since the last forward,
                which the forward writes into the cache.
            block_size: W.
        """
        B = anchors.shape[0]
        device = anchors.device
        anchors = anchors.to(torch.int64)[:, None]  # [B, 1]
        return cls(
            anchor_positions=anchors,
            block_valid=torch.ones(B, 1, dtype=torch.bool, device=device),
            context_start=torch.zeros_like(anchors),
            position_ids=anchors[:, :, None] + torch.arange(block_size, dtype=torch.int64, device=device),
            context_position_ids=context_positions,
            loss_mask=torch.zeros(B, 1, block_size, dtype=torch.bool, device=device),
            block_size=block_size,
        )

    def to(self, device: Union[str, torch.device], non_blocking: bool = False) -> "DFlashBatchPlan":
        """A copy of the plan with every tensor on ``device``."""
        changes = {
            f.name: getattr(self, f.name).to(device, non_blocking=non_blocking)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return dataclasses.replace(self, **changes)


# --------------------------------------------------------------------------------------------------
# The checks of `DFlashBatchPlan.from_anchors` (they synchronise with the host)
# --------------------------------------------------------------------------------------------------


def _check_anchor_positions(anchor_positions) -> None:
    """``anchor_positions`` is a ``[B, N]`` integer tensor."""
    if not isinstance(anchor_positions, torch.Tensor) or anchor_positions.dim() != 2:
        raise ValueError(
            f"anchor_positions must be a tensor of shape [batch, blocks], got {_describe(anchor_positions)}."
        )
    if not _is_integer_dtype(anchor_positions.dtype):
        raise ValueError(
            f"anchor_positions must be an integer tensor, got dtype {anchor_positions.dtype}; use .long()."
        )


def _resolve_input_mask(input_mask, seq_length, batch: int, device) -> tuple[torch.Tensor, int]:
    """``(input_mask [B, S] bool, S)``: the given mask checked against ``seq_length`` and the anchors' batch
    and device, or all True over ``seq_length`` tokens when None."""
    if input_mask is None:
        if seq_length is None:
            raise ValueError("from_anchors needs the sequence length: pass seq_length=S or input_mask=[B, S].")
        seq_length = _check_int("seq_length", seq_length, minimum=1)
        return torch.ones(batch, seq_length, dtype=torch.bool, device=device), seq_length
    input_mask = _check_input_mask(input_mask)
    if input_mask.shape[0] != batch:
        raise ValueError(
            f"input_mask has batch {input_mask.shape[0]} but anchor_positions has batch {batch}; "
            f"they must match."
        )
    if seq_length is not None and _check_int("seq_length", seq_length) != input_mask.shape[1]:
        raise ValueError(f"seq_length={seq_length} disagrees with input_mask.shape[1]={input_mask.shape[1]}.")
    _check_device("input_mask", input_mask, "anchor_positions", device)
    return input_mask, input_mask.shape[1]


def _resolve_block_valid(block_valid, batch: int, num_blocks: int, device) -> torch.Tensor:
    """``block_valid [B, N]`` bool, checked, or all True when None."""
    if block_valid is None:
        return torch.ones(batch, num_blocks, dtype=torch.bool, device=device)
    if not isinstance(block_valid, torch.Tensor) or tuple(block_valid.shape) != (batch, num_blocks):
        raise ValueError(
            f"block_valid must have the shape of anchor_positions, {(batch, num_blocks)}, "
            f"got {_describe(block_valid)}."
        )
    if block_valid.dtype != torch.bool:
        raise ValueError(f"block_valid must be a bool tensor, got dtype {block_valid.dtype}; use .bool().")
    _check_device("block_valid", block_valid, "anchor_positions", device)
    return block_valid


def _check_blocks_fit(anchors: torch.Tensor, block_valid: torch.Tensor, block_size: int, seq_length: int) -> None:
    """Every valid block ``anchors [B, N] .. + W - 1`` lies in ``[0, S)``."""
    # compared without adding to the anchor: an anchor near the int64 maximum would wrap around
    out_of_range = block_valid & ((anchors < 0) | (anchors > seq_length - block_size))
    if bool(out_of_range.any()):
        row, blk = (int(v) for v in out_of_range.nonzero()[0])
        raise ValueError(
            f"block {blk} of row {row} with anchor {int(anchors[row, blk])} and block_size {block_size} "
            f"does not fit in a sequence of length {seq_length} (need 0 <= anchor <= {seq_length - block_size}); "
            f"choose another anchor or mark the block invalid with block_valid."
        )


def _check_blocks_in_documents(
    anchors: torch.Tensor, block_valid: torch.Tensor, block_size: int, document_ids: torch.Tensor,
    run_id: torch.Tensor,
) -> None:
    """Every valid block (``anchors [B, N]``, in range) lies in one run of ``run_id [B, S]`` and not in padding
    (``document_ids [B, S]`` negative)."""
    seq_length = document_ids.shape[1]
    last = anchors + (block_size - 1)
    first_run = torch.gather(run_id, 1, anchors)
    last_run = torch.gather(run_id, 1, last.clamp(max=seq_length - 1))
    anchor_doc = torch.gather(document_ids, 1, anchors)
    crosses = block_valid & (first_run != last_run)
    in_padding = block_valid & (anchor_doc < 0)
    if bool(crosses.any()):
        row, blk = (int(v) for v in crosses.nonzero()[0])
        raise ValueError(
            f"block {blk} of row {row} (anchor {int(anchors[row, blk])}, block_size {block_size}) crosses a "
            f"document boundary; a block must lie inside one document. "
            f"Choose another anchor or mark it invalid."
        )
    if bool(in_padding.any()):
        row, blk = (int(v) for v in in_padding.nonzero()[0])
        raise ValueError(
            f"block {blk} of row {row} (anchor {int(anchors[row, blk])}) lies in padding "
            f"(negative document id); "
            f"choose another anchor or mark it invalid."
        )


# --------------------------------------------------------------------------------------------------
# The builder
# --------------------------------------------------------------------------------------------------


def build_dflash_batch_plan(
    input_mask: torch.Tensor,
    sample_ids: torch.Tensor,
    *,
    anchors_per_sample: int,
    block_size: int,
    optimizer_step: int,
    seed: int,
    document_ids: Optional[torch.Tensor] = None,
    lookahead: Optional[int] = None,
) -> DFlashBatchPlan:
    """Choose up to ``anchors_per_sample`` anchors per row, deterministically, and lay out the blocks.

    An anchor ``p`` is eligible when
      * it is supervised itself: ``input_mask[p]``. Decoding only ever anchors a block on a token the
        target has just produced, never on a prompt token, so the last prompt token (whose next token
        is supervised) is no anchor, while a supervised token is one even when its next token is not;
      * the block fits: ``p + block_size - 1 <= S - 1``;
      * the block supervises at least one slot: ``input_mask[p + k]`` for some ``1 <= k <= lookahead``
        (a block with nothing to learn would only cost compute and take an anchor from another); ``lookahead``
        is ``block_size - 1`` by default, 1 for a variant whose supervision stops at the block's first
        unsupervised position (DSpark: nothing is learnt from a block whose ``x_{p+1}`` is unsupervised);
      * with ``document_ids``: ``p .. p + block_size - 1`` lie in one contiguous run of equal document id
        and that id is >= 0 (negative ids mark padding, never a document), i.e. at least
        ``block_size - 1`` further real tokens of its own document follow ``p``.
    Among the eligible positions of a row, ``min(N, #eligible)`` are drawn without replacement in the
    order given by an integer hash of ``(seed, optimizer_step, sample_id, p)``; see the module docstring.
    A row with no eligible anchor gets no valid block and an all-False loss mask.

    Args:
        input_mask: [B, S] bool, True where the token is supervised.
        sample_ids: [B] integer, a stable ID per row (unique per rollout row); converted to int64.
        anchors_per_sample: N >= 1, blocks per row.
        block_size: W = gamma + 1 >= 2.
        optimizer_step: the optimizer step (int >= 0); a new step draws new anchors.
        seed: run seed (any int in the 64-bit range).
        document_ids: [B, S] integer document id per token (negative = padding) for packed rows, or None.
        lookahead: how many positions after an anchor may hold the supervised token that makes its block worth
            drawing, 1 .. block_size - 1 (None: block_size - 1).

    Returns:
        A ``DFlashBatchPlan`` on the device of ``input_mask``, valid anchors of each row in ascending
        order followed by invalid blocks (anchor 0).
    """
    input_mask = _check_input_mask(input_mask)
    batch, seq_length = input_mask.shape
    device = input_mask.device
    sample_ids = _check_sample_ids(sample_ids, input_mask)
    num_blocks = _check_int("anchors_per_sample", anchors_per_sample, minimum=1)
    if num_blocks > MAX_BLOCKS_PER_ROW:
        raise ValueError(f"anchors_per_sample must be <= {MAX_BLOCKS_PER_ROW}, got {num_blocks}.")
    block_size = _check_block_size(block_size)
    _check_plan_size(batch, num_blocks, block_size)
    step_hash = seed_step_hash(*_check_seed_and_step(seed, optimizer_step))
    document_ids = _check_document_ids(document_ids, batch, seq_length, device)

    lookahead = block_size - 1 if lookahead is None else _check_int("lookahead", lookahead, minimum=1)
    if lookahead > block_size - 1:
        raise ValueError(f"lookahead={lookahead} must be at most block_size - 1 = {block_size - 1}.")
    run_start, run_id = _runs(document_ids, batch, seq_length, device)
    eligible = _eligible_anchors(input_mask, block_size, document_ids, run_id, lookahead)
    anchor_positions, block_valid = _draw_anchors(eligible, step_hash, sample_ids, num_blocks)

    return DFlashBatchPlan._with_derived_fields(anchor_positions, block_valid, input_mask, run_start, block_size)


def _check_sample_ids(sample_ids, input_mask: torch.Tensor) -> torch.Tensor:
    """``sample_ids [B]`` as int64, checked against ``input_mask [B, S]``."""
    batch = input_mask.shape[0]
    if not isinstance(sample_ids, torch.Tensor):
        raise ValueError(f"sample_ids must be a torch.Tensor of shape [batch], got {type(sample_ids).__name__}.")
    if tuple(sample_ids.shape) != (batch,):
        raise ValueError(
            f"sample_ids must have shape [batch] = ({batch},) to match input_mask {tuple(input_mask.shape)}, "
            f"got {tuple(sample_ids.shape)}; give every row exactly one sample ID."
        )
    if not _is_integer_dtype(sample_ids.dtype):
        raise ValueError(f"sample_ids must be an integer tensor, got dtype {sample_ids.dtype}; use .long().")
    _check_device("sample_ids", sample_ids, "input_mask", input_mask.device)
    return sample_ids.to(torch.int64)


def _check_seed_and_step(seed, optimizer_step) -> tuple[int, int]:
    """``(seed, optimizer_step)`` checked: the seed fits in 64 bits, the step is in ``[0, 2**64)``."""
    optimizer_step = _check_int("optimizer_step", optimizer_step, minimum=0)
    if optimizer_step >= 1 << 64:
        raise ValueError(f"optimizer_step must be < 2**64, got {optimizer_step}.")
    seed = _check_int("seed", seed)
    if not -(1 << 63) <= seed < (1 << 64):
        raise ValueError(f"seed must fit in 64 bits (-2**63 <= seed < 2**64), got {seed}.")
    return seed, optimizer_step


def _eligible_anchors(
    input_mask: torch.Tensor, block_size: int, document_ids: Optional[torch.Tensor], run_id: torch.Tensor,
    lookahead: int,
) -> torch.Tensor:
    """``[B, S]`` bool: the positions that may anchor a block (the rule of `build_dflash_batch_plan`).

    ``input_mask [B, S]`` bool; ``document_ids [B, S]`` or None; ``run_id [B, S]`` the run index of `_runs`;
    ``lookahead``: a supervised position among ``p + 1 .. p + lookahead`` makes the block worth drawing.
    """
    batch, seq_length = input_mask.shape
    positions = torch.arange(seq_length, dtype=torch.int64, device=input_mask.device)  # [S]
    fits = positions <= seq_length - block_size  # [S]; the block p .. p + W - 1 is in range when this holds
    # Supervised positions p + 1 .. p + lookahead, from a prefix count: C[p + lookahead] - C[p] with C the
    # inclusive cumulative sum of input_mask (clamped reads only where ``fits`` is False anyway).
    counts = input_mask.to(torch.int64).cumsum(dim=1)  # [B, S]
    ahead = (positions + lookahead).clamp(max=seq_length - 1)  # [S]
    supervised_ahead = torch.gather(counts, 1, ahead[None, :].expand(batch, seq_length)) - counts
    last = (positions + (block_size - 1)).clamp(max=seq_length - 1)  # [S]
    eligible = input_mask & fits[None, :] & (supervised_ahead > 0)
    if document_ids is not None:
        same_run = torch.gather(run_id, 1, last[None, :].expand(batch, seq_length)) == run_id
        eligible = eligible & same_run & (document_ids >= 0)
    return eligible


def _draw_anchors(
    eligible: torch.Tensor, step_hash: int, sample_ids: torch.Tensor, num_blocks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(anchor_positions [B, N] int64, block_valid [B, N] bool)``: the ``min(N, #eligible)`` eligible
    positions (``eligible [B, S]``) of each row with the smallest hash rank, ascending, then invalid blocks
    (anchor 0). No host sync."""
    batch, seq_length = eligible.shape
    device = eligible.device
    positions = torch.arange(seq_length, dtype=torch.int64, device=device)  # [S]
    hashes = _position_hashes(step_hash, sample_ids, seq_length)  # [B, S] < 2**32
    keys = (hashes << 31) | positions[None, :]  # < 2**63, unique per row
    keys = torch.where(eligible, keys, torch.full((), -1, dtype=torch.int64, device=device))
    k = min(num_blocks, seq_length)
    top = keys.topk(k, dim=1, sorted=False).values  # [B, k]; only values are used, they encode p
    chosen_valid = top >= 0
    # Invalid picks sort after every valid anchor (sentinel S); positions are unique so no ties matter.
    sentinel = torch.full((), seq_length, dtype=torch.int64, device=device)
    order_key = torch.where(chosen_valid, top & _MAX_SEQ_LENGTH, sentinel)
    if k < num_blocks:  # more blocks than positions: pad with invalid blocks
        pad = torch.full((batch, num_blocks - k), seq_length, dtype=torch.int64, device=device)
        order_key = torch.cat([order_key, pad], dim=1)
    order_key = order_key.sort(dim=1).values  # [B, N]
    block_valid = order_key < seq_length
    anchor_positions = torch.where(block_valid, order_key, torch.zeros((), dtype=torch.int64, device=device))
    return anchor_positions, block_valid
