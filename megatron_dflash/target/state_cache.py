"""The cache of the target's states on disk: what the draft's training reads from the target, per sample
(docs/design.md §8 Data path, "Training from cached target states").

Layout of a cache directory::

    manifest.json               what the states are of (`CacheManifest`): written first, compared by every reader
    train-00000.safetensors     the samples of training indices [0, shard_size), then [shard_size, 2 x shard_size), ...
    valid-00000.safetensors     the same for the validation samples
    index.json                  every shard's sha256 (written last: its presence = complete)
    staged/<id>.safetensors     ``--dflash-target-cache-mode hybrid`` only: one sample's states, staged as the first
                                epoch computes them and gathered into the shards at its end (then removed)

A shard holds, for each of its samples (keyed by the stable sample id, so any plan, batch size, DP or TP size
reads it), ``<id>.input_ids [L]`` int64 (checked against the batch on reading), ``<id>.taps [L, taps * H]`` and,
when a loss reads it, ``<id>.final [L, H]`` (the target's final normed hidden state), ``L`` the sample's real
tokens (no padding). Shards are safetensors files: reading them never unpickles anything. Each shard is written
whole (`common.atomic.write_file`: staged sibling, one rename), so a killed writer leaves complete shards and
staged temporaries only; the rerun removes the temporaries and writes the missing shards, and the bytes written
are a pure function of the states (no time stamps), so the result equals an uninterrupted run's.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Iterable, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save as save_safetensors

from ..common.atomic import file_sha256, temporary_of, write_file
from ..common.errors import DataError

__all__ = [
    "CACHE_FORMAT_VERSION", "MANIFEST_NAME", "INDEX_NAME", "CacheManifest", "StateCacheError", "shard_name",
    "shard_ranges", "read_manifest", "publish_manifest", "write_shard", "remove_stale_temporaries",
    "missing_shards", "write_index", "StateCacheReader", "bytes_per_token", "STAGING_DIR",
    "stage_sample", "is_staged", "read_staged", "remove_staging", "is_complete",
]

CACHE_FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
INDEX_NAME = "index.json"
STAGING_DIR = "staged"
SPLITS = ("train", "valid")


class StateCacheError(DataError):
    """A cache that cannot serve this run: a differing manifest, an incomplete cache, a corrupt shard."""


@dataclass(frozen=True)
class CacheManifest:
    """What a cache holds. Every field is compared with the run's (`mismatch`), except ``samples`` (derived)."""

    format_version: int
    target: str                 # fingerprint of the target: config.json and the safetensors headers
    target_layer_ids: tuple
    hidden_size: int
    final_hidden: bool          # whether the target's final hidden state is stored
    dtype: str                  # "float32" or "bfloat16"
    seq_length: int
    packing: bool
    data: str                   # fingerprint of the samples (`training.target_cache.data_fingerprint`)
    shard_size: int
    samples: dict               # split -> number of samples

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "CacheManifest":
        fields = json.loads(text)
        fields["target_layer_ids"] = tuple(fields["target_layer_ids"])
        return cls(**fields)

    def mismatch(self, run: "CacheManifest") -> Optional[str]:
        """The first field whose value differs from the run's, as ``field: cache X, run Y`` (None: usable).
        A cache with the final hidden state serves a run that does not read it."""
        for name in ("format_version", "target", "target_layer_ids", "hidden_size", "dtype", "seq_length",
                     "packing", "data", "samples", "final_hidden"):
            mine, theirs = getattr(self, name), getattr(run, name)
            if name == "final_hidden" and (mine or not theirs):
                continue
            if mine != theirs:
                return f"{name}: cache {mine!r}, run {theirs!r}"
        return None

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def bytes_per_token(manifest: CacheManifest) -> int:
    """Bytes of one token's states: (taps + final) x hidden x bytes per element (+ its int64 token id)."""
    width = len(manifest.target_layer_ids) + int(manifest.final_hidden)
    return width * manifest.hidden_size * manifest.torch_dtype.itemsize + 8


def shard_name(split: str, k: int) -> str:
    return f"{split}-{k:05d}.safetensors"


