"""Tests for the DFlash batch plan: determinism, row independence, eligibility, derived fields.

Oracles here are deliberately naive Python loops over tokens, written independently of the vectorised
builder, so a bug in the builder's tensor logic cannot hide in a shared helper.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_dflash.common import hashing
from megatron_dflash.plan import batch_plan as plan_module
from megatron_dflash.plan.batch_plan import DFlashBatchPlan, build_dflash_batch_plan

FIELDS = ("anchor_positions", "block_valid", "context_start", "position_ids", "context_position_ids", "loss_mask")
ROW_FIELDS = FIELDS  # every tensor field is indexed by row first
HYP = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------------------------------
# Inputs and naive oracles
# --------------------------------------------------------------------------------------------------


@dataclass
class Inputs:
    mask: list  # [B][S] bool
    sample_ids: list  # [B] int
    docs: Optional[list]  # [B][S] int or None
    anchors_per_sample: int
    block_size: int
    step: int
    seed: int

    @property
    def batch(self) -> int:
        return len(self.mask)

    @property
    def seq_length(self) -> int:
        return len(self.mask[0])

    def tensors(self, device="cpu"):
        mask = torch.tensor(self.mask, dtype=torch.bool, device=device)
        sids = torch.tensor(self.sample_ids, dtype=torch.int64, device=device)
        docs = None if self.docs is None else torch.tensor(self.docs, dtype=torch.int64, device=device)
        return mask, sids, docs

    def build(self, device="cpu", **overrides) -> DFlashBatchPlan:
        mask, sids, docs = self.tensors(device)
        kwargs = dict(
            anchors_per_sample=self.anchors_per_sample,
            block_size=self.block_size,
            optimizer_step=self.step,
            seed=self.seed,
            document_ids=docs,
        )
        kwargs.update(overrides)
        return build_dflash_batch_plan(mask, sids, **kwargs)


@st.composite
def plan_inputs(draw, max_batch=5, max_len=40, docs=None, sample_id_range=(-(2**63), 2**63 - 1)):
    batch = draw(st.integers(1, max_batch))
    seq_length = draw(st.integers(1, max_len))
    block_size = draw(st.integers(2, 6))
    anchors = draw(st.integers(1, 12))
    mask = []
    for _ in range(batch):
        kind = draw(st.sampled_from(["all", "none", "random", "response"]))
        if kind == "all":
            mask.append([True] * seq_length)
        elif kind == "none":
            mask.append([False] * seq_length)
        elif kind == "response":  # prompt unsupervised, then a response, then padding
            a = draw(st.integers(0, seq_length))
            b = draw(st.integers(a, seq_length))
            mask.append([a <= t < b for t in range(seq_length)])
        else:
            mask.append(draw(st.lists(st.booleans(), min_size=seq_length, max_size=seq_length)))
    use_docs = draw(st.booleans()) if docs is None else docs
    doc_rows = None
    if use_docs:
        doc_rows = []
        for _ in range(batch):
            starts = draw(st.lists(st.integers(0, 4), min_size=seq_length, max_size=seq_length))
            ids = draw(st.lists(st.integers(-2, 3), min_size=seq_length, max_size=seq_length))
            row, current = [], ids[0]
            for t in range(seq_length):
                if t > 0 and starts[t] == 0:  # a new run starts with probability ~1/5
                    current = ids[t]
                row.append(current)
            doc_rows.append(row)
    lo, hi = sample_id_range
    sample_ids = draw(
        st.lists(st.one_of(st.integers(0, 3), st.integers(lo, hi)), min_size=batch, max_size=batch)
    )
    step = draw(st.integers(0, 2**40))
    seed = draw(st.integers(-(2**63), 2**64 - 1))
    return Inputs(mask, sample_ids, doc_rows, anchors, block_size, step, seed)


def naive_run_start(doc_row: Optional[list], seq_length: int) -> list:
    if doc_row is None:
        return [0] * seq_length
    out, start = [], 0
    for t in range(seq_length):
        if t > 0 and doc_row[t] != doc_row[t - 1]:
            start = t
        out.append(start)
    return out


def naive_eligible(mask_row: list, doc_row: Optional[list], block_size: int) -> list:
    seq_length = len(mask_row)
    out = []
    for p in range(seq_length):
        if p + block_size - 1 > seq_length - 1:
            continue
        if not mask_row[p] or not any(mask_row[p + k] for k in range(1, block_size)):
            continue
        if doc_row is not None:
            if doc_row[p] < 0 or any(doc_row[q] != doc_row[p] for q in range(p, p + block_size)):
                continue
        out.append(p)
    return out


def valid_anchors(plan: DFlashBatchPlan, row: int) -> list:
    return [int(a) for a, v in zip(plan.anchor_positions[row], plan.block_valid[row]) if bool(v)]


def assert_plans_equal(a: DFlashBatchPlan, b: DFlashBatchPlan) -> None:
    assert a.block_size == b.block_size
    for name in FIELDS:
        x, y = getattr(a, name).cpu(), getattr(b, name).cpu()
        assert x.dtype == y.dtype, name
        assert torch.equal(x, y), f"{name} differs:\n{x}\n{y}"


def assert_rows_equal(a: DFlashBatchPlan, rows_a, b: DFlashBatchPlan, rows_b) -> None:
    for name in ROW_FIELDS:
        x, y = getattr(a, name)[list(rows_a)], getattr(b, name)[list(rows_b)]
        assert torch.equal(x, y), f"{name} differs"


# --------------------------------------------------------------------------------------------------
# Determinism
# --------------------------------------------------------------------------------------------------


@settings(max_examples=60, **HYP)
@given(plan_inputs())
def test_identical_inputs_give_identical_plans(inputs):
    assert_plans_equal(inputs.build(), inputs.build())


@settings(max_examples=60, **HYP)
@given(plan_inputs(sample_id_range=(-(2**31), 2**31 - 1)), st.data())
def test_plan_independent_of_layout_and_integer_width(inputs, data):
    """Non-contiguous / transposed / strided inputs and int32 IDs give the same plan as plain int64."""
    reference = inputs.build()
    mask, sids, docs = inputs.tensors()
    # Transposed storage: [S, B] contiguous viewed as [B, S].
    mask_t = mask.t().contiguous().t()
    assert not mask_t.is_contiguous() or inputs.batch == 1 or inputs.seq_length == 1
    # Strided: every other element of a wider buffer.
    sids_wide = torch.zeros(2 * inputs.batch, dtype=torch.int32)
    sids_wide[::2] = sids.to(torch.int32)
    sids_strided = sids_wide[::2]
    docs_strided = None
    if docs is not None:
        wide = torch.full((inputs.batch, 3 * inputs.seq_length), 99, dtype=torch.int32)
        wide[:, ::3] = docs.to(torch.int32)
        docs_strided = wide[:, ::3]
        if data.draw(st.booleans()):
            docs_strided = docs.to(torch.int16)
    plan = build_dflash_batch_plan(
        mask_t,
        sids_strided,
        anchors_per_sample=inputs.anchors_per_sample,
        block_size=inputs.block_size,
        optimizer_step=inputs.step,
        seed=inputs.seed,
        document_ids=docs_strided,
    )
    assert_plans_equal(reference, plan)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@settings(max_examples=40, **HYP)
@given(plan_inputs())
def test_cpu_and_cuda_plans_identical(inputs):
    cpu = inputs.build("cpu")
    cuda = inputs.build("cuda")
    assert cuda.anchor_positions.device.type == "cuda"
    assert_plans_equal(cpu, cuda)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_and_cuda_plans_identical_large():
    """Large rows exercise the CUDA topk / sort kernels beyond their small-size paths."""
    gen = torch.Generator().manual_seed(0)
    mask = torch.rand(8, 4096, generator=gen) < 0.7
    docs = (torch.rand(8, 4096, generator=gen) < 0.002).long().cumsum(1)
    docs[:, -100:] = -1
    sids = torch.randint(-(2**62), 2**62, (8,), generator=gen)
    kwargs = dict(anchors_per_sample=512, block_size=16, optimizer_step=12345, seed=7)
    cpu = build_dflash_batch_plan(mask, sids, document_ids=docs, **kwargs)
    cuda = build_dflash_batch_plan(mask.cuda(), sids.cuda(), document_ids=docs.cuda(), **kwargs)
    assert_plans_equal(cpu, cuda)


def test_hash_has_no_int64_overflow():
    """The tensor hash equals the same code on unbounded Python ints, so no int64 product overflowed."""
    rng = random.Random(0)
    values = [0, 1, 2**31 - 1, 2**31, 2**32 - 1] + [rng.getrandbits(32) for _ in range(2000)]
    tensor = hashing.mix32(torch.tensor(values, dtype=torch.int64))
    assert tensor.tolist() == [hashing.mix32(v) for v in values]
    assert all(0 <= v < 2**32 for v in tensor.tolist())
    # _mul32 really is multiplication modulo 2**32, also for constants >= 2**31 applied by negation.
    for c in (0x7FEB352D, 0x846CA68B, 2**32 - 1, 3):
        got = hashing._mul32(torch.tensor(values, dtype=torch.int64), c).tolist()
        assert got == [(v * c) % 2**32 for v in values]


def test_plan_is_pinned():
    """Golden values: resumed runs and other ranks rely on the hash never changing silently."""
    mask = torch.ones(2, 48, dtype=torch.bool)
    mask[1, :10] = False
    docs = torch.tensor([[0] * 20 + [1] * 20 + [-1] * 8, [5] * 48])
    plan = build_dflash_batch_plan(
        mask, torch.tensor([17, -(2**40)]), anchors_per_sample=5, block_size=4, optimizer_step=3, seed=1234,
        document_ids=docs,
    )
    assert plan.anchor_positions.tolist() == [[0, 2, 24, 29, 34], [13, 21, 23, 28, 40]]


# --------------------------------------------------------------------------------------------------
# Row independence and sample IDs
# --------------------------------------------------------------------------------------------------


@settings(max_examples=50, **HYP)
@given(plan_inputs(), st.data())
def test_row_plan_depends_only_on_that_row(inputs, data):
    full = inputs.build()
    mask, sids, docs = inputs.tensors()
    batch = inputs.batch
    kwargs = dict(
        anchors_per_sample=inputs.anchors_per_sample, block_size=inputs.block_size,
        optimizer_step=inputs.step, seed=inputs.seed,
    )

    def sub(index):
        return build_dflash_batch_plan(
            mask[index], sids[index], document_ids=None if docs is None else docs[index], **kwargs
        )

    # Permuted rows.
    perm = data.draw(st.permutations(list(range(batch))))
    assert_rows_equal(sub(torch.tensor(perm)), range(batch), full, perm)
    # A slice of the batch.
    start = data.draw(st.integers(0, batch - 1))
    stop = data.draw(st.integers(start + 1, batch))
    assert_rows_equal(sub(slice(start, stop)), range(stop - start), full, range(start, stop))
    # Appended rows (other masks, other IDs) leave the original rows alone.
    extra = data.draw(st.integers(1, 3))
    bigger_mask = torch.cat([mask, torch.flip(mask[:1], dims=[1]).expand(extra, -1)])
    bigger_sids = torch.cat([sids, torch.arange(extra) + 1000])
    bigger_docs = None if docs is None else torch.cat([docs, docs[:1].expand(extra, -1)])
    bigger = build_dflash_batch_plan(bigger_mask, bigger_sids, document_ids=bigger_docs, **kwargs)
    assert_rows_equal(bigger, range(batch), full, range(batch))


@settings(max_examples=40, **HYP)
@given(plan_inputs(), st.integers(-(2**63), 2**63 - 1), st.data())
def test_rows_with_same_sample_id_get_same_anchors(inputs, sample_id, data):
    """Copies of a row with the same sample ID, anywhere in the batch, get the same plan row."""
    mask, sids, docs = inputs.tensors()
    row = data.draw(st.integers(0, inputs.batch - 1))
    copies = data.draw(st.integers(1, 3))
    sids = sids.clone()
    sids[row] = sample_id
    mask2 = torch.cat([mask, mask[row : row + 1].expand(copies, -1)])
    sids2 = torch.cat([sids, torch.full((copies,), sample_id)])
    docs2 = None if docs is None else torch.cat([docs, docs[row : row + 1].expand(copies, -1)])
    plan = build_dflash_batch_plan(
        mask2, sids2, anchors_per_sample=inputs.anchors_per_sample, block_size=inputs.block_size,
        optimizer_step=inputs.step, seed=inputs.seed, document_ids=docs2,
    )
    for c in range(copies):
        assert_rows_equal(plan, [row], plan, [inputs.batch + c])


def _long_rows(batch=4, seq_length=64):
    return torch.ones(batch, seq_length, dtype=torch.bool)


@settings(max_examples=60, **HYP)
@given(
    st.integers(0, 2**62), st.integers(0, 2**62), st.integers(-(2**63), 2**64 - 1), st.integers(-(2**63), 2**64 - 1),
    st.integers(-(2**63), 2**63 - 1),
)
def test_step_and_seed_change_anchors(step_a, step_b, seed_a, seed_b, sample_id):
    """61 eligible windows, 8 anchors: C(61, 8) ~ 3e9 sets, so a repeat is (almost surely) a hashing bug."""
    mask = _long_rows(1)
    sids = torch.tensor([sample_id])
    kw = dict(anchors_per_sample=8, block_size=4)

    def anchors(step, seed):
        return build_dflash_batch_plan(mask, sids, optimizer_step=step, seed=seed, **kw).anchor_positions

    base = anchors(step_a, seed_a)
    if step_a != step_b:
        assert not torch.equal(base, anchors(step_b, seed_a))
    if seed_a != seed_b:
        assert not torch.equal(base, anchors(step_a, seed_b))
    # Neighbouring values, the most likely to collide in a weak mix.
    assert not torch.equal(base, anchors(step_a + 1, seed_a))
    assert not torch.equal(base, anchors(step_a, seed_a ^ 1))


def test_both_halves_of_sample_id_matter():
    mask = _long_rows(6)
    sids = torch.tensor([0, 1, 2**32, 2**33, -(2**63), -(2**63) + 2**32])
    plan = build_dflash_batch_plan(mask, sids, anchors_per_sample=8, block_size=4, optimizer_step=0, seed=0)
    rows = {tuple(r) for r in plan.anchor_positions.tolist()}
    assert len(rows) == 6, "sample IDs differing only in their high 32 bits must give different anchors"


def test_steps_and_seeds_of_64_bits_are_folded_in():
    mask = _long_rows(1)
    sids = torch.tensor([5])
    kw = dict(anchors_per_sample=8, block_size=4)
    seen = set()
    for step, seed in [(0, 0), (2**32, 0), (0, 2**32), (0, -1), (0, 2**64 - 1 - 2**32), (2**63, 0)]:
        plan = build_dflash_batch_plan(mask, sids, optimizer_step=step, seed=seed, **kw)
        seen.add(tuple(plan.anchor_positions[0].tolist()))
    # seed -1 and 2**64 - 1 are the same 64-bit value by design; everything else must differ.
    assert len(seen) == 6


# --------------------------------------------------------------------------------------------------
# Structure of the chosen blocks
# --------------------------------------------------------------------------------------------------


@settings(max_examples=80, **HYP)
@given(plan_inputs())
def test_anchors_unique_sorted_and_invalid_blocks_last(inputs):
    plan = inputs.build()
    assert plan.anchor_positions.dtype == torch.int64 and plan.block_valid.dtype == torch.bool
    assert plan.anchor_positions.shape == (inputs.batch, inputs.anchors_per_sample)
    for r in range(inputs.batch):
        valid = plan.block_valid[r].tolist()
        anchors = plan.anchor_positions[r].tolist()
        n_valid = sum(valid)
        assert valid == [True] * n_valid + [False] * (len(valid) - n_valid), "valid blocks must come first"
        chosen = anchors[:n_valid]
        assert chosen == sorted(set(chosen)), "valid anchors must be unique and ascending"
        assert all(a == 0 for a in anchors[n_valid:]), "invalid blocks have anchor 0"


@settings(max_examples=80, **HYP)
@given(plan_inputs(docs=True))
def test_valid_blocks_inside_sequence_and_document(inputs):
    plan = inputs.build()
    seq_length, width = inputs.seq_length, inputs.block_size
    for r in range(inputs.batch):
        doc = inputs.docs[r]
        for a in valid_anchors(plan, r):
            assert 0 <= a and a + width - 1 <= seq_length - 1
            assert doc[a] >= 0, "a block never starts in padding"
            assert all(doc[q] == doc[a] for q in range(a, a + width)), "a block lies inside one document"
            assert inputs.mask[r][a], "the anchor is a supervised token"
            assert any(inputs.mask[r][a + k] for k in range(1, width)), "the block supervises a slot"


@settings(max_examples=80, **HYP)
@given(plan_inputs())
def test_number_of_valid_blocks_matches_naive_oracle(inputs):
    plan = inputs.build()
    for r in range(inputs.batch):
        eligible = naive_eligible(inputs.mask[r], None if inputs.docs is None else inputs.docs[r], inputs.block_size)
        chosen = valid_anchors(plan, r)
        assert len(chosen) == min(inputs.anchors_per_sample, len(eligible))
        assert set(chosen) <= set(eligible)


@pytest.mark.parametrize(
    "mask_row, doc_row, block_size",
    [
        ([False] * 12, None, 3),  # nothing supervised
        ([True] * 3, None, 4),  # sequence shorter than a block
        ([True] * 12, [-1] * 12, 3),  # all padding
        ([True] * 12, [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5], 3),  # every document shorter than a block
        ([True] + [False] * 11, None, 2),  # only position 0 supervised: its block supervises nothing
        ([False] * 5 + [True] * 7, None, 13),  # the block would start at the last prompt token
        ([False, True] * 6, None, 2),  # every supervised token is followed by an unsupervised one
        ([True] * 1, None, 2),  # a single token
    ],
)
def test_row_without_valid_window_gets_no_block_and_no_loss(mask_row, doc_row, block_size):
    assert naive_eligible(mask_row, doc_row, block_size) == []
    mask = torch.tensor([mask_row, [True] * len(mask_row)])
    docs = None if doc_row is None else torch.tensor([doc_row, [0] * len(mask_row)])
    plan = build_dflash_batch_plan(
        mask, torch.tensor([3, 4]), anchors_per_sample=4, block_size=block_size, optimizer_step=1, seed=2,
        document_ids=docs,
    )
    assert not plan.block_valid[0].any()
    assert not plan.loss_mask[0].any()
    assert plan.anchor_positions[0].eq(0).all()
    assert plan.token_indices.max() < len(mask_row), "token_indices stay gatherable for invalid blocks"


def test_anchor_is_a_supervised_token_whose_block_supervises_something():
    """The anchor rule: a supervised position (never the last prompt token, which decoding never
    anchors on), with a full block ahead, whose block supervises at least one slot."""
    F, T = False, True
    mask_row = [F, F, F, T, T, T, F, F, F, F, T, F, T, F, F, F]
    # 2: last prompt token (unsupervised); 5, 12: supervised but nothing supervised in their blocks;
    # 9: unsupervised; 10: supervised, slot 1 not but slot 2 is -> an anchor.
    expected = [3, 4, 10]
    assert naive_eligible(mask_row, None, 3) == expected
    plan = build_dflash_batch_plan(
        torch.tensor([mask_row]), torch.tensor([0]), anchors_per_sample=8, block_size=3, optimizer_step=0, seed=0,
    )
    assert valid_anchors(plan, 0) == expected
    assert plan.loss_mask[plan.block_valid].any(dim=-1).all(), "every valid block supervises a slot"
    assert all(mask_row[p] for p in valid_anchors(plan, 0))
    # Packed: the same rule inside each document, whose blocks must fit in it.
    docs = [0] * 8 + [1] * 8
    assert naive_eligible(mask_row, docs, 3) == [3, 4, 10]
    packed = build_dflash_batch_plan(
        torch.tensor([mask_row]), torch.tensor([0]), anchors_per_sample=8, block_size=3, optimizer_step=0, seed=0,
        document_ids=torch.tensor([docs]),
    )
    assert valid_anchors(packed, 0) == [3, 4, 10]
    docs = [0] * 5 + [1] * 11  # document 0 ends at 4: the blocks at 3 and 4 would cross it
    packed = build_dflash_batch_plan(
        torch.tensor([mask_row]), torch.tensor([0]), anchors_per_sample=8, block_size=3, optimizer_step=0, seed=0,
        document_ids=torch.tensor([docs]),
    )
    assert valid_anchors(packed, 0) == naive_eligible(mask_row, docs, 3) == [10]


def test_lookahead_one_is_dsparks_anchor_rule():
    """`lookahead=1` (DSpark's rule, `Variant.anchor_lookahead`): a supervised anchor whose next token is
    supervised, i.e. NeMo AutoModel's DSpark anchor candidates (`build_anchor_candidate_mask`: ``loss_mask[p]``
    and ``loss_mask[p + 1]``) among the blocks that fit; every drawn block then trains DSpark's first slot,
    while the default rule draws blocks whose shifted, cut supervision is empty."""
    from megatron_dflash.objectives.dspark_loss import dspark_slot_targets
    from megatron_dflash.variants.registry import get_variant

    assert get_variant("dspark").anchor_lookahead == 1 and get_variant("dflash").anchor_lookahead is None
    F, T = False, True
    mask_row = [F, F, F, T, T, T, F, F, F, F, T, F, T, T, F, F]
    W, S = 3, len(mask_row)
    mask = torch.tensor([mask_row])
    ids = torch.arange(S)[None]
    plans = {lookahead: build_dflash_batch_plan(mask, torch.tensor([0]), anchors_per_sample=S, block_size=W,
                                                optimizer_step=0, seed=0, lookahead=lookahead)
             for lookahead in (None, 1)}
    assert valid_anchors(plans[1], 0) == [3, 4, 12]  # 10: its next token (11) is not supervised
    assert valid_anchors(plans[None], 0) == [3, 4, 10, 12]
    for lookahead, plan in plans.items():
        supervised = dspark_slot_targets(ids, plan, input_mask=mask).supervised
        wasted = [int(a) for a, v, s in zip(plan.anchor_positions[0], plan.block_valid[0], supervised[0])
                  if v and not s.any()]
        assert wasted == ([] if lookahead == 1 else [10])
    nemo = pytest.importorskip("nemo_automodel.components.speculative.dspark.common")
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        masks = torch.rand(4, 30, generator=gen) < 0.6
        candidates = nemo.build_anchor_candidate_mask(seq_len=30, loss_mask=masks.long())  # [B, S - 1]
        plan = build_dflash_batch_plan(masks, torch.arange(4), anchors_per_sample=30, block_size=5,
                                       optimizer_step=0, seed=0, lookahead=1)
        for row in range(4):
            expected = [p for p in range(30 - 5 + 1) if bool(candidates[row, p])]  # ours: the block fits
            assert valid_anchors(plan, row) == expected


def test_lookahead_is_checked():
    with pytest.raises(ValueError, match="lookahead=4 must be at most block_size - 1 = 3"):
        build_dflash_batch_plan(torch.ones(1, 8, dtype=torch.bool), torch.tensor([0]), anchors_per_sample=2,
                                block_size=4, optimizer_step=0, seed=0, lookahead=4)


def test_more_blocks_than_positions_pads_with_invalid_blocks():
    mask = torch.ones(2, 5, dtype=torch.bool)
    plan = build_dflash_batch_plan(mask, torch.tensor([0, 1]), anchors_per_sample=9, block_size=2,
                                   optimizer_step=0, seed=0)
    assert plan.anchor_positions.shape == (2, 9)
    assert plan.block_valid.sum(1).tolist() == [4, 4]
    assert plan.anchor_positions[:, :4].tolist() == [[0, 1, 2, 3]] * 2


def test_empty_batch():
    plan = build_dflash_batch_plan(torch.ones(0, 7, dtype=torch.bool), torch.zeros(0, dtype=torch.int64),
                                   anchors_per_sample=3, block_size=2, optimizer_step=0, seed=0)
    assert plan.anchor_positions.shape == (0, 3) and plan.loss_mask.shape == (0, 3, 2)


# --------------------------------------------------------------------------------------------------
# Derived fields against naive reconstructions
# --------------------------------------------------------------------------------------------------


def naive_loss_mask(anchors, valid, mask_row, block_size):
    out = []
    for a, v in zip(anchors, valid):
        out.append([bool(v) and k >= 1 and bool(mask_row[a + k]) for k in range(block_size)])
    return out


@settings(max_examples=80, **HYP)
@given(plan_inputs())
def test_loss_mask_matches_naive_reconstruction(inputs):
    plan = inputs.build()
    assert plan.loss_mask.dtype == torch.bool
    assert not plan.loss_mask[:, :, 0].any(), "slot 0 is never supervised"
    assert not (plan.loss_mask & ~plan.block_valid[:, :, None]).any(), "invalid blocks are never supervised"
    for r in range(inputs.batch):
        anchors = plan.anchor_positions[r].tolist()
        valid = plan.block_valid[r].tolist()
        expected = naive_loss_mask(anchors, valid, inputs.mask[r], inputs.block_size)
        assert plan.loss_mask[r].tolist() == expected


@settings(max_examples=80, **HYP)
@given(plan_inputs())
def test_position_ids_match_naive_per_document_positions(inputs):
    plan = inputs.build()
    seq_length, width = inputs.seq_length, inputs.block_size
    for r in range(inputs.batch):
        starts = naive_run_start(None if inputs.docs is None else inputs.docs[r], seq_length)
        ctx = [t - starts[t] for t in range(seq_length)]
        assert plan.context_position_ids[r].tolist() == ctx
        if inputs.docs is None:
            assert ctx == list(range(seq_length))
        for b in range(inputs.anchors_per_sample):
            a = int(plan.anchor_positions[r, b])
            assert plan.position_ids[r, b].tolist() == [ctx[a] + k for k in range(width)]
            assert int(plan.context_start[r, b]) == starts[a]
            if bool(plan.block_valid[r, b]):
                assert plan.token_indices[r, b].tolist() == list(range(a, a + width))


# --------------------------------------------------------------------------------------------------
# Distribution
# --------------------------------------------------------------------------------------------------


def _chi_square(counts, expected):
    return sum((c - expected) ** 2 / expected for c in counts)


def _chi_square_bound(dof):
    # Mean dof, standard deviation sqrt(2 dof); 6 sigma keeps the test stable yet catches real bias.
    return dof + 6 * math.sqrt(2 * dof)


def test_anchors_spread_uniformly_over_sample_ids_and_seeds():
    seq_length, width, n = 64, 4, 8
    eligible = seq_length - width + 1  # 61
    mask = torch.ones(4000, seq_length, dtype=torch.bool)
    # Over many sample IDs in one batch (consecutive IDs: the case a weak mix gets wrong).
    plan = build_dflash_batch_plan(mask, torch.arange(4000), anchors_per_sample=n, block_size=width,
                                   optimizer_step=0, seed=0)
    counts = torch.bincount(plan.anchor_positions.flatten(), minlength=seq_length).tolist()
    assert all(c == 0 for c in counts[eligible:])
    assert all(c > 0 for c in counts[:eligible]), "every eligible position gets chosen"
    assert _chi_square(counts[:eligible], 4000 * n / eligible) < _chi_square_bound(eligible - 1)
    # Over many seeds and steps for one sample ID.
    counts = [0] * seq_length
    one = torch.ones(1, seq_length, dtype=torch.bool)
    for i in range(600):
        p = build_dflash_batch_plan(one, torch.tensor([42]), anchors_per_sample=n, block_size=width,
                                    optimizer_step=i // 3, seed=i % 3)
        for a in p.anchor_positions[0].tolist():
            counts[a] += 1
    assert all(c > 0 for c in counts[:eligible])
    assert _chi_square(counts[:eligible], 600 * n / eligible) < _chi_square_bound(eligible - 1)


def test_anchors_spread_uniformly_over_irregular_eligible_set():
    gen = torch.Generator().manual_seed(1)
    seq_length, width, n, batch = 80, 3, 6, 3000
    mask_row = torch.rand(seq_length, generator=gen) < 0.6
    doc_row = (torch.rand(seq_length, generator=gen) < 0.1).long().cumsum(0)
    doc_row[-7:] = -1
    eligible = naive_eligible(mask_row.tolist(), doc_row.tolist(), width)
    assert len(eligible) > 2 * n
    plan = build_dflash_batch_plan(mask_row.expand(batch, -1), torch.arange(batch) * 7919,
                                   anchors_per_sample=n, block_size=width, optimizer_step=5, seed=11,
                                   document_ids=doc_row.expand(batch, -1))
    chosen = plan.anchor_positions[plan.block_valid]
    counts = torch.bincount(chosen, minlength=seq_length).tolist()
    assert {p for p, c in enumerate(counts) if c > 0} == set(eligible)
    expected = batch * n / len(eligible)
    assert _chi_square([counts[p] for p in eligible], expected) < _chi_square_bound(len(eligible) - 1)


def test_draws_of_neighbouring_ids_and_steps_are_uncorrelated():
    """Mean overlap of two independent N-subsets of E positions is N*N/E; correlation would inflate it."""
    seq_length, width, n, batch = 64, 4, 8, 3000
    eligible = seq_length - width + 1
    mask = torch.ones(batch + 1, seq_length, dtype=torch.bool)
    kw = dict(anchors_per_sample=n, block_size=width, seed=3)
    a = build_dflash_batch_plan(mask, torch.arange(batch + 1), optimizer_step=9, **kw).anchor_positions
    b = build_dflash_batch_plan(mask, torch.arange(batch + 1), optimizer_step=10, **kw).anchor_positions

    def mean_overlap(x, y):
        hits = (x[:, :, None] == y[:, None, :]).any(-1).sum(-1)
        return hits.double().mean().item()

    expected = n * n / eligible
    assert abs(mean_overlap(a[:-1], a[1:]) - expected) < 0.15, "neighbouring sample IDs correlate"
    assert abs(mean_overlap(a, b) - expected) < 0.15, "neighbouring steps correlate"


# --------------------------------------------------------------------------------------------------
# No host synchronisation
# --------------------------------------------------------------------------------------------------

# aten ops whose output shape or value has to come back to the host.
_SYNCING_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "item", "is_nonzero", "equal")


class _RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []
        self.bool_indexing = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        self.ops.append(name)
        indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else []
        if name.startswith("aten.index") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices
        ):
            self.bool_indexing = True
        return func(*args, **(kwargs or {}))


def _forbid(*_args, **_kwargs):
    raise AssertionError("the plan builder must not synchronise with the host")


@settings(max_examples=15, **HYP)
@given(plan_inputs())
def test_builder_does_not_sync_with_host(inputs):
    mask, sids, docs = inputs.tensors()
    kwargs = dict(anchors_per_sample=inputs.anchors_per_sample, block_size=inputs.block_size,
                  optimizer_step=inputs.step, seed=inputs.seed, document_ids=docs)
    patched = {
        "item": _forbid, "tolist": _forbid, "__bool__": _forbid, "__int__": _forbid, "__float__": _forbid,
        "numpy": _forbid, "nonzero": _forbid, "masked_select": _forbid,
    }
    with pytest.MonkeyPatch.context() as mp:
        for name, fn in patched.items():
            mp.setattr(torch.Tensor, name, fn)
        mp.setattr(torch, "nonzero", _forbid)
        mp.setattr(torch, "masked_select", _forbid)
        with _RecordOps() as recorder:
            plan = build_dflash_batch_plan(mask, sids, **kwargs)
    bad = [op for op in recorder.ops if any(s in op for s in _SYNCING_OPS)]
    assert not bad, f"host-syncing ops in the builder: {bad}"
    assert not recorder.bool_indexing, "boolean indexing changes shapes based on data"
    assert_plans_equal(plan, inputs.build())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_builder_does_not_sync_on_cuda():
    mask = (torch.rand(4, 512) < 0.8).cuda()
    docs = (torch.rand(4, 512) < 0.01).long().cumsum(1).cuda()
    sids = torch.arange(4).cuda()
    build_dflash_batch_plan(mask, sids, anchors_per_sample=16, block_size=8, optimizer_step=0, seed=0,
                            document_ids=docs)  # warm up lazy CUDA init outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        build_dflash_batch_plan(mask, sids, anchors_per_sample=16, block_size=8, optimizer_step=3, seed=1,
                                document_ids=docs)
    finally:
        torch.cuda.set_sync_debug_mode("default")


# --------------------------------------------------------------------------------------------------
# from_anchors, to(), properties
# --------------------------------------------------------------------------------------------------


@settings(max_examples=60, **HYP)
@given(plan_inputs())
def test_from_anchors_reproduces_builder_plan(inputs):
    plan = inputs.build()
    mask, _, docs = inputs.tensors()
    again = DFlashBatchPlan.from_anchors(
        plan.anchor_positions, block_size=inputs.block_size, block_valid=plan.block_valid,
        input_mask=mask, document_ids=docs,
    )
    assert_plans_equal(plan, again)


def test_from_anchors_defaults_and_normalisation():
    plan = DFlashBatchPlan.from_anchors(torch.tensor([[2, 5, 7]], dtype=torch.int32), block_size=3, seq_length=10,
                                        block_valid=torch.tensor([[True, False, True]]))
    assert plan.anchor_positions.tolist() == [[2, 0, 7]], "invalid anchors are normalised to 0"
    assert plan.anchor_positions.dtype == torch.int64
    assert plan.loss_mask.tolist() == [[[False, True, True], [False] * 3, [False, True, True]]]
    assert plan.context_start.tolist() == [[0, 0, 0]]
    assert plan.position_ids[0, 2].tolist() == [7, 8, 9]
    assert plan.context_position_ids.tolist() == [list(range(10))]
    assert (plan.batch_size, plan.num_blocks, plan.seq_length, plan.gamma) == (1, 3, 10, 2)
    assert plan.token_indices[0, 0].tolist() == [2, 3, 4]
    # Anchors need not satisfy the builder's "first predicted token supervised" rule.
    mask = torch.tensor([[True, False, False, True, True]])
    plan = DFlashBatchPlan.from_anchors(torch.tensor([[0, 2]]), block_size=3, input_mask=mask)
    assert plan.loss_mask.tolist() == [[[False, False, False], [False, True, True]]]


def test_from_anchors_with_documents():
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, -1]])
    plan = DFlashBatchPlan.from_anchors(torch.tensor([[0, 4]]), block_size=3, seq_length=8, document_ids=docs)
    assert plan.context_start.tolist() == [[0, 3]]
    assert plan.position_ids.tolist() == [[[0, 1, 2], [1, 2, 3]]]


@pytest.mark.parametrize(
    "anchors, docs, match",
    [
        ([[8]], None, "does not fit"),
        ([[-1]], None, "does not fit"),
        ([[1]], [[0, 0, 1, 1, 1, 1, 1, 1, 1, 1]], "crosses a document boundary"),
        ([[1]], [[0, 0, 0, 5, 5, 0, 0, 0, 0, 0]], "crosses a document boundary"),
        ([[7]], [[0] * 7 + [-1] * 3], "padding"),
    ],
)
def test_from_anchors_rejects_blocks_that_do_not_fit(anchors, docs, match):
    with pytest.raises(ValueError, match=match):
        DFlashBatchPlan.from_anchors(torch.tensor(anchors), block_size=3, seq_length=10,
                                     document_ids=None if docs is None else torch.tensor(docs))
    # Marked invalid, the same anchor is accepted.
    DFlashBatchPlan.from_anchors(torch.tensor(anchors), block_size=3, seq_length=10,
                                 block_valid=torch.zeros(1, 1, dtype=torch.bool),
                                 document_ids=None if docs is None else torch.tensor(docs))


def test_from_anchors_rejects_bad_arguments():
    a = torch.tensor([[0, 1]])
    with pytest.raises(ValueError, match="seq_length"):
        DFlashBatchPlan.from_anchors(a, block_size=3)
    with pytest.raises(ValueError, match="block_size"):
        DFlashBatchPlan.from_anchors(a, block_size=1, seq_length=5)
    with pytest.raises(ValueError, match="anchor_positions"):
        DFlashBatchPlan.from_anchors(torch.tensor([0, 1]), block_size=3, seq_length=5)
    with pytest.raises(ValueError, match="integer"):
        DFlashBatchPlan.from_anchors(a.float(), block_size=3, seq_length=5)
    with pytest.raises(ValueError, match="block_valid"):
        DFlashBatchPlan.from_anchors(a, block_size=3, seq_length=5, block_valid=torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="bool"):
        DFlashBatchPlan.from_anchors(a, block_size=3, seq_length=5, block_valid=torch.ones(1, 2))
    with pytest.raises(ValueError, match="disagrees"):
        DFlashBatchPlan.from_anchors(a, block_size=3, seq_length=6, input_mask=torch.ones(1, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="batch"):
        DFlashBatchPlan.from_anchors(a, block_size=3, input_mask=torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="document_ids"):
        DFlashBatchPlan.from_anchors(a, block_size=3, seq_length=5, document_ids=torch.zeros(1, 4, dtype=torch.long))


def test_plan_to_device_and_frozen():
    plan = build_dflash_batch_plan(torch.ones(2, 9, dtype=torch.bool), torch.tensor([1, 2]),
                                   anchors_per_sample=2, block_size=3, optimizer_step=0, seed=0)
    moved = plan.to("meta")
    assert all(getattr(moved, f).device.type == "meta" for f in FIELDS)
    assert moved.block_size == plan.block_size
    assert_plans_equal(plan, plan.to("cpu"))
    with pytest.raises(Exception):
        plan.block_size = 4  # frozen dataclass
    with pytest.raises(ValueError, match="shape"):
        DFlashBatchPlan(
            anchor_positions=plan.anchor_positions, block_valid=plan.block_valid, context_start=plan.context_start,
            position_ids=plan.position_ids[:, :, :2], context_position_ids=plan.context_position_ids,
            loss_mask=plan.loss_mask, block_size=3,
        )


# --------------------------------------------------------------------------------------------------
# Input validation of the builder
# --------------------------------------------------------------------------------------------------

_GOOD = dict(anchors_per_sample=2, block_size=3, optimizer_step=0, seed=0)


@pytest.mark.parametrize(
    "mask, sids, overrides, match",
    [
        (torch.ones(8, dtype=torch.bool), torch.tensor([0]), {}, r"\[batch, seq_length\]"),
        (torch.ones(2, 8), torch.tensor([0, 1]), {}, "bool"),
        (torch.ones(2, 0, dtype=torch.bool), torch.tensor([0, 1]), {}, "seq_length 0"),
        ([[True] * 8], torch.tensor([0]), {}, "torch.Tensor"),
        (torch.ones(2, 8, dtype=torch.bool), torch.tensor([0]), {}, "sample_ids must have shape"),
        (torch.ones(2, 8, dtype=torch.bool), torch.tensor([[0], [1]]), {}, "sample_ids must have shape"),
        (torch.ones(2, 8, dtype=torch.bool), torch.tensor([0.0, 1.0]), {}, "integer"),
        (torch.ones(2, 8, dtype=torch.bool), [0, 1], {}, "torch.Tensor"),
        (torch.ones(2, 8, dtype=torch.bool), torch.tensor([0, 1]), {"block_size": 1}, "block_size must be >= 2"),
        (torch.ones(2, 8, dtype=torch.bool), torch.tensor([0, 1]), {"block_size": 2.5}, "block_size"),
        (torch.ones(2, 8, dtype=torch.bool), torch.tensor([0, 1]), {"anchors_per_sample": 0}, "anchors_per_sample"),
        (torch.ones(2, 8, dtype=torch.bool), torch.tensor([0, 1]), {"anchors_per_sample": True}, "anchors_per_sample"),
        (torch.ones(2, 8, dtype=torch.bool), torch.tensor([0, 1]), {"optimizer_step": -1}, "optimizer_step"),
        (torch.ones(2, 8, dtype=torch.bool), torch.tensor([0, 1]), {"optimizer_step": torch.tensor(3)}, "Python int"),
        (torch.ones(2, 8, dtype=torch.bool), torch.tensor([0, 1]), {"seed": 2**64}, "seed"),
        (torch.ones(2, 8, dtype=torch.bool), torch.tensor([0, 1]),
         {"document_ids": torch.zeros(2, 7, dtype=torch.long)}, "document_ids must have the same shape"),
        (torch.ones(2, 8, dtype=torch.bool), torch.tensor([0, 1]),
         {"document_ids": torch.zeros(2, 8)}, "document_ids must be an integer"),
        (torch.ones(2, 8, dtype=torch.bool), torch.tensor([0, 1]),
         {"document_ids": torch.zeros(2, 8, dtype=torch.long, device="meta")}, "device"),
        (torch.ones(2, 8, dtype=torch.bool), torch.tensor([0, 1], device="meta"), {}, "device"),
    ],
)
def test_builder_rejects_bad_inputs(mask, sids, overrides, match):
    with pytest.raises(ValueError, match=match):
        build_dflash_batch_plan(mask, sids, **{**_GOOD, **overrides})


def test_builder_accepts_numpy_style_integers():
    import numpy as np

    plan = build_dflash_batch_plan(torch.ones(1, 8, dtype=torch.bool), torch.tensor([0]),
                                   anchors_per_sample=np.int64(2), block_size=np.int32(3),
                                   optimizer_step=np.int64(4), seed=np.uint64(2**63 + 5))
    assert plan.block_size == 3 and type(plan.block_size) is int
