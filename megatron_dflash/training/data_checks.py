"""Checks of the training data before the first step: something to learn, ids inside the vocabulary.

Both are pure functions of the files, so every rank reaches the same verdict without communicating.
A dataset in which no sample yields a single supervised slot (chats without an assistant turn,
empty texts, packed documents all shorter than a block) would otherwise train on nothing for the
whole run and export an untrained draft; token ids at or past the target's vocabulary would end in
an `IndexError` mid-run (a device-side assert on CUDA).
"""

from __future__ import annotations

import os

import numpy as np

from ..common.errors import DataError

__all__ = ["MAX_SAMPLES_SCANNED", "check_something_to_learn", "check_indexed_token_range"]

# A dataset whose first samples (in file order) hold nothing supervised is most likely all alike;
# scanning stops there so that a huge corpus is not read in full before training.
MAX_SAMPLES_SCANNED = 100_000
_CHUNK_TOKENS = 1 << 24


def check_something_to_learn(dataset, collate, *, block_size: int, use_documents: bool, seed: int,
                             what: str = "the training data", log=print, lookahead=None) -> int:
    """Index of the first sample with at least one supervised slot; raises `DataError` if none has.

    Each sample is laid out as a one-row micro-batch (`collate`) and planned with every eligible anchor,
    the same rule the training step uses (`plan.data_hook.attach_dflash_plan`, with the variant's `lookahead`)."""
    import torch

    # here, with torch: `job.py` reads this module's file checks before the run loads torch
    from ..plan.data_hook import attach_dflash_plan

    n = min(len(dataset), MAX_SAMPLES_SCANNED)
    for index in range(n):
        try:
            sample = dataset[index]
        except ValueError as err:  # a record that tokenises to nothing, ...: named by file and line
            raise DataError(str(err)) from None
        batch = collate([sample])
        seq_length = batch["loss_mask"].shape[1]
        attach_dflash_plan(batch, optimizer_step=0, seed=seed, anchors_per_sample=seq_length, block_size=block_size,
                           use_documents=use_documents, lookahead=lookahead)
        if bool(torch.as_tensor(batch["dflash_plan"].loss_mask).any()):
            if index > 0:
                log(f"[data] the first {index} sample(s) of {what} have no supervised slot; they are skipped in "
                    "training (counted as empty micro-batches).")
            return index
    scope = f"none of its {n} samples" if n == len(dataset) else f"none of its first {n} samples"
    raise DataError(
        f"{what} has nothing to learn: {scope} yields a supervised block (a supervised token with "
        f"block_size - 1 = {block_size - 1} further tokens{' in its own document' if use_documents else ''}). "
        "Check that chats have assistant turns and texts are not empty, and that documents are longer than "
        "--dflash-block-size."
    )


def check_indexed_token_range(path_prefix: str, vocab_size: int) -> None:
    """Every token id of a Megatron indexed dataset (`PREFIX.bin`) lies in `[0, vocab_size)`."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dtype = np.dtype(IndexedDataset(path_prefix, mmap=True).index.dtype)
    path = path_prefix + ".bin"
    count = os.path.getsize(path) // dtype.itemsize
    if count == 0:
        return
    tokens = np.memmap(path, dtype=dtype, mode="r", shape=(count,))
    for start in range(0, count, _CHUNK_TOKENS):
        chunk = tokens[start:start + _CHUNK_TOKENS]
        low, high = int(chunk.min()), int(chunk.max())
        if low < 0 or high >= vocab_size:
            bad = int(np.flatnonzero((chunk < 0) | (chunk >= vocab_size))[0]) + start
            raise DataError(
                f"{path}: token {bad} has id {int(tokens[bad])}, outside the target's vocabulary [0, {vocab_size}); "
                "the data was tokenised with another tokenizer. Re-tokenise it with the target's tokenizer."
            )
