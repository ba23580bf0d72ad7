"""The datasets: chat / text records (any file format of `data.formats`), Megatron indexed, and the embedded
job's synthetic chats (docs/design.md §8 Data path).

Each is a map-style dataset of `data.samples.Sample` (token ids, loss mask, stable sample ID), a pure
function of its files / seed. A record is checked when the data is scanned and again when it is read;
whatever is wrong with it is one `DataError` line naming the file and line (or index); bad records are
skipped or fatal by `BadRecords`. At most ``record_budget
(seq_length)`` characters of a record are tokenised.
"""

from __future__ import annotations

import abc
import dataclasses
import os
from typing import Any, Callable, Optional

import numpy as np
import torch

from ..common.errors import DataError
from ..embedded_job.synthetic_corpus import conversations
from .chat import ChatOptions, chat_roles, check_messages, one_line_error, render_chat, tokenize_chat, unicode_problem
from .formats import BAD_RECORD_MODES, DEFAULT_MAX_BAD_FRACTION, BadRecords, NormalizedRecord, normalize_record, open_records
from .samples import Sample, check_seq_length, stable_sample_id

__all__ = [
    "CHARS_PER_TOKEN",
    "record_budget",
    "one_line_error",
    "BAD_RECORD_MODES",
    "DEFAULT_MAX_BAD_FRACTION",
    "BadRecords",
    "ChatDataset",
    "TextDataset",
    "IndexedDataset",
    "SyntheticChatDataset",
]


# --------------------------------------------------------------------------------------------------
# Record budgets: how much of a record is tokenised
# --------------------------------------------------------------------------------------------------


# Characters of a record handed to the tokenizer per token of the sequence length (see ``record_budget``).
CHARS_PER_TOKEN = 32


def record_budget(seq_length: int) -> int:
    """Characters of one record handed to the tokenizer: ``CHARS_PER_TOKEN * seq_length``.

    A sample keeps the first ``seq_length`` tokens of its record, so tokenising all of a huge record (a
    30 MB line: a minute or more and gigabytes of memory per read) buys nothing. 32 characters per token
    is a generous upper bound of what ``seq_length`` tokens cover: BPE vocabularies average about 4
    characters per token on English prose and fewer on code and other scripts; only text made mostly of
    long runs (whitespace, repeated punctuation, words unknown to a word-level vocabulary) averages more,
    and a cut that leaves such a record short of ``seq_length`` tokens is reported (``_RecordDataset``).
    """
    return CHARS_PER_TOKEN * seq_length


def _cut_text(text: str, budget: int) -> str:
    """``text`` if it has at most ``budget`` characters, else its beginning, ending before a space.

    The cut falls just before the last space in ``text[budget // 2 : budget + 1]`` that follows a
    non-space character: the pre-tokenizers of byte-level BPE (GPT-2 / Llama-3 / Qwen patterns),
    SentencePiece (``▁`` starts a word) and word-level vocabularies all start a new piece at such a space
    (a piece carries a space only at its start), so every piece before the cut, and so every token, is the
    same as in the whole text. When the beginning holds more than ``seq_length`` tokens (ordinary text, by
    a wide margin, see ``record_budget``) the kept tokens are therefore bit-identical to those of the whole
    text. A "word" longer than half the budget is cut at the budget itself.
    """
    if len(text) <= budget:
        return text
    low = budget // 2
    cut = text.rfind(" ", low, budget + 1)
    while cut > low and text[cut - 1].isspace():
        cut = text.rfind(" ", low, cut)
    return text[:cut] if cut > low else text[:budget]


