"""Where the tensors of a HF checkpoint directory are: `model.safetensors`, or the shards its
`model.safetensors.index.json` names. The one discovery that draft checkpoints and target weights share
(docs/design.md §11 HF export format, §14 Reliability guarantees: an index names only files of its directory).
A target whose weights are pickles only (`pytorch_model.bin`) is refused here, for every loader, in one line
(`TargetWeightsError`): unpickling can run code, and is never tried.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from .errors import RunError

__all__ = [
    "TargetWeightsError",
    "pickled_weights",
    "refuse_pickled_weights",
    "SAFETENSORS_NAME",
    "SAFETENSORS_INDEX_NAME",
    "safetensors_index_files",
    "safetensors_files",
    "target_safetensors_files",
    "safetensors_header_bytes",
]

SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"


def safetensors_index_files(index: str) -> list[str]:
    """The shard files that the sharded-save index `index` (`model.safetensors.index.json`) names, as
    paths in its directory.

    Raises:
        ValueError: an entry of its `weight_map` is an absolute path or leads out of the directory
            (`..`): a checkpoint only reads its own files. (The entries themselves may be symbolic
            links, as in the HF hub cache, whose snapshot files link to its blob store.)
    """
    directory = os.path.dirname(index)
    with open(index) as f:
        weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index} has no weight_map object; not a safetensors index.")
    files = []
    for name in sorted(set(weight_map.values()), key=str):
        normal = os.path.normpath(name) if isinstance(name, str) and name else ""
        if not normal or os.path.isabs(normal) or normal == os.curdir or normal.split(os.sep)[0] == os.pardir:
            raise ValueError(
                f"{index} names the shard {name!r}, which is not a file in {directory or os.curdir}; refusing to "
                "read it (the weight_map may only name files of the checkpoint directory)."
            )
        files.append(os.path.join(directory, name))
    return files


def safetensors_files(directory: str, missing: Optional[str] = None) -> list[str]:
    """The safetensors files of the HF directory `directory`, drafts and targets alike: `model.safetensors`,
    else the shards its `model.safetensors.index.json` names (`safetensors_index_files`); HF's own order.

    Raises:
        FileNotFoundError: neither exists; `missing` is the message (default: the draft's).
        ValueError: the index names a file outside `directory`.
    """
    single = os.path.join(directory, SAFETENSORS_NAME)
    index = os.path.join(directory, SAFETENSORS_INDEX_NAME)
    if os.path.isfile(single):
        return [single]
    if os.path.isfile(index):  # a sharded HF save
        return safetensors_index_files(index)
    raise FileNotFoundError(missing or (
        f"{directory} has neither {SAFETENSORS_NAME} nor {SAFETENSORS_INDEX_NAME}: not a HF draft "
        "checkpoint in safetensors format."
    ))


class TargetWeightsError(RunError, FileNotFoundError):
    """A target directory without safetensors weights (none, or pickled `.bin` files only)."""


_PICKLED = (".bin", ".bin.index.json")  # transformers' pickled weights: pytorch_model.bin, its shards, their index


def pickled_weights(directory: str) -> Optional[str]:
    """The pickled weights file of the directory `directory` that a loader would unpickle (the shards' index, else
    the first `.bin`), when it holds no safetensors weights; None otherwise (or when it is no directory)."""
    if not os.path.isdir(directory) or any(os.path.isfile(os.path.join(directory, name))
                                           for name in (SAFETENSORS_NAME, SAFETENSORS_INDEX_NAME)):
        return None
    found = sorted(name for name in os.listdir(directory) if name.endswith(_PICKLED))
    index = [name for name in found if name.endswith(".index.json")]
    return os.path.join(directory, (index or found)[0]) if found else None


def refuse_pickled_weights(directory: str) -> None:
    """Raise `TargetWeightsError` (one line: the file and the conversion to do) when the target directory
    `directory` holds its weights as pickles only; nothing is unpickled. A directory without weights at all
    passes here (`target_safetensors_files` names that when the weights are read)."""
    pickled = pickled_weights(directory)
    if pickled is not None:
        raise TargetWeightsError(
            f"{pickled}: the target's weights are a pickle, which is never loaded (unpickling can run code); "
            "convert them to safetensors (AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(NEW_DIR) writes "
            "model.safetensors; only for a file you trust) and pass that directory.")


def target_safetensors_files(directory: str) -> list[str]:
    """`safetensors_files` of a HF target directory (HF and megatron backends alike); a `TargetWeightsError` with
    the target's message when there are none (`refuse_pickled_weights`'s when there are pickles instead)."""
    refuse_pickled_weights(directory)
    try:
        return safetensors_files(directory)
    except FileNotFoundError:
        raise TargetWeightsError(
            f"{directory} holds no model.safetensors or model.safetensors.index.json; save the target with "
            "save_pretrained(safe_serialization=True).") from None


def safetensors_header_bytes(path: str) -> bytes:
    """The JSON header of the safetensors file `path`, as stored (its first 8 bytes give its length, little
    endian; the tensors' data follows it): names, dtypes, shapes and offsets without reading any tensor."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if length > os.fstat(f.fileno()).st_size - 8:  # a damaged file: never a read of its claimed length
            raise ValueError(f"{path} is not a safetensors file: its header length {length} exceeds the file.")
        return f.read(length)
