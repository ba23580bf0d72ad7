"""Tests for megatron_dflash.data.batching: packing, collation, the sampler and Megatron GPT batches.

Oracles are written independently of the implementation: packing invariants from first principles, sampler
coverage by counting.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from megatron_dflash.data.batching import (
    Collator,
    MicroBatchIterator,
    collate,
    content_sample_ids,
    from_megatron_gpt_batch,
    pack_samples,
    real_length,
    trim_batch,
)
from megatron_dflash.data.datasets import SyntheticChatDataset
from megatron_dflash.data.samples import stable_sample_id
from data_records import make_sample


# --------------------------------------------------------------------------------------------------
# Packing and collation
# --------------------------------------------------------------------------------------------------


def test_pack_first_fit_example():
    lengths = [6, 5, 3, 4, 2]
    samples = [make_sample(list(range(10 * i, 10 * i + n)), sid=100 + i) for i, n in enumerate(lengths)]
    rows = pack_samples(samples, 8)
    assert [r.sample_ids for r in rows] == [(100, 104), (101, 102), (103,)]
    assert rows[2].sample_id == 103  # a single document keeps its own ID
    assert rows[0].sample_id == stable_sample_id("packed", 100, 104)
    assert rows[0].document_ids.tolist() == [0] * 6 + [1] * 2
    assert rows[0].position_ids.tolist() == list(range(6)) + [0, 1]


def test_pack_invariants():
    rng = random.Random(0)
    for trial in range(30):
        seq_length = rng.randint(4, 40)
        samples = []
        for i in range(rng.randint(1, 25)):
            n = rng.randint(1, seq_length + 5)  # some longer than seq_length: truncated
            samples.append(make_sample([rng.randrange(1000) for _ in range(n)], [rng.random() < 0.7 for _ in range(n)],
                                       sid=rng.randrange(2**63)))
        rows = pack_samples(samples, seq_length)
        again = pack_samples(samples, seq_length)
        assert [(r.sample_ids, r.input_ids.tolist(), r.sample_id) for r in rows] == \
               [(r.sample_ids, r.input_ids.tolist(), r.sample_id) for r in again]
        by_id = {s.sample_id: s for s in samples}
        placed = []
        for row in rows:
            assert 1 <= len(row) <= seq_length
            docs = row.document_ids.tolist()
            # document ids contiguous, 0..k-1 in order
            assert docs[0] == 0 and all(b - a in (0, 1) for a, b in zip(docs, docs[1:]))
            assert docs[-1] == len(row.sample_ids) - 1
            start = 0
            for d, sid in enumerate(row.sample_ids):
                n = docs.count(d)
                src = by_id[sid]
                assert row.input_ids[start:start + n].tolist() == src.input_ids[:seq_length].tolist()
                assert row.loss_mask[start:start + n].tolist() == src.loss_mask[:seq_length].tolist()
                assert row.position_ids[start:start + n].tolist() == list(range(n))  # positions reset
                assert n == min(len(src), seq_length)  # nothing lost beyond truncation
                start += n
            placed.extend(row.sample_ids)
            # within a row, documents keep the input order
            order = [next(i for i, s in enumerate(samples) if s.sample_id == sid) for sid in row.sample_ids]
            assert order == sorted(order)
        assert Counter(placed) == Counter(s.sample_id for s in samples)  # every document exactly once
        # first fit: no later row could have taken a document that opened a new row
        sizes = [0] * len(rows)
        row_of = {sid: r for r, row in enumerate(rows) for sid in row.sample_ids}
        for s in samples:
            r = row_of[s.sample_id]
            n = min(len(s), seq_length)
            assert all(sizes[q] + n > seq_length for q in range(r))
            sizes[r] += n


def test_collate_unpacked_and_packed():
    samples = [make_sample([11, 12, 13], [0, 1, 1], sid=7), make_sample([21, 22], sid=8), make_sample(list(range(30, 40)), sid=9)]
    b = collate(samples, pad_id=0, seq_length=6)
    assert set(b) == {"tokens", "loss_mask", "position_ids", "document_ids", "sample_ids"}
    assert b["tokens"].dtype == torch.int64 and b["loss_mask"].dtype == torch.bool
    assert b["sample_ids"].dtype == torch.int64 and b["sample_ids"].tolist() == [7, 8, 9]
    assert b["tokens"].tolist() == [[11, 12, 13, 0, 0, 0], [21, 22, 0, 0, 0, 0], [30, 31, 32, 33, 34, 35]]
    assert b["loss_mask"].tolist()[0] == [False, True, True, False, False, False]
    assert b["document_ids"].tolist()[1] == [0, 0, -1, -1, -1, -1]
    assert b["position_ids"].tolist() == [list(range(6))] * 3
    p = Collator(pad_id=0, seq_length=6, pack_sequences=True)(samples)
    assert p["tokens"].shape == (2, 6)
    assert p["tokens"].tolist() == [[11, 12, 13, 21, 22, 0], [30, 31, 32, 33, 34, 35]]
    assert p["document_ids"].tolist() == [[0, 0, 0, 1, 1, -1], [0] * 6]
    assert p["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2], list(range(6))]
    assert p["loss_mask"].tolist()[0] == [False, True, True, True, True, False]
    assert p["sample_ids"].tolist() == [stable_sample_id("packed", 7, 8), 9]
    with pytest.raises(ValueError, match="no tokens"):
        collate([make_sample([], sid=1)], 0, 4)


# --------------------------------------------------------------------------------------------------
# Sampler
# --------------------------------------------------------------------------------------------------


class _Counting:
    def __init__(self, n):
        self.n, self.reads = n, 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.reads += 1
        return i


def _step_samples(ds, step, dp_size, **kw):
    per_rank = []
    for r in range(dp_size):
        it = MicroBatchIterator(ds, dp_rank=r, dp_size=dp_size, start_step=step, **kw)
        per_rank.append([x for _ in range(it.num_micro_batches) for x in next(it)])
    return per_rank



@pytest.mark.parametrize("pack", [False, True])
def test_the_cut_after_the_longest_real_row_keeps_every_real_token(pack):
    """`real_length` reaches one past the longest row's last real token (rounded up, at most S), and `trim_batch`
    keeps every real token, its mask, positions and documents: only padding columns are cut."""
    samples = [make_sample(list(range(1, n + 1)), sid=i) for i, n in enumerate([5, 19, 3, 11])]
    batch = collate(samples, pad_id=0, seq_length=64, pack=pack)
    longest = int((batch["document_ids"] >= 0).sum(dim=1).max())
    assert real_length(batch["document_ids"]) == longest
    assert real_length(batch["document_ids"], 16) == -(-longest // 16) * 16
    assert real_length(batch["document_ids"], 48) == 48 and real_length(batch["document_ids"], 128) == 64
    cut = trim_batch(batch, real_length(batch["document_ids"], 16))
    for key in ("tokens", "loss_mask", "position_ids", "document_ids"):
        width = cut[key].shape[1]
        assert torch.equal(cut[key], batch[key][:, :width]), key
        assert (batch["document_ids"][:, width:] < 0).all()
    assert torch.equal(cut["sample_ids"], batch["sample_ids"])

@pytest.mark.parametrize("n", [24, 20])
def test_sampler_covers_every_sample_once_per_epoch(n):
    ds = _Counting(n)
    kw = dict(micro_batch_size=2, global_batch_size=8, seed=3)
    stream = []
    for step in range(3 * n // 8 + 1):
        ranks = _step_samples(ds, step, 2, **kw)
        if n % 8 == 0:  # a step inside one epoch: the DP ranks see different samples
            assert not set(ranks[0]) & set(ranks[1])
        # Megatron's layout: micro-batch m of the step is rank 0's M samples, then rank 1's
        for m in range(2):
            stream += ranks[0][2 * m:2 * m + 2] + ranks[1][2 * m:2 * m + 2]
    for e in range(3):
        assert sorted(stream[e * n:(e + 1) * n]) == list(range(n)), f"epoch {e}"
    assert stream[:n] != stream[n:2 * n]  # a new order every epoch
    # Another seed gives another order.
    other = _step_samples(ds, 0, 2, micro_batch_size=2, global_batch_size=8, seed=4)
    assert other != _step_samples(ds, 0, 2, **kw)


def test_sampler_resumes_exactly():
    ds = _Counting(37)
    kw = dict(micro_batch_size=3, global_batch_size=12, dp_rank=1, dp_size=2, seed=9,
              collate_fn=lambda xs: list(xs))
    full = MicroBatchIterator(ds, **kw)
    assert full.num_micro_batches == 2
    reference = [next(full) for _ in range(2 * 20)]
    for k in (0, 1, 3, 7, 19):
        resumed = MicroBatchIterator(ds, start_step=k, **kw)
        assert resumed.consumed_samples == 12 * k
        assert [next(resumed) for _ in range(2 * (20 - k))] == reference[2 * k:]
    # Resuming far away reads only the samples it yields.
    ds.reads = 0
    far = MicroBatchIterator(ds, start_step=10**9, **kw)
    next(far)
    assert ds.reads == 3 and far.step == 10**9 and far.micro == 1
    assert far.epoch_of(10**9) == 12 * 10**9 // 37


def test_sampler_validation():
    ds = _Counting(10)
    divisible = r"global_batch_size=10 must be divisible by micro_batch_size \* dp_size = 2 \* 2 = 4"
    with pytest.raises(ValueError, match=divisible):
        MicroBatchIterator(ds, micro_batch_size=2, global_batch_size=10, dp_rank=0, dp_size=2, seed=0)
    with pytest.raises(ValueError, match="dp_rank=2 must be < dp_size=2"):
        MicroBatchIterator(ds, micro_batch_size=2, global_batch_size=8, dp_rank=2, dp_size=2, seed=0)
    with pytest.raises(ValueError, match="micro_batch_size"):
        MicroBatchIterator(ds, micro_batch_size=0, global_batch_size=8, dp_rank=0, dp_size=2, seed=0)
    with pytest.raises(ValueError, match="empty"):
        MicroBatchIterator(_Counting(0), micro_batch_size=1, global_batch_size=1, dp_rank=0, dp_size=1, seed=0)


def test_sampler_with_collator_on_synthetic_data(tok):
    ds = SyntheticChatDataset(1, 32, tok, seq_length=64)
    it = MicroBatchIterator(ds, micro_batch_size=4, global_batch_size=8, dp_rank=0, dp_size=1, seed=0,
                            collate_fn=Collator(tok.pad_token_id, 64))
    batch = next(it)
    assert batch["tokens"].shape == (4, 64)
    idx = it.micro_batch_indices(0, 0)
    assert batch["sample_ids"].tolist() == [ds[i].sample_id for i in idx]
    assert (batch["tokens"][~(batch["document_ids"] >= 0)] == tok.pad_token_id).all()


# --------------------------------------------------------------------------------------------------
# Megatron GPT batches
# --------------------------------------------------------------------------------------------------


def test_content_sample_ids():
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 50, (6, 32), generator=gen)
    tokens[3] = tokens[1]
    ids = content_sample_ids(tokens)
    assert ids.dtype == torch.int64 and (ids >= 0).all()
    assert ids[3] == ids[1] and len(set(ids.tolist())) == 5
    perm = torch.tensor([5, 2, 0, 4, 1, 3])
    assert torch.equal(content_sample_ids(tokens[perm]), ids[perm])  # row-wise only
    swapped = tokens.clone()
    swapped[0, [0, 1]] = swapped[0, [1, 0]]
    assert tokens[0, 0] == tokens[0, 1] or content_sample_ids(swapped)[0] != ids[0]  # order matters
    assert torch.equal(content_sample_ids(tokens), ids)


def test_from_megatron_gpt_batch():
    eod = 9
    tokens = torch.tensor([[1, 2, eod, 3, 4, 5, eod, 6], [7, 7, 7, 7, 7, 7, 7, 7]])
    # reset_position_ids on row 0; label-aligned loss mask with eod_mask_loss (prediction from EOD masked)
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0], list(range(8))])
    megatron_mask = torch.tensor([[1, 1, 0, 1, 1, 1, 0, 1], [1, 1, 1, 1, 1, 0, 0, 0]], dtype=torch.float)
    batch = {"tokens": tokens, "labels": torch.roll(tokens, -1, 1), "loss_mask": megatron_mask,
             "position_ids": position_ids}
    out = from_megatron_gpt_batch(batch)
    assert out["loss_mask"].tolist() == [[False, True, True, False, True, True, True, False],
                                         [False, True, True, True, True, True, False, False]]
    assert out["document_ids"].tolist() == [[0, 0, 0, 1, 1, 1, 1, 2], [0] * 8]
    assert torch.equal(out["sample_ids"], content_sample_ids(tokens)) and "labels" in out
    # without position resets, EOD tokens split the documents
    flat = dict(batch, position_ids=torch.arange(8).expand(2, 8))
    assert from_megatron_gpt_batch(flat, eod_token_id=eod)["document_ids"].tolist()[0] == [0, 0, 0, 1, 1, 1, 1, 2]
    given = from_megatron_gpt_batch(dict(batch, sample_ids=torch.tensor([4, 5])))
    assert given["sample_ids"].tolist() == [4, 5]