def _cut_chat(messages: list, budget: int) -> list:
    """The beginning of a chat whose message contents, plus ``CHARS_PER_TOKEN`` per message, fit in ``budget``
    characters (``messages`` itself when the whole chat fits).

    The cut is made in the message contents, not in the rendered conversation: the template still renders
    whole messages, so the role headers, end-of-turn tokens and ``{% generation %}`` spans (or, without
    markers, the rendered prefixes of ``assistant_mask_from_prefixes``) of the kept messages are the
    template's own, and every kept token has the loss mask the whole chat would give it. Cutting the
    rendered text or its tokens instead would lose the template's end of the cut turn, and a mask computed
    on a cut rendering would not be the template's. Each message is charged one token's worth of characters
    for its header besides its content, so a chat of millions of short messages is bounded too. The message
    in which the budget runs out keeps the beginning of its content (cut as ``_cut_text`` does, before a
    space) and the later messages are dropped. The kept tokens equal the whole chat's whenever the budget
    holds more than ``seq_length`` tokens and the template renders contents verbatim and earlier turns
    independently of later ones, which the prefix assistant mask assumes already.
    """
    left = budget
    for j, message in enumerate(messages):
        left -= CHARS_PER_TOKEN
        content = message["content"]
        if len(content) > left:
            if left <= 0 and j > 0:
                return messages[:j]
            return messages[:j] + [dict(message, content=_cut_text(content, max(left, 0)))]
        left -= len(content)
    return messages


# --------------------------------------------------------------------------------------------------
# Record datasets: chat and text records of any file format (bad ones by `formats.BadRecords`)
# --------------------------------------------------------------------------------------------------


def _make_sample(ids, mask, sample_id: int, seq_length: int) -> Sample:
    input_ids = torch.as_tensor(list(ids)[:seq_length] if not isinstance(ids, torch.Tensor) else ids[:seq_length])
    loss_mask = torch.as_tensor(list(mask)[:seq_length] if not isinstance(mask, torch.Tensor) else mask[:seq_length])
    return Sample(input_ids.to(torch.int64), loss_mask.to(torch.bool), sample_id)


