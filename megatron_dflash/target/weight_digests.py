"""What the target's cached states are a function of: the sha256 of each of its tensors' bytes, computed once per
safetensors file and kept (docs/design.md §8 Data path, "Training from cached target states").

`weights_fingerprint(target_dir, last_layer)` is the target field of a target-state cache's manifest: the target's
``config.json`` and, for every tensor the cached states depend on, its name, dtype, shape and the digest of its
bytes. The states of decoder layer ``i`` (a tap) depend on the embeddings and layers ``0..i``; the final hidden
state on every layer and the final norm. So, given ``last_layer`` (the highest tapped layer, None when the final
hidden state is cached: every tensor), a tensor named ``...layers.<n>....`` with ``n > last_layer`` is left out,
and every other tensor is in (the embedding, the norms, the output head: the head is read from the target itself
when training from the cache, so it would not need to be, but which tensors are "the head" differs per family,
and counting it in costs nothing but a refusal of a cache after a head-only fine-tune).

Digesting reads each file whole once (about a minute for 16 GB at disk speed); the digests are then kept in
``$MEGATRON_DFLASH_CACHE/weight-digests`` (default ``~/.cache/megatron_dflash``), one small JSON file per
safetensors file, named by the sha256 of its real path and valid while the file's size, modification time
(ns) and header are those recorded. They are kept there rather than beside the target because a target
directory is an input (often shared, read-only, or a HF hub snapshot whose files link into a blob store the
hub manages) and the project never writes into its inputs. A file rewritten in place (a fine-tune saved over
the original) changes its modification time, so it is digested again; a store that cannot be written is only
a cost (the digests are computed on every run).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Optional

from ..common.atomic import write_file
from ..common.errors import RunError
from ..common.safetensors_files import safetensors_header_bytes, target_safetensors_files
from ..embedded_job.tiny_target import default_cache_dir

__all__ = ["weights_fingerprint", "tensor_digests", "digest_store_dir"]

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_STORE_VERSION = 1


def digest_store_dir() -> str:
    """Where the kept digests live (``$MEGATRON_DFLASH_CACHE/weight-digests``)."""
    return os.path.join(default_cache_dir(), "weight-digests")


def _header(path: str) -> tuple[bytes, dict]:
    """The header of the safetensors file `path`, as stored and parsed (a file that is none: one line)."""
    try:
        raw = safetensors_header_bytes(path)
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        for name, meta in header.items():
            if name != "__metadata__" and not (
                    isinstance(meta, dict) and isinstance(meta.get("dtype"), str)
                    and isinstance(meta.get("shape"), list)
                    and isinstance(meta.get("data_offsets"), list) and len(meta["data_offsets"]) == 2
                    and all(isinstance(o, int) and o >= 0 for o in meta["data_offsets"])):
                raise ValueError(f"tensor {name!r} has no dtype, shape and two data_offsets")
    except (OSError, ValueError, RecursionError) as err:
        raise RunError(f"{path}: not a readable safetensors file ({err}); save the target again with "
                       "save_pretrained(safe_serialization=True).") from None
    return raw, header


def _read_digests(path: str, raw: bytes, header: dict) -> dict:
    """name -> sha256 of the tensor's bytes, reading `path` once in 1 MiB pieces."""
    start = 8 + len(raw)
    spans = sorted((meta["data_offsets"][0], meta["data_offsets"][1], name) for name, meta in header.items()
                   if name != "__metadata__")
    out = {}
    with open(path, "rb") as f:
        for begin, end, name in spans:
            f.seek(start + begin)
            digest, left = hashlib.sha256(), end - begin
            while left > 0:
                chunk = f.read(min(left, 1 << 20))
                if not chunk:
                    raise RunError(f"{path} is truncated (tensor {name} ends past the end of the file); save the "
                                   "target again.")
                digest.update(chunk)
                left -= len(chunk)
            out[name] = digest.hexdigest()
    return out


def tensor_digests(path: str) -> dict:
    """name -> (dtype, shape, sha256 of its bytes) of every tensor of the safetensors file `path`, read from the
    store when its record matches the file (size, mtime_ns, header), else computed and kept."""
    raw, header = _header(path)
    st = os.stat(path)
    key = {"version": _STORE_VERSION, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
           "header_sha256": hashlib.sha256(raw).hexdigest()}
    store_name = hashlib.sha256(os.path.realpath(path).encode("utf-8", "surrogateescape")).hexdigest()
    store = os.path.join(digest_store_dir(), store_name + ".json")
    names = set(header) - {"__metadata__"}
    digests = None
    try:
        with open(store) as f:
            kept = json.load(f)
        tensors = kept.get("tensors") if isinstance(kept, dict) and kept.get("key") == key else None
        if isinstance(tensors, dict) and set(tensors) == names and all(
                isinstance(v, str) and len(v) == 64 for v in tensors.values()):
            digests = tensors
    except (OSError, ValueError, RecursionError):
        pass  # none kept yet, or unreadable: computed again
    if digests is None:
        digests = _read_digests(path, raw, header)
        try:
            os.makedirs(os.path.dirname(store), exist_ok=True)
            write_file(store, json.dumps({"key": key, "file": os.path.realpath(path), "tensors": digests},
                                         sort_keys=True) + "\n")
        except OSError:
            pass  # a store that cannot be written: the digests are computed again next time
    return {name: (header[name]["dtype"], header[name]["shape"], digests[name]) for name in names}


def _counts(name: str, last_layer: Optional[int]) -> bool:
    """Whether the cached states depend on the tensor `name` (see the module docstring)."""
    match = _LAYER.search(name)
    return last_layer is None or match is None or int(match.group(1)) <= last_layer


def weights_fingerprint(target_dir: str, last_layer: Optional[int]) -> str:
    """sha256 of the target's ``config.json`` and of the name, dtype, shape and bytes' digest of every tensor the
    states of layers ``0..last_layer`` depend on (`last_layer` None: every tensor; the final hidden state)."""
    digest = hashlib.sha256()
    config = os.path.join(target_dir, "config.json")
    try:
        with open(config, "rb") as f:
            digest.update(json.dumps(json.load(f), sort_keys=True).encode())
    except (OSError, ValueError, RecursionError) as err:
        raise RunError(f"{config}: cannot be read as JSON ({err}); the target directory needs its config.json.") \
            from None
    for path in target_safetensors_files(target_dir):
        digest.update(os.path.basename(path).encode())
        for name, (dtype, shape, sha) in sorted(tensor_digests(path).items()):
            if _counts(name, last_layer):
                digest.update(json.dumps([name, dtype, shape, sha]).encode())
    return digest.hexdigest()