def shard_ranges(samples: int, shard_size: int) -> list[range]:
    """The sample index ranges of a split's shards, in order."""
    return [range(a, min(a + shard_size, samples)) for a in range(0, samples, shard_size)]


def _sample_key(sample_id: int) -> str:
    """A sample's name in a shard and in the staging directory: its id, zero-padded (names sort as ids)."""
    return f"{int(sample_id):019d}"


def _sample_tensors(states: tuple, prefix: str = "") -> dict:
    """``(input_ids [L], taps [L, T*H], final [L, H] or None)`` as the tensors of a safetensors file."""
    input_ids, taps, final = states
    tensors = {f"{prefix}input_ids": input_ids.to(torch.int64).contiguous(), f"{prefix}taps": taps.contiguous()}
    if final is not None:
        tensors[f"{prefix}final"] = final.contiguous()
    return tensors


def read_manifest(directory: str) -> Optional[CacheManifest]:
    """The manifest of `directory`, None when there is none (a refusal when it cannot be read)."""
    path = os.path.join(directory, MANIFEST_NAME)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return CacheManifest.from_json(f.read())
    except (ValueError, TypeError, KeyError) as err:
        raise StateCacheError(f"{path} is not a target-state cache manifest ({err}); remove the directory "
                              "and write the cache again.") from None


def check_manifest(directory: str, run: CacheManifest) -> Optional[CacheManifest]:
    """The cache's manifest if it matches the run's (None: no manifest yet); else one line naming the field."""
    found = read_manifest(directory)
    if found is None:
        return None
    field = found.mismatch(run)
    if field is not None:
        raise StateCacheError(f"the target-state cache {directory} does not match this run ({field}); use another "
                              "--dflash-target-cache directory or write the cache again for this run.")
    return found


def publish_manifest(directory: str, run: CacheManifest) -> None:
    """Create `directory` and its manifest (atomically), unless a matching one is there (a differing one is refused)."""
    os.makedirs(directory, exist_ok=True)
    if check_manifest(directory, run) is None:
        write_file(os.path.join(directory, MANIFEST_NAME), run.to_json())


def remove_stale_temporaries(directory: str, names: Iterable[str]) -> None:
    """Remove the staged copies a killed writer left of the files `names` (only those: another rank may be
    writing its own shards)."""
    names = set(names)
    for entry in os.listdir(directory):
        if temporary_of(entry) in names:
            os.unlink(os.path.join(directory, entry))


def missing_shards(directory: str, split: str, ranges: list[range]) -> list[int]:
    """The shards of `split` not on disk (a shard on disk is complete: it was published by one rename)."""
    return [k for k in range(len(ranges)) if not os.path.isfile(os.path.join(directory, shard_name(split, k)))]


def write_shard(directory: str, split: str, k: int, states: dict) -> None:
    """Write shard `k` of `split` whole: ``states`` maps a sample id to ``(input_ids [L], taps [L, T*H],
    final [L, H] or None)``, already in the cache's dtype."""
    tensors = {}
    for sample_id, sample in states.items():
        tensors.update(_sample_tensors(sample, f"{_sample_key(sample_id)}."))
    write_file(os.path.join(directory, shard_name(split, k)), save_safetensors(tensors))


def write_index(directory: str, manifest: CacheManifest) -> None:
    """``index.json``: every shard's sha256, written once all shards are on disk (its presence: complete)."""
    shards = {}
    for split in SPLITS:
        for k in range(len(shard_ranges(manifest.samples.get(split, 0), manifest.shard_size))):
            name = shard_name(split, k)
            shards[name] = file_sha256(os.path.join(directory, name))
    write_file(os.path.join(directory, INDEX_NAME), json.dumps({"shards": shards}, indent=1, sort_keys=True) + "\n")


def is_complete(directory: str) -> bool:
    """Whether `directory` holds a complete cache (its ``index.json``, written last)."""
    return os.path.isfile(os.path.join(directory, INDEX_NAME))