class _RecordDataset(torch.utils.data.Dataset, abc.ABC):
    """Map-style dataset over the records of a data file or directory (`data.formats.open_records`).

    The records are scanned once at construction: every one is decoded, put in the one form
    (`formats.normalize_record`) and checked against the dataset's format, so its errors are clear
    ``file:line`` (``file[index]``) `DataError`s before training starts, and the bad ones are skipped or
    fatal by ``bad_records`` (`BadRecords`). Only indices are kept (a JSONL file: byte offsets), so memory
    stays small. Reading a sample decodes and checks its record again and tokenises at most ``record_budget
    (seq_length)`` characters of it; whatever fails in there (the chat template, the tokenizer) is a
    `DataError` naming the record, so a training loop meets one kind of error only. A record cut to the budget
    is reported through ``log``, once per record. Sample IDs hash the record's index in its path (the index
    among the non-blank lines of a JSONL file, bad records counted, so skipping one moves no other ID).
    """

    kind = "records"

    def __init__(self, path: str, seq_length: int, name: Optional[str] = None, log: Callable[[str], Any] = print,
                 bad_records: Optional[BadRecords] = None):
        self.path = os.fspath(path)
        self.seq_length = check_seq_length(seq_length)
        self.log = log
        self.bad_records = bad_records or BadRecords()
        self._reported_cuts: set[int] = set()
        if not os.path.exists(self.path):
            raise FileNotFoundError(f"{type(self).__name__}: {self.path} does not exist.")
        self.name = name if name is not None else os.path.basename(os.path.normpath(self.path))
        self.source = open_records(self.path)
        self._indices = np.asarray(self._scan(), dtype=np.int64)

    def _scan(self) -> list[int]:
        """Indices (in the source) of the usable records; the bad ones by `self.bad_records`."""
        kept = self.bad_records.scan(self.source, self._check, self.log)
        if not kept:
            raise DataError(f"{type(self).__name__}: {self.path} has no samples (empty or only blank lines).")
        return kept

    def _check(self, record: Any, where: str) -> NormalizedRecord:
        normalized = normalize_record(record, where)
        self._validate(normalized, where)
        return normalized

    @abc.abstractmethod
    def _validate(self, record: NormalizedRecord, where: str) -> None:
        """Raise `DataError` (naming ``where``) if ``record`` is not a sample of this dataset."""

    @abc.abstractmethod
    def _sample(self, index: int, raw: bytes, record: NormalizedRecord, where: str) -> Sample:
        """The sample of the checked ``record`` (named ``where``, bytes ``raw``) at source index ``index``."""

    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, index: int) -> Sample:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for {type(self).__name__} of {n} samples")
        source_index = int(self._indices[index % n])
        where = self.source.where(source_index)
        try:
            raw = self.source.raw(source_index)
            record = self._check(self.source.record(source_index), where)  # the file may have changed
            return self._sample(source_index, raw, record, where)
        except DataError:
            raise
        except Exception as err:  # the template's, the tokenizer's, ...: this record, named
            raise DataError(f"{where}: cannot tokenise the record ({one_line_error(err)}).") from err

    def sample_id(self, index: int, raw: bytes) -> int:
        return stable_sample_id(self.kind, self.name, index, raw.rstrip(b"\r\n"))

    def _report_cut(self, index: int, where: str, what: str, kept_chars: int, tokens: int) -> None:
        """Say (once per record) that ``what`` was cut to ``kept_chars`` characters and gave ``tokens`` tokens."""
        if index in self._reported_cuts:
            return
        self._reported_cuts.add(index)
        short = (f"; they give only {tokens} of the {self.seq_length} tokens a sample holds (more than "
                 f"{CHARS_PER_TOKEN} characters per token)" if tokens < self.seq_length else "")
        self.log(f"[data] {where}: {what} cut to {kept_chars} characters before tokenising "
                 f"({CHARS_PER_TOKEN} per token of seq_length {self.seq_length}){short}.")

    def _text_sample(self, index: int, raw: bytes, text: str, where: str) -> Sample:
        """A text record's sample: loss on every token, EOS at the end of a whole document (``append_eos``)."""
        kept = _cut_text(text, record_budget(self.seq_length))
        ids = [int(t) for t in self.tokenizer(kept)["input_ids"]]
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if self.append_eos and eos is not None and len(kept) == len(text) and (not ids or ids[-1] != eos):
            ids.append(int(eos))
        if not ids:
            raise DataError(f"{where}: the text tokenises to no tokens.")
        if len(kept) < len(text):
            self._report_cut(index, where, f"the text of {len(text)} characters", len(kept), len(ids))
        return _make_sample(ids, [1] * len(ids), self.sample_id(index, raw), self.seq_length)


def _check_text(text: str, where: str) -> None:
    problem = unicode_problem(text)
    if problem is not None:
        raise DataError(f"{where}: the text {problem}.")


def ends_in_cut_answer(record: NormalizedRecord, kept: list) -> bool:
    """Whether ``kept`` (the beginning of ``record``'s chat that fits, `_cut_chat`) ends in an assistant answer
    the target did not end: cut here to fit, or the record's last answer, cut at the regeneration's
    ``max_new_tokens`` (``finish_reason`` "length", `decoding.regenerate`). Such a chat is trained without the
    end of turn the template would close it with (`chat.open_end`). A record regenerated with ``--on-truncated
    continue`` whose cut answer is an earlier one keeps that answer's end of turn: the target's next turn was
    asked after it."""
    if not kept or kept[-1].get("role") != "assistant":
        return False
    last = len(kept) - 1
    if kept[last]["content"] != record.messages[last]["content"]:
        return True
    return len(kept) == len(record.messages) and record.fields.get("finish_reason") == "length"


