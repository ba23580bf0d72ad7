"""Unpickling checkpoint files without running code planted in them
(docs/design.md §14 Reliability guarantees).

A pickle names the functions and classes it calls while it is read; a crafted one names `os.system`
or any importable callable and runs it. megatron's `torch_dist` checkpoints hold three pickled
kinds of file: the `.metadata` of torch's distributed checkpoint (a plain pickle), `common.pt` and,
in checkpoints of earlier versions, the RNG state as a byte item of a `.distcp` file (both
`torch.save` archives). Every read of them goes through `RestrictedUnpickler`, whose `find_class`
admits only the types the checkpoint format needs and refuses anything else with
`RefusedCheckpointContent`, one line naming the file and the refused type. The allow-lists:

* `METADATA`: the `.metadata` classes of `torch.distributed.checkpoint` (`Metadata`, the storage
  and chunk descriptions, `_StorageInfo`), `torch.Size`, dtypes, layouts, `pathlib` paths;
* `TENSORS`: tensors (`torch._utils._rebuild_tensor_v2`; storages are torch's own), dtypes,
  `torch.Size`, `torch.device`, `OrderedDict`, `set` / `frozenset` / `complex` and the bytes codec
  of pickle protocol 2: what `common.pt` (iteration, scheduler, optimizer step, data position,
  arguments) holds;
* `LEGACY_RNG`: numpy arrays, for the RNG state that checkpoints of version 2 and earlier pickled
  (`random` / numpy / torch generator states); this version saves it as tensors.

The tensors of a checkpoint are read by torch with `weights_only=True` and need nothing here.
"""

from __future__ import annotations

import os
import pickle
import types
from typing import IO, Union

import torch

from ..common.errors import CheckpointError

__all__ = [
    "RefusedCheckpointContent",
    "RestrictedUnpickler",
    "METADATA",
    "TENSORS",
    "LEGACY_RNG",
    "unpickle",
    "torch_load",
]

# (module, name) of every global a checkpoint pickle may name, by the file kinds that need it.
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
METADATA = frozenset({
    (_DCP_METADATA, "Metadata"),
    (_DCP_METADATA, "MetadataIndex"),
    (_DCP_METADATA, "StorageMeta"),
    (_DCP_METADATA, "TensorStorageMetadata"),
    (_DCP_METADATA, "BytesStorageMetadata"),
    (_DCP_METADATA, "ChunkStorageMetadata"),
    (_DCP_METADATA, "TensorProperties"),
    (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    # StorageMeta.checkpoint_id: the directory the checkpoint was written to
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib._local", "PosixPath"),
    ("pathlib._local", "PurePosixPath"),
})
TENSORS = frozenset({
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch", "Size"),
    ("torch", "device"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "complex"),
    ("_codecs", "encode"),  # bytes objects in pickle protocol 2 (torch.save's)
})
LEGACY_RNG = frozenset({
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"),  # arrays pickled under numpy 1.x
    ("numpy._core.multiarray", "_reconstruct"),  # and under numpy 2.x
})


class RefusedCheckpointContent(CheckpointError):
    """A checkpoint file names a type outside the allow-list of its kind: it is not read."""


def _is_dtype(module: str, name: str) -> bool:
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


class RestrictedUnpickler(pickle.Unpickler):
    """`pickle.Unpickler` that resolves only the globals in `allowed` (and torch dtypes).

    `source` names the file (and item) in the refusal message."""

    def __init__(self, file: IO[bytes], *, source: str, allowed: frozenset, **kwargs):
        super().__init__(file, **kwargs)
        self.source = source
        self.allowed = allowed

    def find_class(self, module: str, name: str):
        if (module, name) in self.allowed or _is_dtype(module, name):
            return super().find_class(module, name)
        raise RefusedCheckpointContent(
            f"refusing to load {self.source}: it holds a pickled {module}.{name}, which is not a type of this "
            "checkpoint format (unpickling it could run code planted in the file); load only checkpoints from "
            "a source you trust, see the README's 'Trusting checkpoints'."
        )


def unpickle(file: IO[bytes], source: str, allowed: frozenset):
    """The object pickled in `file` (a plain pickle such as `.metadata`), through `RestrictedUnpickler`."""
    return RestrictedUnpickler(file, source=source, allowed=allowed).load()


def _pickle_module(source: str, allowed: frozenset) -> types.ModuleType:
    """A stand-in for the `pickle` module that `torch.load(pickle_module=...)` unpickles with:
    torch subclasses its `Unpickler` (keeping `find_class` for everything but storages, which it
    resolves itself) and calls its `load` for the records of the legacy format."""
    module = types.ModuleType("megatron_dflash_restricted_pickle")

    class Unpickler(RestrictedUnpickler):
        def __init__(self, file, **kwargs):
            super().__init__(file, source=source, allowed=allowed, **kwargs)

    module.Unpickler = Unpickler
    module.load = lambda file, **kwargs: Unpickler(file, **kwargs).load()
    return module


def torch_load(file: Union[str, IO[bytes]], source: str, allowed: frozenset = TENSORS):
    """`torch.load` of a checkpoint file (`common.pt`, a `.distcp` byte item) onto the CPU, every pickled
    global checked against `allowed` (the tensors' storages are torch's own)."""
    if os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in ("1", "y", "yes", "true"):
        # torch then refuses any pickle_module: its own weights-only unpickler, stricter still, reads the file
        return torch.load(file, map_location="cpu", weights_only=True)
    return torch.load(file, map_location="cpu", weights_only=False, pickle_module=_pickle_module(source, allowed))
