"""Choosing a reduced draft vocabulary from the training data: count, rank, keep the special tokens, write it down
(docs/design.md §20 Reduced draft vocabulary).

* `count_label_tokens`: how often each target token id is a *supervised* token of the data (its loss mask set),
  over every sample of a dataset, the published choice (speculators' and SpecForge's vocabulary mappings count
  the loss-masked tokens: the tokens the draft is trained to propose).
* `choose_draft_ids`: the ``K`` ids the draft keeps: the always-kept ids (the MASK token, the tokenizer's special
  and added tokens: eos, pad, the chat template's markers) first, then the most frequent others, ties broken by
  the smaller id, so the same counts always give the same ids; ids that never occur fill up by increasing id.
* `DraftVocabFile`: the chosen ids with what they were chosen from (``K``, ``V``, the counts' coverage, a
  fingerprint of the counts and of the tokenizer) as one JSON file, written atomically; read back only once every
  field has its type and range (`DataError` naming the file and the entry).
* `bad_draft_id`: the one rule a list of draft ids obeys wherever it comes from (this file's ``ids``, an export's
  ``d2t``, `draft.draft_vocab.check_vocab_tensors`): each inside the target vocabulary, each once, increasing.

Shapes: V target vocabulary, K draft vocabulary.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Iterable, Optional

import torch

from ..common.atomic import write_file
from ..common.errors import DataError

__all__ = ["count_label_tokens", "special_token_ids", "choose_draft_ids", "tokenizer_fingerprint",
           "counts_fingerprint", "bad_draft_id", "DraftVocabFile", "DRAFT_VOCAB_FORMAT"]

DRAFT_VOCAB_FORMAT = "megatron-dflash-draft-vocab"
DRAFT_VOCAB_VERSION = 1


def count_label_tokens(dataset, vocab_size: int) -> torch.Tensor:
    """``[V]`` int64: occurrences of each token id among the loss-masked tokens of every sample of ``dataset``
    (items with ``input_ids`` and ``loss_mask``, e.g. `data.samples.Sample`)."""
    counts = torch.zeros(int(vocab_size), dtype=torch.int64)
    for index in range(len(dataset)):
        sample = dataset[index]
        ids = torch.as_tensor(sample.input_ids, dtype=torch.int64)
        supervised = ids[torch.as_tensor(sample.loss_mask, dtype=torch.bool)]
        if supervised.numel() and (int(supervised.min()) < 0 or int(supervised.max()) >= vocab_size):
            raise ValueError(f"sample {index} holds token ids outside the target vocabulary [0, {vocab_size}).")
        counts += torch.bincount(supervised, minlength=int(vocab_size))
    return counts


def special_token_ids(tokenizer, extra: Iterable[int] = ()) -> list[int]:
    """The ids a draft vocabulary always keeps: ``extra`` (the MASK token), the tokenizer's special tokens (eos,
    pad, bos, unk) and its added tokens (chat-template markers), sorted, each once."""
    ids = set(int(i) for i in extra if i is not None)
    ids.update(int(i) for i in (getattr(tokenizer, "all_special_ids", None) or []))
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(int(i) for i in decoder)
    return sorted(ids)


def choose_draft_ids(counts: torch.Tensor, size: int, keep: Iterable[int] = ()) -> torch.Tensor:
    """``[K]`` int64 increasing: ``keep`` plus the most frequent other ids of ``counts [V]`` (ties: smaller id
    first; never-seen ids fill up by increasing id)."""
    V = int(counts.numel())
    keep = sorted(set(int(i) for i in keep))
    if not 1 <= size <= V:
        raise ValueError(f"the draft vocabulary size {size} must be between 1 and the target vocabulary {V}.")
    if any(not 0 <= i < V for i in keep):
        raise ValueError(f"the always-kept ids {keep} must lie in [0, {V}).")
    if len(keep) > size:
        raise ValueError(f"the draft vocabulary size {size} is smaller than the {len(keep)} special tokens it must "
                         "keep (MASK, eos, pad, chat-template markers); choose a larger size.")
    score = counts.to(torch.int64).clone()
    score[torch.tensor(keep, dtype=torch.int64)] = -1  # placed separately
    # a stable sort on -count keeps increasing ids inside each tie
    order = torch.sort(-score, stable=True).indices
    chosen = torch.cat([torch.tensor(keep, dtype=torch.int64), order[: size - len(keep)]])
    return torch.sort(chosen).values


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the tokenizer's vocabulary (token -> id), its special ids and its chat template."""
    vocab = sorted((str(k), int(v)) for k, v in tokenizer.get_vocab().items())
    text = json.dumps({"vocab": vocab, "special": special_token_ids(tokenizer),
                       "template": getattr(tokenizer, "chat_template", None)}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def counts_fingerprint(counts: torch.Tensor) -> str:
    """sha256 of the ``[V]`` counts (the data as the choice saw it)."""
    return hashlib.sha256(counts.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()


def bad_draft_id(ids: list, vocab_size: int) -> Optional[tuple[int, str]]:
    """The first entry of the draft ids ``ids`` (Python ints: draft id ``i`` is target id ``ids[i]``) that breaks
    the layout every reader shares, as ``(i, what is wrong with ids[i])``; None when there is none. The ids lie in
    ``[0, vocab_size)`` and increase strictly: each target id once, the draft ids in the target's order (the
    serving layout's ``d2t`` offsets, speculators' and SpecForge's sorted mappings)."""
    seen: dict = {}
    for i, value in enumerate(ids):
        if not 0 <= value < vocab_size:
            return i, f"is {value}, outside [0, {vocab_size}) (the target vocabulary)"
        if value in seen:
            return i, f"is {value}, like entry {seen[value]}: that maps two draft ids to the same target id"
        if i and value < ids[i - 1]:
            return i, f"is {value}, below entry {i - 1}'s {ids[i - 1]}: the ids must be in increasing order"
        seen[value] = i
    return None


def _is_int(value) -> bool:
    """A JSON integer (not a bool, a float such as 7.0 or 7.5, or a string)."""
    return type(value) is int


def _check_file_fields(path: str, data: dict) -> None:
    """Every field `DraftVocabFile.read` uses, checked before one is: `DataError` naming ``path`` and the first
    bad entry (``ids[3] is "12"``) with what to do."""
    again = "count it again with tools/count_draft_vocab.py"
    if data.get("version", DRAFT_VOCAB_VERSION) != DRAFT_VOCAB_VERSION:
        raise DataError(f"{path}: version {data['version']!r}, but this package reads draft vocabulary files of "
                        f"version {DRAFT_VOCAB_VERSION}; {again}.")
    missing = [name for name in ("draft_vocab_size", "target_vocab_size", "ids", "kept_ids", "label_tokens",
                                 "covered_tokens", "data_fingerprint", "tokenizer_fingerprint") if name not in data]
    if missing:
        raise DataError(f"{path}: no {', '.join(missing)} field; {again}.")
    for name in ("draft_vocab_size", "target_vocab_size", "label_tokens", "covered_tokens"):
        least = 1 if name.endswith("vocab_size") else 0
        if not _is_int(data[name]) or data[name] < least:
            raise DataError(f"{path}: {name} is {data[name]!r}, not an integer of at least {least}; {again}.")
    K, V = data["draft_vocab_size"], data["target_vocab_size"]
    if K > V or data["covered_tokens"] > data["label_tokens"]:
        small, large = ("draft_vocab_size", "target_vocab_size") if K > V else ("label_tokens", "covered_tokens")
        raise DataError(f"{path}: {large} {data[large]} is below {small} {data[small]}; {again}.")
    for name in ("data_fingerprint", "tokenizer_fingerprint", "counted"):
        if not isinstance(data.get(name, ""), str):
            raise DataError(f"{path}: {name} is {data[name]!r}, not a string; {again}.")
    if not isinstance(data.get("source", {}), dict):
        raise DataError(f"{path}: source is {data['source']!r}, not an object; {again}.")
    for name in ("ids", "kept_ids"):
        ids = data[name]
        if not isinstance(ids, list):
            raise DataError(f"{path}: {name} is {type(ids).__name__}, not a list of token ids; {again}.")
        odd = next((i for i, value in enumerate(ids) if not _is_int(value)), None)
        if odd is not None:
            raise DataError(f"{path}: {name}[{odd}] is {ids[odd]!r}, not an integer token id; {again}.")
        bad = bad_draft_id(ids, V)
        if bad is not None:
            raise DataError(f"{path}: {name}[{bad[0]}] {bad[1]}; {again}.")
    if len(data["ids"]) != K:
        raise DataError(f"{path}: holds {len(data['ids'])} ids for draft_vocab_size {K}; {again}.")
    outside = sorted(set(data["kept_ids"]) - set(data["ids"]))
    if outside:
        raise DataError(f"{path}: kept_ids {outside[:8]} are not among the ids; {again}.")


@dataclass
class DraftVocabFile:
    """A chosen draft vocabulary as written by ``tools/count_draft_vocab.py`` and read by ``--dflash-draft-vocab``."""

    draft_vocab_size: int
    target_vocab_size: int
    ids: list
    kept_ids: list
    label_tokens: int  # loss-masked tokens counted
    covered_tokens: int  # of them, inside the draft vocabulary
    data_fingerprint: str
    tokenizer_fingerprint: str
    counted: str = "loss-masked tokens of the training data"
    source: dict = field(default_factory=dict)
    format: str = DRAFT_VOCAB_FORMAT
    version: int = DRAFT_VOCAB_VERSION

    @classmethod
    def build(cls, counts: torch.Tensor, size: int, keep: Iterable[int], tokenizer,
              source: Optional[dict] = None) -> "DraftVocabFile":
        ids = choose_draft_ids(counts, size, keep)
        return cls(draft_vocab_size=int(size), target_vocab_size=int(counts.numel()), ids=ids.tolist(),
                   kept_ids=sorted(set(int(i) for i in keep)), label_tokens=int(counts.sum()),
                   covered_tokens=int(counts[ids].sum()), data_fingerprint=counts_fingerprint(counts),
                   tokenizer_fingerprint=tokenizer_fingerprint(tokenizer), source=dict(source or {}))

    @property
    def coverage(self) -> float:
        """Share of the counted tokens inside the draft vocabulary."""
        return self.covered_tokens / max(1, self.label_tokens)

    def write(self, path: str) -> None:
        write_file(path, json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def read(cls, path: str) -> "DraftVocabFile":
        """The file at ``path``, every field checked (`DataError` naming the file and the entry): ``ids`` a list
        of ``draft_vocab_size`` distinct JSON integers (no bool, float or string) in ``[0, target_vocab_size)``,
        increasing, as `choose_draft_ids` writes them."""
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError, RecursionError) as err:  # RecursionError: JSON nested too deep to decode
            raise DataError(f"{path}: not a readable draft vocabulary file ({type(err).__name__}: "
                            f"{' '.join(str(err).split())[:200]}).") from None
        if not isinstance(data, dict) or data.get("format") != DRAFT_VOCAB_FORMAT:
            raise DataError(f"{path}: not a draft vocabulary file (write one with tools/count_draft_vocab.py).")
        _check_file_fields(path, data)
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})