class ChatDataset(_RecordDataset):
    """Chats and text, the format detected per record (`data.formats`): OpenAI ``messages``, ShareGPT
    ``conversations`` or plain ``text``, in JSONL, JSON-array, Parquet or ``save_to_disk`` files.

    A chat's roles are those of ``chat_roles(tokenizer)`` (system, user, assistant, and tool when the template
    names it) and its contents strings; it must render with the chat template (a template that refuses the
    turn order makes the record bad). Tokenised by ``tokenize_chat`` with ``options`` (`ChatOptions`: template
    kwargs, thinking, the turns the loss covers); truncated to ``seq_length`` tokens, of which at most
    ``record_budget(seq_length)`` characters are rendered (see ``_cut_chat``). A text record is a text sample
    (loss on every token, as in `TextDataset`).
    Sample ID: ``stable_sample_id("chat", name, index, record)`` with ``name`` the path's base name and
    ``record`` the JSONL line (or the record's canonical JSON).
    """

    kind = "chat"

    def __init__(self, path: str, tokenizer, seq_length: int, *, name: Optional[str] = None,
                 options: Optional[ChatOptions] = None, append_eos: bool = True,
                 bad_records: Optional[BadRecords] = None, log: Callable[[str], Any] = print):
        self.tokenizer = tokenizer
        self.options = options or ChatOptions()
        self.append_eos = append_eos
        self.roles = chat_roles(tokenizer)  # and fail early without a template
        super().__init__(path, seq_length, name, log, bad_records)

    def _validate(self, record: NormalizedRecord, where: str) -> None:
        if not record.is_chat:
            return _check_text(record.text, where)
        check_messages(record.messages, f"{where} ('{record.style}')", self.roles)
        try:
            render_chat(self.tokenizer, _cut_chat(record.messages, record_budget(self.seq_length)), self.options)
        except Exception as err:  # raise_exception() of a template that refuses the turn order, ...
            raise DataError(f"{where}: the chat template refuses the conversation ({one_line_error(err)}).") from None
        return None

    def _sample(self, index: int, raw: bytes, record: NormalizedRecord, where: str) -> Sample:
        if not record.is_chat:
            return self._text_sample(index, raw, record.text, where)
        messages = record.messages
        kept = _cut_chat(messages, record_budget(self.seq_length))
        try:
            ids, mask = tokenize_chat(self.tokenizer, kept, options=self.options,
                                      cut_answer=ends_in_cut_answer(record, kept))
        except ValueError as err:
            raise DataError(f"{where}: {one_line_error(err)}.") from None
        if not ids:
            raise DataError(f"{where}: the chat renders to no tokens.")
        if kept is not messages:
            chars = sum(len(m["content"]) for m in messages)
            self._report_cut(index, where, f"the chat's {chars} characters of content in {len(messages)} messages",
                             sum(len(m["content"]) for m in kept), len(ids))
        return _make_sample(ids, mask, self.sample_id(index, raw), self.seq_length)


class TextDataset(_RecordDataset):
    """Plain text, ``{"text": ...}`` records of any file format (`data.formats`); loss on every token; truncated
    to ``seq_length``, of which at most ``record_budget(seq_length)`` characters are tokenised (see ``_cut_text``).

    ``append_eos`` ends each document with the tokenizer's EOS (when it has one), so packed documents
    are separated like Megatron's ``--append-eod`` (not a cut one: it does not end there).
    Sample ID: ``stable_sample_id("text", name, index, record)``.
    """

    kind = "text"

    def __init__(self, path: str, tokenizer, seq_length: int, *, name: Optional[str] = None,
                 append_eos: bool = True, bad_records: Optional[BadRecords] = None,
                 log: Callable[[str], Any] = print):
        self.tokenizer = tokenizer
        self.append_eos = append_eos
        super().__init__(path, seq_length, name, log, bad_records)

    def _validate(self, record: NormalizedRecord, where: str) -> None:
        if record.is_chat:
            raise DataError(f"{where}: no text (a {record.style} chat; use --data-format chat for chats).")
        _check_text(record.text, where)

    def _sample(self, index: int, raw: bytes, record: NormalizedRecord, where: str) -> Sample:
        return self._text_sample(index, raw, record.text, where)


# --------------------------------------------------------------------------------------------------
# Megatron indexed dataset
# --------------------------------------------------------------------------------------------------


