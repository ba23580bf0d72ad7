"""The run's reduced draft vocabulary (docs/design.md §20 Reduced draft vocabulary): which K target ids
(`resolve_draft_vocab`: ``--dflash-draft-vocab``'s file, every field checked and checked against the run by
`read_draft_vocab_file` before the data is read, or counted over the training data as
``tools/count_draft_vocab.py`` counts them), and the draft head made of those rows of the frozen target
head (`install_draft_vocab`: copied once, on every rank, before the optimizer sees the body).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..data.token_counts import DraftVocabFile, count_label_tokens, special_token_ids, tokenizer_fingerprint
from ..draft.draft_vocab import DraftVocabulary
from ..target.head import OutputHead
from .arguments import ArgumentError
from .job import Job

__all__ = ["kept_token_ids", "count_draft_vocab", "read_draft_vocab_file", "resolve_draft_vocab",
           "install_draft_vocab"]


def kept_token_ids(job: Job) -> list[int]:
    """The ids every draft vocabulary of this run keeps: MASK, pad, the stop tokens and the tokenizer's
    special and added tokens, inside the target vocabulary."""
    V = int(job.target_text_config["vocab_size"])
    extra = [job.draft_config.mask_token_id, job.pad_token_id, *job.stop_token_ids]
    return [i for i in special_token_ids(job.tokenizer, extra) if 0 <= i < V]


def count_draft_vocab(job: Job, train_ds, source: Optional[dict] = None) -> DraftVocabFile:
    """The draft vocabulary of ``job``'s size counted over ``train_ds``' loss-masked tokens."""
    V = int(job.target_text_config["vocab_size"])
    counts = count_label_tokens(train_ds, V)
    try:
        return DraftVocabFile.build(counts, job.draft_config.draft_vocab_size, kept_token_ids(job), job.tokenizer,
                                    source=source)
    except ValueError as err:
        raise ArgumentError(f"--dflash-draft-vocab-size: {err}") from None


def _read_file(job: Job, path: str) -> DraftVocabFile:
    """``--dflash-draft-vocab``'s file, refused (naming the field) when it does not fit the run."""
    try:
        chosen = DraftVocabFile.read(path)
    except ValueError as err:
        raise ArgumentError(f"--dflash-draft-vocab: {err}") from None
    V = int(job.target_text_config["vocab_size"])
    expected = (("draft_vocab_size", job.draft_config.draft_vocab_size), ("target_vocab_size", V),
                ("tokenizer_fingerprint", tokenizer_fingerprint(job.tokenizer)))
    for name, value in expected:
        if getattr(chosen, name) != value:
            raise ArgumentError(f"--dflash-draft-vocab={path}: {name} is {getattr(chosen, name)} but this run's is "
                                f"{value}; count it again with tools/count_draft_vocab.py for this run.")
    missing = sorted(set(kept_token_ids(job)) - set(chosen.ids))
    if missing:
        raise ArgumentError(f"--dflash-draft-vocab={path}: lacks the run's special tokens {missing[:8]} (MASK, pad, "
                            "stop tokens); count it again with tools/count_draft_vocab.py.")
    return chosen


def _draft_vocab_size(job: Job) -> Optional[int]:
    K = getattr(job.draft_config, "draft_vocab_size", None)  # a field of the Qwen3-style family's config only
    if job.args.dflash_draft_vocab_size is not None and K is None:
        raise ArgumentError(f"--dflash-draft-vocab-size: the {type(job.draft_config).__name__} draft has no reduced "
                            "vocabulary (the Qwen3-style DFlash body has); drop the flag.")
    return K


def read_draft_vocab_file(job: Job) -> Optional[DraftVocabFile]:
    """``--dflash-draft-vocab``'s file, every field checked and checked against the run (None without the flag):
    read on every rank alike, before the data is read or anything built, so a bad file stops every rank the same
    way before any collective."""
    if _draft_vocab_size(job) is None or not job.args.dflash_draft_vocab:
        return None
    return _read_file(job, job.args.dflash_draft_vocab)


def resolve_draft_vocab(job: Job, train_ds, log=print, chosen: Optional[DraftVocabFile] = None
                        ) -> Optional[DraftVocabulary]:
    """The run's `DraftVocabulary` (None without ``--dflash-draft-vocab-size``): ``chosen``, the file
    `read_draft_vocab_file` read (read here when not given), or counted over ``train_ds``; every rank reads or
    counts the same data, so every rank holds the same ids without a collective."""
    K = _draft_vocab_size(job)
    if K is None:
        return None
    path = job.args.dflash_draft_vocab
    if not path:
        chosen = count_draft_vocab(job, train_ds)
    elif chosen is None:
        chosen = _read_file(job, path)
    where = path or "counted over the training data's loss-masked tokens"
    log(f"[dflash] draft vocabulary: {K} of {chosen.target_vocab_size} target tokens ({where}); they cover "
        f"{chosen.coverage:.2%} of the {chosen.label_tokens} supervised tokens; the other slots are left out of the "
        "loss and counted wrong")
    return DraftVocabulary.from_ids(chosen.ids, chosen.target_vocab_size)


@torch.no_grad()
def target_head_rows(head: OutputHead, ids: torch.Tensor) -> torch.Tensor:
    """``[K, H]`` rows ``ids`` of the (vocab-parallel) target head's weight, whole on every rank (each rank
    gives the rows of its shard, one SUM all-reduce over the head's group)."""
    if getattr(head.layer, "bias", None) is not None:
        raise ArgumentError("--dflash-draft-vocab-size: the target's output layer has a bias, which the draft head "
                            "(the serving layout: lm_head.weight only) cannot carry.")
    weight = head.weight if head.weight is not None else head.layer.weight
    start, _ = head.vocab_range
    local = ids.to(weight.device) - start
    owned = (local >= 0) & (local < weight.shape[0])
    rows = torch.zeros(ids.numel(), weight.shape[1], dtype=torch.float32, device=weight.device)
    rows[owned] = weight[local[owned]].float()
    if head.tp_group.size() > 1:
        torch.distributed.all_reduce(rows, group=head.tp_group)
    return rows


def install_draft_vocab(body: nn.Module, vocab: DraftVocabulary, target_head: OutputHead, *, trainable: bool) -> None:
    """Copy the target head's rows of ``vocab`` into ``body.lm_head`` (frozen unless ``trainable``) and set
    ``body.d2t``; collective over the target head's TP group."""
    body.lm_head.copy_target_rows(target_head_rows(target_head, vocab.ids))
    body.d2t.copy_(vocab.d2t.to(body.d2t.device))
    body.lm_head.weight.requires_grad_(bool(trainable))