def _staged_path(directory: str, sample_id: int) -> str:
    return os.path.join(directory, STAGING_DIR, f"{_sample_key(sample_id)}.safetensors")


def stage_sample(directory: str, sample_id: int, states: tuple) -> None:
    """Stage one sample's ``(input_ids [L], taps [L, T*H], final [L, H] or None)`` (already in the cache's dtype)
    as its own file, written whole (a killed writer leaves no partial file under the final name)."""
    os.makedirs(os.path.join(directory, STAGING_DIR), exist_ok=True)
    write_file(_staged_path(directory, sample_id), save_safetensors(_sample_tensors(states)))


def is_staged(directory: str, sample_id: int) -> bool:
    return os.path.isfile(_staged_path(directory, sample_id))


def read_staged(directory: str, sample_id: int, final_hidden: bool) -> Optional[tuple]:
    """A staged sample's states (`stage_sample`), None when it was not staged."""
    if not is_staged(directory, sample_id):
        return None
    with safe_open(_staged_path(directory, sample_id), framework="pt") as f:
        return f.get_tensor("input_ids"), f.get_tensor("taps"), f.get_tensor("final") if final_hidden else None


def remove_staging(directory: str) -> None:
    """Remove the staged samples once the shards hold them."""
    staging = os.path.join(directory, STAGING_DIR)
    if os.path.isdir(staging):
        for entry in os.listdir(staging):
            os.unlink(os.path.join(staging, entry))
        os.rmdir(staging)


class StateCacheReader:
    """The states of any sample of a complete cache, by sample id; a shard is checked against its sha256 the
    first time it is read (a corrupt shard is named), and then read through safetensors' memory map."""

    def __init__(self, directory: str, run: CacheManifest):
        self.directory = directory
        self.manifest = check_manifest(directory, run)
        if self.manifest is None:
            raise StateCacheError(f"{directory} holds no target-state cache ({MANIFEST_NAME} is missing); write it "
                                  "with tools/cache_target_states.py or --dflash-target-cache-mode write.")
        index = os.path.join(directory, INDEX_NAME)
        if not os.path.isfile(index):
            raise StateCacheError(f"the target-state cache {directory} is incomplete (no {INDEX_NAME}); rerun "
                                  "tools/cache_target_states.py with the same arguments to finish it.")
        with open(index) as f:
            self.checksums = json.load(f)["shards"]
        self.where: dict[int, str] = {}
        for name in sorted(self.checksums):
            path = os.path.join(directory, name)
            try:
                with safe_open(path, framework="pt") as shard:
                    keys = list(shard.keys())
            except Exception as err:  # noqa: BLE001 - a damaged header: name the shard
                raise self.corrupt(name, f"its header cannot be read ({err})") from None
            for key in keys:
                if key.endswith(".input_ids"):
                    self.where[int(key.split(".")[0])] = name
        self._open: dict[str, object] = {}

    def corrupt(self, name: str, why: str) -> StateCacheError:
        return StateCacheError(f"shard {name} of the target-state cache {self.directory} is corrupt: {why}; "
                               "delete it and its index.json and rerun tools/cache_target_states.py to rewrite it.")

    def _shard(self, name: str):
        shard = self._open.get(name)
        if shard is None:
            path = os.path.join(self.directory, name)
            if file_sha256(path) != self.checksums[name]:
                raise self.corrupt(name, "its sha256 differs from the one in index.json")
            shard = self._open[name] = safe_open(path, framework="pt")
        return shard

    def sample(self, sample_id: int) -> tuple:
        """``(input_ids [L], taps [L, T*H], final [L, H] or None)`` of a sample, in the cache's dtype."""
        name = self.where.get(int(sample_id))
        if name is None:
            raise StateCacheError(f"sample {int(sample_id)} is not in the target-state cache {self.directory}: the "
                                  "cache was written for other data; write it again for this run.")
        shard, key = self._shard(name), _sample_key(sample_id)
        final = shard.get_tensor(f"{key}.final") if self.manifest.final_hidden else None
        return shard.get_tensor(f"{key}.input_ids"), shard.get_tensor(f"{key}.taps"), final
