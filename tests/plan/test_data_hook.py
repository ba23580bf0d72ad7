"""Tests for megatron_dflash.plan.data_hook: the plan attached to a batch, without host synchronisation, and the
check that every rank of a group built the same plan.
"""

from __future__ import annotations

import importlib.util
import os
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_dflash.data.batching import collate, from_megatron_gpt_batch
from megatron_dflash.data.samples import stable_sample_id
from megatron_dflash.plan.batch_plan import build_dflash_batch_plan
from megatron_dflash.plan.data_hook import (
    PlanDisagreementError,
    attach_dflash_plan,
    plan_checksum,
    verify_plan_agreement,
)
from repo_paths import REPO_ROOT
from data_records import make_sample


PLAN_FIELDS = ("anchor_positions", "block_valid", "context_start", "position_ids", "context_position_ids", "loss_mask")
EXAMPLE = os.path.join(REPO_ROOT, "examples",
                       "pretrain_gpt_get_batch.py")


# --------------------------------------------------------------------------------------------------
# The plan hook
# --------------------------------------------------------------------------------------------------


def _random_batch(seed=0, b=4, s=40, pack=True):
    rng = random.Random(seed)
    samples = []
    for i in range(b * 2):
        n = rng.randint(3, s)
        samples.append(make_sample([rng.randrange(1, 100) for _ in range(n)], [rng.random() < 0.8 for _ in range(n)],
                                   sid=stable_sample_id("test", seed, i)))
    return collate(samples, pad_id=0, seq_length=s, pack=pack)


def _assert_same_plan(a, b):
    assert a.block_size == b.block_size
    for f in PLAN_FIELDS:
        assert torch.equal(getattr(a, f), getattr(b, f)), f


def test_attach_plan_equals_direct_build():
    for pack in (True, False):
        batch = _random_batch(pack=pack)
        out = attach_dflash_plan(batch, optimizer_step=5, seed=11, anchors_per_sample=6, block_size=4)
        assert out is batch and "dflash_plan" in batch
        direct = build_dflash_batch_plan(batch["loss_mask"], batch["sample_ids"], anchors_per_sample=6, block_size=4,
                                         optimizer_step=5, seed=11, document_ids=batch["document_ids"])
        _assert_same_plan(batch["dflash_plan"], direct)
        # no block enters padding or crosses a document
        plan = batch["dflash_plan"]
        docs = torch.gather(batch["document_ids"], 1, plan.token_indices.flatten(1)).view_as(plan.position_ids)
        valid = plan.block_valid
        assert (docs[valid] >= 0).all() and (docs[valid] == docs[valid][:, :1]).all()
    nodoc = attach_dflash_plan(dict(batch), optimizer_step=5, seed=11, anchors_per_sample=6, block_size=4,
                               use_documents=False)
    _assert_same_plan(nodoc["dflash_plan"], build_dflash_batch_plan(
        batch["loss_mask"], batch["sample_ids"], anchors_per_sample=6, block_size=4, optimizer_step=5, seed=11))
    with pytest.raises(KeyError, match="sample_ids"):
        attach_dflash_plan({"loss_mask": batch["loss_mask"]}, optimizer_step=0, seed=0, anchors_per_sample=1,
                           block_size=2)


class _RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _forbid(*_args, **_kwargs):
    raise AssertionError("the data hook must not synchronise with the host")


