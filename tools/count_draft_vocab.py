#!/usr/bin/env python
"""Choose a reduced draft vocabulary from the training data, once, before training.

    python tools/count_draft_vocab.py --output vocab.json --dflash-draft-vocab-size 160      # the embedded job
    python tools/count_draft_vocab.py --output vocab.json --dflash-draft-vocab-size 32000 \\
        --target /models/Qwen3-8B --data-format chat --train-data chats.jsonl --seq-length 4096 ...
    python pretrain_dflash.py --dflash-draft-vocab-size 32000 --dflash-draft-vocab vocab.json ...

Every argument but ``--output`` is `pretrain_dflash.py`'s: the same data, tokenizer, chat template and
sequence length the run reads. The tool counts the loss-masked tokens of every training sample, keeps the MASK
token, pad, the stop tokens and the tokenizer's special and added tokens, fills the rest of the K ids with the
most frequent tokens (ties: the smaller id first) and writes them with a fingerprint of the counts and of the
tokenizer (docs/design.md §20 Reduced draft vocabulary). The same data and tokenizer always give the same file.
Without ``--dflash-draft-vocab`` the training job counts the same way when it starts.
"""

from __future__ import annotations

import os
import sys

# Before torch loads OpenMP: idle threads sleep instead of spinning (as in pretrain_dflash.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Run from a checkout without installing the package.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from megatron_dflash.common.cli import (  # noqa: E402
    UsageError, quiet_dependency_warnings, report_failure, require_output_file, usage_error,
)

PROG = "count_draft_vocab.py"


def _split_output(argv: list) -> tuple:
    """(``--output``'s value or None, the remaining `pretrain_dflash.py` arguments)."""
    rest, output = [], None
    it = iter(argv)
    for item in it:
        if item == "--output":
            output = next(it, None)
        elif item.startswith("--output="):
            output = item.split("=", 1)[1]
        else:
            rest.append(item)
    return output, rest


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    output, rest = _split_output(argv)
    if not output:
        usage_error(PROG, "--output FILE is required (the JSON file of the chosen ids).")
    try:  # before the counting, which reads the whole training data
        require_output_file("--output", output)
    except UsageError as err:
        usage_error(PROG, str(err))
    quiet_dependency_warnings()
    # Imported here so that --help and usage errors answer before torch loads.
    from megatron_dflash.training.arguments import ArgumentError, parse_args
    from megatron_dflash.training.datasets import build_datasets
    from megatron_dflash.training.draft_vocab import count_draft_vocab
    from megatron_dflash.training.job import prepare_job

    args = parse_args(rest)
    if args.dflash_draft_vocab_size is None:
        usage_error(PROG, "--dflash-draft-vocab-size K is required (the number of draft tokens to choose).")
    try:
        # one process reads what every rank of the run would: the world of its model-parallel group
        job = prepare_job(args, world_size=args.tensor_model_parallel_size * args.pipeline_model_parallel_size,
                          cuda=False)
        train, _ = build_datasets(job)
        chosen = count_draft_vocab(job, train, source={"train_data": args.train_path or "synthetic",
                                                       "target": job.target_dir, "seq_length": args.seq_length})
    except (ArgumentError, ValueError) as err:
        usage_error(PROG, str(err))
    try:  # published whole (common.atomic.write_file): a failed write leaves the previous file, or none
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        chosen.write(output)
    except OSError as err:  # a full disk (NoSpaceError), a directory made in its place meanwhile
        report_failure(PROG, err)
        return 1
    print(f"[count_draft_vocab] {chosen.draft_vocab_size} of {chosen.target_vocab_size} token ids cover "
          f"{chosen.coverage:.2%} of {chosen.label_tokens} loss-masked tokens ({len(chosen.kept_ids)} special ids "
          f"kept); written to {output} (data {chosen.data_fingerprint[:12]}, tokenizer "
          f"{chosen.tokenizer_fingerprint[:12]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