class IndexedDataset(torch.utils.data.Dataset):
    """Pre-tokenised Megatron indexed dataset (``prefix.bin`` / ``prefix.idx``): one sample per document.

    A document is the concatenation of its sequences (``document_indices``); only the first
    ``seq_length`` tokens are read. Loss on every token.
    Sample ID: ``stable_sample_id("indexed", name, document index)``, ``name`` = base name of the prefix.
    """

    kind = "indexed"

    def __init__(self, path_prefix: str, seq_length: int, *, name: Optional[str] = None, mmap: bool = True):
        from megatron.core.datasets.indexed_dataset import IndexedDataset as _MegatronIndexedDataset

        self.path_prefix = os.fspath(path_prefix)
        self.seq_length = check_seq_length(seq_length)
        missing = [p for p in (self.path_prefix + ".idx", self.path_prefix + ".bin") if not os.path.isfile(p)]
        if missing:
            raise FileNotFoundError(
                f"IndexedDataset: {', '.join(missing)} does not exist (expected the Megatron indexed dataset "
                f"files {self.path_prefix}.bin and {self.path_prefix}.idx)."
            )
        self.name = name if name is not None else os.path.basename(self.path_prefix)
        self.dataset = _MegatronIndexedDataset(self.path_prefix, mmap=mmap)
        self._doc_index = np.asarray(self.dataset.document_indices, dtype=np.int64)
        self._lengths = np.asarray(self.dataset.sequence_lengths, dtype=np.int64)
        if len(self) == 0:
            raise ValueError(f"IndexedDataset: {self.path_prefix} has no documents.")

    def __len__(self) -> int:
        return max(0, len(self._doc_index) - 1)

    def __getitem__(self, index: int) -> Sample:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for IndexedDataset of {n} documents")
        index %= n
        parts, left = [], self.seq_length
        for seq in range(int(self._doc_index[index]), int(self._doc_index[index + 1])):
            if left <= 0:
                break
            take = min(left, int(self._lengths[seq]))
            if take > 0:
                parts.append(np.asarray(self.dataset.get(seq, 0, take), dtype=np.int64))
                left -= take
        ids = torch.from_numpy(np.concatenate(parts)) if parts else torch.zeros(0, dtype=torch.int64)
        if ids.numel() == 0:
            raise ValueError(f"IndexedDataset: document {index} of {self.path_prefix} has no tokens.")
        sid = stable_sample_id(self.kind, self.name, index)
        return Sample(ids, torch.ones(ids.shape[0], dtype=torch.bool), sid)


# --------------------------------------------------------------------------------------------------
# Synthetic chats (the embedded default job)
# --------------------------------------------------------------------------------------------------


class SyntheticChatDataset(torch.utils.data.Dataset):
    """``count`` chats of ``embedded_job.synthetic_corpus.conversations(seed, count)``.

    Use a different seed for a held-out split (IDs include the seed, so splits never share IDs).
    Sample ID: ``stable_sample_id("synthetic-chat", seed, index)``.
    """

    kind = "synthetic-chat"

    def __init__(self, seed: int, count: int, tokenizer, seq_length: int, *, assistant_mask: str = "auto",
                 options: Optional[ChatOptions] = None):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"SyntheticChatDataset: count must be an int >= 1, got {count!r}.")
        self.seed = int(seed)
        self.tokenizer = tokenizer
        self.seq_length = check_seq_length(seq_length)
        self.options = dataclasses.replace(options or ChatOptions(), assistant_mask=assistant_mask)
        self.chats = list(conversations(self.seed, count))

    def __len__(self) -> int:
        return len(self.chats)

    def __getitem__(self, index: int) -> Sample:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for SyntheticChatDataset of {n} chats")
        index %= n
        ids, mask = tokenize_chat(self.tokenizer, self.chats[index], options=self.options)
        return _make_sample(ids, mask, stable_sample_id(self.kind, self.seed, index), self.seq_length)