def test_hook_does_not_sync_with_host():
    batch = _random_batch(seed=6)
    tokens = batch["tokens"]
    megatron = {"tokens": tokens, "labels": torch.roll(tokens, -1, 1), "loss_mask": batch["loss_mask"].float(),
                "position_ids": batch["position_ids"]}
    with pytest.MonkeyPatch.context() as mp:
        for name in ("item", "tolist", "__bool__", "__int__", "__float__", "numpy", "nonzero"):
            mp.setattr(torch.Tensor, name, _forbid)
        mp.setattr(torch, "nonzero", _forbid)
        with _RecordOps() as recorder:
            attach_dflash_plan(batch, optimizer_step=1, seed=2, anchors_per_sample=4, block_size=3)
            converted = from_megatron_gpt_batch(megatron, eod_token_id=0)
            attach_dflash_plan(converted, optimizer_step=1, seed=2, anchors_per_sample=4, block_size=3)
    syncing = ("_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "aten.equal")
    bad = [op for op in recorder.ops if any(s in op for s in syncing)]
    assert not bad, f"host-syncing ops in the data hook: {bad}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_hook_does_not_sync_on_cuda():
    batch = {k: v.cuda() for k, v in _random_batch(seed=6).items()}
    megatron = {"tokens": batch["tokens"], "labels": batch["tokens"], "loss_mask": batch["loss_mask"].float(),
                "position_ids": batch["position_ids"]}
    kw = dict(optimizer_step=1, seed=2, anchors_per_sample=4, block_size=3)
    attach_dflash_plan(dict(batch), **kw)  # warm up lazy CUDA init outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        attach_dflash_plan(batch, **kw)
        attach_dflash_plan(from_megatron_gpt_batch(megatron, eod_token_id=0), **kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert batch["dflash_plan"].device.type == "cuda"


def test_plan_checksum_sees_every_field():
    batch = attach_dflash_plan(_random_batch(), optimizer_step=1, seed=2, anchors_per_sample=5, block_size=3)
    plan = batch["dflash_plan"]
    names, base = plan_checksum(plan)
    assert torch.equal(plan_checksum(plan)[1], base)
    import dataclasses

    for f in PLAN_FIELDS:
        t = getattr(plan, f).clone()
        flat = t.view(-1)
        flat[-1] = ~flat[-1] if t.dtype == torch.bool else flat[-1] + 1
        changed = plan_checksum(dataclasses.replace(plan, **{f: t}))[1]
        assert [n for n, a, b in zip(names, base.tolist(), changed.tolist()) if a != b] == [f]
    # anchors of another step differ
    other = attach_dflash_plan(dict(batch), optimizer_step=2, seed=2, anchors_per_sample=5, block_size=3)
    assert not torch.equal(plan_checksum(other["dflash_plan"])[1], base)
    # single process, no distributed: verify is a no-op returning the checksum
    assert torch.equal(verify_plan_agreement(plan), base)


# --------------------------------------------------------------------------------------------------
# Tensor-parallel agreement (2 gloo ranks)
# --------------------------------------------------------------------------------------------------


def _ranks_verify(rank: int, world_size: int, tamper: str) -> str:
    from megatron.core import parallel_state

    batch = _random_batch(seed=3)
    if rank == 1 and tamper == "sample_ids":
        batch["sample_ids"] = batch["sample_ids"] + 1
    if rank == 1 and tamper == "loss_mask":
        batch["loss_mask"] = batch["loss_mask"].clone()
        batch["loss_mask"][0, :] = False
    step = 7 + (1 if rank == 1 and tamper == "step" else 0)
    attach_dflash_plan(batch, optimizer_step=step, seed=5, anchors_per_sample=6, block_size=4)
    try:
        verify_plan_agreement(batch["dflash_plan"], parallel_state.get_tensor_model_parallel_group())
        verify_plan_agreement(batch["dflash_plan"])  # default group: the TP group
    except PlanDisagreementError as err:
        return str(err)
    return "ok"


def _load_example():
    import sys

    name = "pretrain_gpt_get_batch_example"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLE)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the file executes
        spec.loader.exec_module(module)
    return sys.modules[name]


def _ranks_example_get_batch(rank: int, world_size: int) -> list:
    ex = _load_example()
    ours = _random_batch(seed=4)
    eod = 9
    tokens = torch.randint(10, 50, (2, 16), generator=torch.Generator().manual_seed(1))
    tokens[0, 6] = eod
    megatron = {"tokens": tokens, "labels": torch.roll(tokens, -1, 1),
                "loss_mask": torch.ones(2, 16), "position_ids": torch.arange(16).expand(2, 16).contiguous()}
    iterator = iter([ours, megatron]) if rank == 0 else None  # only TP rank 0 reads data
    settings = ex.DFlashBatchSettings(seed=3, anchors_per_sample=4, block_size=3, verify_every=1, eod_token_id=eod)
    results = []
    for step in (0, 1):
        batch = ex.get_batch(iterator, settings=settings, optimizer_step=step)
        plan = batch["dflash_plan"]
        results.append({f: getattr(plan, f) for f in PLAN_FIELDS} | {"docs": batch["document_ids"],
                                                                   "sids": batch["sample_ids"]})
    return results


def test_verify_plan_agreement_tp2(tp_pool):
    pool = tp_pool(2)
    assert pool.run(_ranks_verify, "none") == ["ok", "ok"]
    for tamper, field in (("sample_ids", "anchor_positions"), ("loss_mask", "loss_mask"), ("step", "anchor_positions")):
        messages = pool.run(_ranks_verify, tamper)
        for rank, message in enumerate(messages):  # every rank raised, naming what differs
            assert "disagree across the 2 ranks" in message and field in message, (tamper, rank, message)
            assert f"this is rank {rank}" in message


def test_example_get_batch_tp2(tp_pool):
    ranks = tp_pool(2).run(_ranks_example_get_batch)
    ours = _random_batch(seed=4)
    for r0, r1 in zip(*ranks):
        for key in r0:
            assert torch.equal(r0[key], r1[key]), key
    direct = build_dflash_batch_plan(ours["loss_mask"], ours["sample_ids"], anchors_per_sample=4, block_size=3,
                                     optimizer_step=0, seed=3, document_ids=ours["document_ids"])
    for f in PLAN_FIELDS:
        assert torch.equal(ranks[0][0][f], getattr(direct, f)), f
    # the Megatron batch: documents split after the EOD token, IDs hashed from the tokens
    assert ranks[0][1]["docs"].tolist()[0] == [0] * 7 + [1] * 9
    assert ranks[0][1]["block_valid"].any()
