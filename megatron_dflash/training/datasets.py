"""The job's datasets: `build_datasets` (training and validation, of `data/datasets.py`, by `--data-format`) and
`check_training_data` (ids inside the target's vocabulary, something to learn), both before anything is built.
"""

from __future__ import annotations

from ..common.errors import DataError
from ..data import datasets as data
from ..data.chat import ChatOptions
from .arguments import EMBEDDED_SYNTHETIC_HELDOUT_SEED, EMBEDDED_SYNTHETIC_TRAIN_SEED, ArgumentError, chat_template_kwargs
from .data_checks import check_indexed_token_range, check_something_to_learn
from .job import Job

__all__ = ["build_datasets", "chat_options", "check_training_data"]


def chat_options(args) -> ChatOptions:
    """The run's `ChatOptions` (``--chat-template-kwargs``, ``--reasoning``, ``--loss-turns``); the template given
    by ``--chat-template`` is the tokenizer's already (`training.job`)."""
    return ChatOptions(template_kwargs=chat_template_kwargs(args), reasoning=args.reasoning,
                       loss_turns=args.loss_turns)


def build_datasets(job: Job):
    """(train, valid or None) map-style datasets of `data/datasets.py`."""

    args, tok = job.args, job.tokenizer
    fmt = args.data_format
    bad = data.BadRecords(args.bad_records, args.max_bad_fraction)

    def one(path):
        if fmt == "chat":
            return data.ChatDataset(path, tok, args.seq_length, options=chat_options(args), bad_records=bad)
        if fmt == "text":
            return data.TextDataset(path, tok, args.seq_length, bad_records=bad)
        return data.IndexedDataset(path, args.seq_length)

    if fmt == "synthetic":
        train = data.SyntheticChatDataset(EMBEDDED_SYNTHETIC_TRAIN_SEED, args.synthetic_train_samples, tok,
                                          args.seq_length, options=chat_options(args))
        valid = data.SyntheticChatDataset(EMBEDDED_SYNTHETIC_HELDOUT_SEED, args.synthetic_valid_samples, tok,
                                          args.seq_length, options=chat_options(args))
        return train, valid
    try:
        train = one(args.train_path)
        valid = one(args.valid_data) if args.valid_data else None
    except DataError:
        raise  # a record that cannot be used: one line naming its file and line already
    except (ValueError, FileNotFoundError) as err:
        raise ArgumentError(str(err)) from None
    return train, valid


def check_training_data(job: Job, train_ds, collate, log=print) -> None:
    """Token ids of pre-tokenised data inside the target's vocabulary; something to learn in the training data
    (JSONL and synthetic data come from a tokenizer that `prepare_job` checked against the vocabulary)."""

    args = job.args
    if args.data_format == "indexed":
        for path in [args.train_path] + ([args.valid_data] if args.valid_data else []):
            check_indexed_token_range(path, int(job.target_text_config["vocab_size"]))
    check_something_to_learn(train_ds, collate, block_size=job.draft_config.block_size,
                             use_documents=args.pack_sequences, seed=args.seed, lookahead=job.variant.anchor_lookahead,
                             what=f"the training data ({args.train_path or 'synthetic'})", log=log)
