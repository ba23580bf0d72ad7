"""A seeded slice of a chat data set's first user turns, as prompts for the target to answer.

`first_user_turns` reads a chat file (any format of `data/formats.py`; a JSON array cut mid-record keeps its
whole records, and bad records are skipped and named, `BadRecords("skip")`), keeps the records whose first
turn is the user's and whose text passes `FirstTurnFilter` (stated below), draws them in an order that only the
seed decides, and returns the first `n` whose length in the target's tokens is within the bounds: each a
`messages` record holding that user turn alone, for regeneration to answer (`decoding/regenerate.py`).
`write_first_turns` writes them as training-format JSONL. The same file, tokenizer, filter and seed give the
same slice.

The filter (`FirstTurnFilter`):
- the first message is a user turn (ShareGPT's scrape lost the opening human turn of many chats; a user turn
  that answers a lost one is no first turn);
- English by a simple heuristic: at least `min_ascii_share` of its non-space characters are ASCII, and at
  least `min_english_words` distinct words of `ENGLISH_WORDS` occur in it;
- the same text taken once (its first record in the file);
- `min_tokens` <= tokens of the text (the target's tokenizer, no special tokens, no chat template) <=
  `max_tokens`.
"""

from __future__ import annotations

import os
import random
import re
from dataclasses import dataclass
from typing import Callable, Optional

from ..common.errors import DataError
from ..data.formats import BadRecords, NormalizedRecord, read_records, write_records

ENGLISH_WORDS = frozenset("the and is are to of you your what how for in it that this with can me my".split())


@dataclass(frozen=True)
class FirstTurnFilter:
    min_tokens: int = 8
    max_tokens: int = 256
    min_ascii_share: float = 0.98
    min_english_words: int = 2

    def __post_init__(self):
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"first turns: need 1 <= min_tokens <= max_tokens, got {self.min_tokens}, {self.max_tokens}.")


def looks_english(text: str, rule: FirstTurnFilter = FirstTurnFilter()) -> bool:
    """The heuristic of `FirstTurnFilter`: mostly ASCII, and a few common English words."""
    chars = [c for c in text if not c.isspace()]
    if not chars or sum(c.isascii() for c in chars) < rule.min_ascii_share * len(chars):
        return False
    return len(ENGLISH_WORDS.intersection(re.findall(r"[a-z]+", text.lower()))) >= rule.min_english_words


def _candidates(path: str, rule: FirstTurnFilter, log) -> list:
    """(text, where, record id) of every record whose first turn is a distinct English user turn, in file order."""
    seen, out = set(), []
    for file, index, record in read_records(path, bad_records=BadRecords("skip"), log=log):
        if not record.is_chat or record.messages[0]["role"] != "user":
            continue
        text = record.messages[0]["content"].strip()
        if not text or text in seen or not looks_english(text, rule):
            continue
        seen.add(text)
        out.append((text, f"{os.path.basename(file)}[{index}]", record.fields.get("id")))
    return out


def first_user_turns(path: str, n: int, tokenizer, *, seed: int, rule: FirstTurnFilter = FirstTurnFilter(),
                     log: Callable[[str], None] = print) -> list:
    """`n` `NormalizedRecord`s (a user turn alone; fields `id`, `source`, `prompt_tokens`) drawn from `path` by
    `seed` under `rule`; `DataError` when fewer than `n` pass."""
    candidates = _candidates(path, rule, log)
    order = list(range(len(candidates)))
    random.Random(seed).shuffle(order)
    chosen = []
    for i in order:
        text, where, record_id = candidates[i]
        length = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if rule.min_tokens <= length <= rule.max_tokens:
            fields = {"source": where, "prompt_tokens": length}
            if record_id is not None:
                fields["id"] = record_id
            chosen.append(NormalizedRecord(style="messages", messages=[{"role": "user", "content": text}],
                                           fields=fields))
            if len(chosen) == n:
                return chosen
    raise DataError(f"{path}: only {len(chosen)} first user turns of {len(candidates)} English ones are "
                    f"{rule.min_tokens}..{rule.max_tokens} tokens long, {n} asked; ask fewer or widen the bounds.")


def write_first_turns(path: str, output: str, n: int, tokenizer, *, seed: int,
                      rule: FirstTurnFilter = FirstTurnFilter(), log: Callable[[str], None] = print) -> list:
    """`first_user_turns` written to `output` (JSONL `messages` records, published whole); returns them."""
    records = first_user_turns(path, n, tokenizer, seed=seed, rule=rule, log=log)
    write_records(output, records, style="messages")
    return records


def length_summary(records: list) -> Optional[dict]:
    """{count, min, median, p90, max, mean} of the records' `prompt_tokens`."""
    lengths = sorted(r.fields["prompt_tokens"] for r in records)
    if not lengths:
        return None
    pick = lambda q: lengths[min(len(lengths) - 1, int(q * len(lengths)))]  # noqa: E731
    return {"count": len(lengths), "min": lengths[0], "median": pick(0.5), "p90": pick(0.9), "max": lengths[-1],
            "mean": round(sum(lengths) / len(lengths), 1)}
