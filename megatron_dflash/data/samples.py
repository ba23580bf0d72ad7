"""One tokenised document (`Sample`) and its stable ID (docs/design.md §8 Data path).

The datasets produce samples and the batching consumes them. Sample IDs are hashes of (dataset kind, name,
index, content), never of Python's randomised ``hash``, so every rank and every run gives a sample the same ID.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Union

import numpy as np
import torch

__all__ = ["Sample", "stable_sample_id", "check_seq_length"]

_INT63 = (1 << 63) - 1


@dataclass(frozen=True)
class Sample:
    """One tokenised document.

    Attributes:
        input_ids: [L] int64 token ids, 1 <= L <= seq_length of the dataset.
        loss_mask: [L] bool, True on supervised tokens.
        sample_id: stable non-negative int63 ID (see ``stable_sample_id``).
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    sample_id: int

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def stable_sample_id(*parts: Union[str, bytes, int]) -> int:
    """A stable, non-negative int63 ID: blake2b of the parts, folded to 63 bits.

    Parts are strings (UTF-8), bytes or ints, each length-prefixed so that ``("ab", "c")`` and
    ``("a", "bc")`` differ. The result is the same on every machine, Python version and run (it does not
    use Python's randomised ``hash``).
    """
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        if isinstance(part, bool):
            raise TypeError("stable_sample_id parts must be str, bytes or int, not bool")
        if isinstance(part, (int, np.integer)):
            data, tag = str(int(part)).encode(), b"i"
        elif isinstance(part, str):
            data, tag = part.encode("utf-8"), b"s"
        elif isinstance(part, (bytes, bytearray)):
            data, tag = bytes(part), b"b"
        else:
            raise TypeError(f"stable_sample_id parts must be str, bytes or int, got {type(part).__name__}")
        h.update(tag + len(data).to_bytes(8, "little") + data)
    return int.from_bytes(h.digest(), "little") & _INT63


def check_seq_length(seq_length) -> int:
    """``seq_length`` if it is an int >= 1, else a `ValueError` saying so."""
    if isinstance(seq_length, bool) or not isinstance(seq_length, int) or seq_length < 1:
        raise ValueError(f"seq_length must be an int >= 1, got {seq_length!r}.")
    return seq_length
