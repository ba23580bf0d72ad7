"""A ``pretrain_gpt.py``-style ``get_batch`` that attaches the DFlash batch plan.

Megatron-LM's ``pretrain_gpt.py`` reads a micro-batch on tensor-parallel rank 0, broadcasts it to the
other ranks of the TP group (``get_batch_on_this_tp_rank``) and hands
``tokens, labels, loss_mask, attention_mask, position_ids`` to ``forward_step``. DFlash training needs one
more thing per micro-batch: the batch plan (anchors, blocks, slot positions, slot loss mask). The plan is
a deterministic function of (loss mask, sample IDs, documents, optimizer step, seed), so each TP rank
builds it locally from the broadcast batch; nothing about the plan travels over the network, and
``verify_plan_agreement`` checks now and then (opt-in) that the ranks really agree.

Use it from a training script::

    from examples.pretrain_gpt_get_batch import DFlashBatchSettings, get_batch

    settings = DFlashBatchSettings(seed=1234, anchors_per_sample=64, block_size=16, verify_every=100)

    def forward_step(data_iterator, model):
        batch = get_batch(data_iterator, settings=settings)   # optimizer step from megatron.training's args
        plan = batch["dflash_plan"]
        ...

Two batch formats are accepted:
  * Megatron ``GPTDataset`` batches (``tokens, labels, loss_mask, [attention_mask], position_ids``), whose
    ``loss_mask`` weights the *label* at each position: converted with ``from_megatron_gpt_batch``
    (token-aligned mask, documents from position resets / EOD tokens, sample IDs hashed from the tokens);
  * ``megatron_dflash.data.batching.collate`` batches (``tokens, loss_mask, position_ids, document_ids,
    sample_ids``), used as they are.

Only ``megatron.core`` is imported; ``megatron.training`` is imported lazily, and only when the optimizer
step is not passed explicitly. Run this file for a single-process demo on the synthetic corpus.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_dflash.data.batching import from_megatron_gpt_batch
from megatron_dflash.plan.data_hook import attach_dflash_plan, verify_plan_agreement

# Keys broadcast from TP rank 0 when present (the union of both batch formats).
BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids", "document_ids", "sample_ids")


@dataclass(frozen=True)
class DFlashBatchSettings:
    seed: int
    anchors_per_sample: int
    block_size: int
    use_documents: bool = True
    verify_every: int = 0  # check plan agreement over the TP group every K steps (0: never)
    eod_token_id: Optional[int] = None  # Megatron batches without reset_position_ids: split documents at EOD


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _tp_initialised() -> bool:
    return dist.is_available() and dist.is_initialized() and parallel_state.model_parallel_is_initialized()


def get_batch_on_this_tp_rank(data_iterator: Optional[Iterator]) -> dict:
    """The micro-batch on every TP rank: TP rank 0 reads it, the others receive it (megatron.core only).

    Like ``megatron.training.utils.get_batch_on_this_tp_rank``, but the set of keys, dtypes and shapes is
    sent first, so any batch layout works. Without torch.distributed / parallel_state it just reads.
    """
    device = _device()
    if not _tp_initialised() or parallel_state.get_tensor_model_parallel_world_size() == 1:
        batch = next(data_iterator)
        return {k: v.to(device, non_blocking=True) for k, v in batch.items() if isinstance(v, torch.Tensor)}

    group = parallel_state.get_tensor_model_parallel_group()
    src = parallel_state.get_tensor_model_parallel_src_rank()
    if parallel_state.get_tensor_model_parallel_rank() == 0:
        if data_iterator is None:
            raise ValueError("get_batch: tensor-parallel rank 0 needs a data iterator.")
        batch = next(data_iterator)
        batch = {k: batch[k].to(device) for k in BATCH_KEYS if isinstance(batch.get(k), torch.Tensor)}
        header = [[(k, v.dtype, tuple(v.shape)) for k, v in batch.items()]]
    else:
        batch, header = None, [None]
    dist.broadcast_object_list(header, src=src, group=group)
    if batch is None:
        batch = {k: torch.empty(shape, dtype=dtype, device=device) for k, dtype, shape in header[0]}
    for key in sorted(batch):
        dist.broadcast(batch[key], src=src, group=group)
    return batch


def _current_optimizer_step() -> int:
    from megatron.training import get_args  # lazy: only for a real Megatron-LM run

    return int(get_args().curr_iteration)


def get_batch(data_iterator: Optional[Iterator], vp_stage=None, *, settings: DFlashBatchSettings,
              optimizer_step: Optional[int] = None) -> dict:
    """Read one micro-batch the way ``pretrain_gpt.get_batch`` does and attach ``batch["dflash_plan"]``.

    Args:
        data_iterator: the micro-batch iterator (only TP rank 0 needs one).
        vp_stage: accepted for signature compatibility with ``pretrain_gpt.get_batch``; the plan is built
            on every pipeline stage (it is cheap and the body's stage needs it).
        settings: seed, anchors per sample, block size, verification period.
        optimizer_step: the step the plan is drawn for; default ``megatron.training``'s current iteration.

    Returns:
        The batch dict: ``tokens``, ``loss_mask`` (token-aligned), ``position_ids``, ``document_ids``,
        ``sample_ids``, ``labels`` / ``attention_mask`` when the dataset provides them, ``dflash_plan``.
    """
    del vp_stage
    if _tp_initialised() and parallel_state.get_context_parallel_world_size() > 1:
        raise ValueError("DFlash training does not support context parallelism > 1; use CP = 1.")
    batch = get_batch_on_this_tp_rank(data_iterator)
    if "labels" in batch:  # a Megatron GPTDataset batch: label-aligned loss mask
        batch = from_megatron_gpt_batch(batch, eod_token_id=settings.eod_token_id)
    step = _current_optimizer_step() if optimizer_step is None else optimizer_step
    batch = attach_dflash_plan(
        batch,
        optimizer_step=step,
        seed=settings.seed,
        anchors_per_sample=settings.anchors_per_sample,
        block_size=settings.block_size,
        use_documents=settings.use_documents,
    )
    if settings.verify_every and step % settings.verify_every == 0 and _tp_initialised():
        verify_plan_agreement(batch["dflash_plan"], parallel_state.get_tensor_model_parallel_group(),
                              extra={"tokens": batch["tokens"]})
    return batch


def _demo() -> None:
    from megatron_dflash.data.batching import Collator, MicroBatchIterator
    from megatron_dflash.data.datasets import SyntheticChatDataset
    from megatron_dflash.embedded_job.synthetic_corpus import build_tokenizer

    tokenizer = build_tokenizer()
    dataset = SyntheticChatDataset(seed=0, count=64, tokenizer=tokenizer, seq_length=96)
    data = MicroBatchIterator(dataset, micro_batch_size=4, global_batch_size=8, dp_rank=0, dp_size=1, seed=0,
                              collate_fn=Collator(tokenizer.pad_token_id, 96, pack_sequences=True))
    settings = DFlashBatchSettings(seed=1234, anchors_per_sample=8, block_size=4)
    for _ in range(4):
        step, micro = data.step, data.micro
        batch = get_batch(data, settings=settings, optimizer_step=step)
        plan = batch["dflash_plan"]
        print(f"step {step} micro {micro}: tokens {tuple(batch['tokens'].shape)}, "
              f"valid blocks {int(plan.block_valid.sum())}/{plan.block_valid.numel()}, "
              f"supervised slots {int(plan.loss_mask.sum())}")


if __name__ == "__main__":
    _demo()
