"""The cache of the target's states on disk: what the draft's training reads from the target, per sample
(docs/design.md §8 Data path, "Training from cached target states").

Layout of a cache directory::

    manifest.json               what the states are of (`CacheManifest`): written first, compared by every reader
    train-00000.safetensors     the samples of training indices [0, shard_size), then [shard_size, 2 x shard_size), ...
    valid-00000.safetensors     the same for the validation samples
    index.json                  every shard's sha256 and its header's (written last: its presence = complete)
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

import dataclasses
import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass
from typing import Iterable, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save as save_safetensors

from ..common.atomic import file_sha256, temporary_of, write_file
from ..common.errors import DataError
from ..common.safetensors_files import safetensors_header_bytes

__all__ = [
    "CACHE_FORMAT_VERSION", "MANIFEST_NAME", "INDEX_NAME", "CacheManifest", "StateCacheError", "shard_name",
    "shard_ranges", "read_manifest", "publish_manifest", "write_shard", "remove_stale_temporaries",
    "missing_shards", "write_index", "StateCacheReader", "bytes_per_token", "STAGING_DIR",
    "stage_sample", "is_staged", "read_staged", "remove_staging", "is_complete", "check_staged", "read_index",
    "expected_shards", "check_manifest",
]

CACHE_FORMAT_VERSION = 2  # 2: the target's fingerprint covers its tensors' bytes; index.json the headers'
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
    target: str                 # fingerprint of the target: config.json and the tensors the states depend on
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
        """The manifest `text` holds; ValueError saying which field is wrong (types and ranges checked here, so
        nothing is built from a manifest that is not one)."""
        try:
            fields = json.loads(text)
        except RecursionError:
            raise ValueError("nested too deeply to be one") from None
        if not isinstance(fields, dict):
            raise ValueError(f"a JSON {type(fields).__name__}, not an object")
        names = {f.name for f in dataclasses.fields(cls)}
        if set(fields) != names:
            raise ValueError(f"fields {sorted(set(fields) ^ names)} missing or unknown")
        for name, (kind, ok) in _FIELD_RULES.items():
            if not (_is(fields[name], kind) and ok(fields[name])):
                raise ValueError(f"field {name} is {_short(fields[name])}")
        fields["target_layer_ids"] = tuple(fields["target_layer_ids"])
        return cls(**fields)

    def mismatch(self, run: "CacheManifest") -> Optional[str]:
        """The first field whose value differs from the run's, as ``field: cache X, run Y`` (None: usable).
        A cache with the final hidden state serves a run that does not read it."""
        # the digests last: a field they depend on (the taps, the sequence length) is named first
        for name in ("format_version", "target_layer_ids", "hidden_size", "dtype", "seq_length", "packing",
                     "samples", "final_hidden", "target", "data"):
            mine, theirs = getattr(self, name), getattr(run, name)
            if name == "final_hidden" and (mine or not theirs):
                continue
            if mine != theirs:
                if name in _DIGEST_FIELDS:  # digests: their heads, and what differs
                    return f"{name}: cache {mine[:12]!r}, run {theirs[:12]!r}: {_DIGEST_FIELDS[name]}"
                return f"{name}: cache {mine!r}, run {theirs!r}"
        return None

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def _is(value, kind) -> bool:
    """isinstance, with bool not an int (JSON's true is no count)."""
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


_HEX64 = re.compile(r"^[0-9a-f]{64}$")
# field -> (JSON type, its range): what a manifest must hold before anything is built from it
_FIELD_RULES = {
    "format_version": (int, lambda v: True),
    "target": (str, lambda v: 0 < len(v) <= 128),
    "target_layer_ids": (list, lambda v: bool(v) and all(_is(i, int) and 0 <= i < 1 << 20 for i in v)),
    "hidden_size": (int, lambda v: 0 < v < 1 << 24),
    "final_hidden": (bool, lambda v: True),
    "dtype": (str, lambda v: v in ("float32", "bfloat16")),
    "seq_length": (int, lambda v: 0 < v < 1 << 31),
    "packing": (bool, lambda v: True),
    "data": (str, lambda v: 0 < len(v) <= 128),
    "shard_size": (int, lambda v: v > 0),
    "samples": (dict, lambda v: set(v) == set(SPLITS) and all(_is(n, int) and 0 <= n < 1 << 40 for n in v.values())),
}


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


_DIGEST_FIELDS = {
    "target": "the target's config or weights differ (its tensors up to the last tap, all of them when the final "
              "hidden state is cached)",
    "data": "the data differs (a byte of its files, or what the tokenizer and chat options make of them)",
}
_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16"}
_MAX_HEADER = 1 << 28  # far more than any shard's header (a few hundred bytes per sample)


def _file_layout(path: str) -> tuple[bytes, dict]:
    """The header of the safetensors file `path` (as stored, and parsed), checked for what reading it relies on:
    a JSON object of tensors with a dtype, a shape and data offsets that tile the rest of the file exactly (a
    truncated or extended file fails here, before any tensor is read). ValueError saying what is wrong."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if size < 8 or n > min(size - 8, _MAX_HEADER):
            raise ValueError(f"not a safetensors file (its first 8 bytes give a {n}-byte header in a {size}-byte file)")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):
        raise ValueError("not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise ValueError("not a safetensors file (its header is not a JSON object)")
    header.pop("__metadata__", None)
    end = 0
    for name, meta in header.items():
        offsets = meta.get("data_offsets") if isinstance(meta, dict) else None
        if not (isinstance(meta, dict) and isinstance(meta.get("dtype"), str) and isinstance(meta.get("shape"), list)
                and all(_is(d, int) and d >= 0 for d in meta["shape"]) and isinstance(offsets, list)
                and len(offsets) == 2 and all(_is(o, int) for o in offsets) and 0 <= offsets[0] <= offsets[1]):
            raise ValueError(f"tensor {name!r} has no dtype, shape and data offsets in its header")
        end = max(end, offsets[1])
    if 8 + n + end != size:
        raise ValueError(f"its tensors end at byte {8 + n + end} of a {size}-byte file (truncated or extended)")
    return raw, header


def _check_sample(tensors: dict, manifest: "CacheManifest", what: str) -> None:
    """One sample's tensors (``input_ids``, ``taps``, ``final`` when the cache holds it; name -> header entry) as
    the manifest says: int64 ids ``[L]``, ``1 <= L <= seq_length``, taps ``[L, T*H]`` and final ``[L, H]`` in its
    dtype. ValueError naming `what` (the sample) otherwise."""
    wanted = {"input_ids", "taps"} | ({"final"} if manifest.final_hidden else set())
    if set(tensors) != wanted:
        raise ValueError(f"{what} holds the tensors {sorted(tensors)}, not {sorted(wanted)}")
    ids = tensors["input_ids"]
    if ids["dtype"] != "I64" or len(ids["shape"]) != 1 or not 1 <= ids["shape"][0] <= manifest.seq_length:
        raise ValueError(f"{what}: input_ids is {ids['dtype']} {ids['shape']}, not I64 [L] with 1 <= L <= "
                         f"{manifest.seq_length}")
    length, dtype, hidden = ids["shape"][0], _SAFETENSORS_DTYPES[manifest.dtype], manifest.hidden_size
    for name, width in (("taps", len(manifest.target_layer_ids) * hidden), ("final", hidden)):
        meta = tensors.get(name)
        if meta is not None and (meta["dtype"] != dtype or meta["shape"] != [length, width]):
            raise ValueError(f"{what}: {name} is {meta['dtype']} {meta['shape']}, not {dtype} {[length, width]}")


_SAMPLE_TENSOR = re.compile(r"^(\d{19})\.(input_ids|taps|final)$")


def _shard_samples(header: dict, manifest: "CacheManifest") -> list[int]:
    """The sample ids of a shard's header, each sample's tensors checked (`_check_sample`); ValueError otherwise."""
    samples: dict[str, dict] = {}
    for key, meta in header.items():
        match = _SAMPLE_TENSOR.match(key)
        if match is None:
            raise ValueError(f"its header names the tensor {key[:60]!r}, not <sample id>.input_ids / .taps / .final")
        samples.setdefault(match.group(1), {})[match.group(2)] = meta
    for key, tensors in samples.items():
        _check_sample(tensors, manifest, f"sample {int(key)}")
    return [int(key) for key in samples]


def read_manifest(directory: str) -> Optional[CacheManifest]:
    """The manifest of `directory`, None when there is none (a refusal when it cannot be read)."""
    path = os.path.join(directory, MANIFEST_NAME)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return CacheManifest.from_json(f.read())
    except (OSError, ValueError) as err:
        raise StateCacheError(f"{path} is not a target-state cache manifest ({err}); delete the directory "
                              f"{directory} and write the cache again (tools/cache_target_states.py or "
                              "--dflash-target-cache-mode write).") from None


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


def expected_shards(manifest: CacheManifest) -> list[str]:
    """The names of every shard the manifest's samples and shard size make, in order."""
    return [shard_name(split, k) for split in SPLITS
            for k in range(len(shard_ranges(manifest.samples.get(split, 0), manifest.shard_size)))]


def write_index(directory: str, manifest: CacheManifest) -> None:
    """``index.json``: every shard's sha256 and its header's (checked by every reader at start: a damaged header
    is named before training), written once all shards are on disk (its presence: complete)."""
    shards, headers = {}, {}
    for name in expected_shards(manifest):
        path = os.path.join(directory, name)
        shards[name] = file_sha256(path)
        headers[name] = hashlib.sha256(safetensors_header_bytes(path)).hexdigest()
    write_file(os.path.join(directory, INDEX_NAME),
               json.dumps({"shards": shards, "headers": headers}, indent=1, sort_keys=True) + "\n")


def read_index(directory: str, manifest: CacheManifest) -> tuple[dict, dict]:
    """(shard -> sha256, shard -> header sha256) of ``index.json``, which must name exactly the shards of the
    manifest (so only files of the cache directory are read); one line naming it otherwise."""
    path = os.path.join(directory, INDEX_NAME)
    expected = expected_shards(manifest)
    try:
        with open(path) as f:
            index = json.load(f)
        if not isinstance(index, dict):
            raise ValueError(f"a JSON {type(index).__name__}, not an object")
        tables = [index.get("shards"), index.get("headers")]
        for table in tables:
            if not (isinstance(table, dict) and all(isinstance(v, str) and _HEX64.match(v) for v in table.values())):
                raise ValueError("no 'shards' and 'headers' objects of sha256 digests")
            if sorted(table) != expected:
                odd = sorted(set(table) ^ set(expected), key=str)[:3]
                raise ValueError(f"it names the shards {odd} missing from it or not of this cache (expected "
                                 f"{expected[0]} ... {expected[-1]})")
    except (OSError, ValueError, RecursionError) as err:
        why = "nested too deeply" if isinstance(err, RecursionError) else err
        raise StateCacheError(f"{path} is not the index of this target-state cache ({why}); delete the directory "
                              f"{directory} and write the cache again (tools/cache_target_states.py or "
                              "--dflash-target-cache-mode write).") from None
    return tables[0], tables[1]


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


def check_staged(directory: str, manifest: CacheManifest) -> None:
    """Every staged sample of `directory` (hybrid mode) checked from its header and size before any is read
    (`_file_layout`, `_check_sample`): a replaced, truncated or foreign file is named in one line (the same on
    every rank: all read the same files), and nothing is unpickled (safetensors only)."""
    staging = os.path.join(directory, STAGING_DIR)
    if not os.path.isdir(staging):
        return
    for entry in sorted(os.listdir(staging)):
        if temporary_of(entry) is not None or not re.match(r"^\d{19}\.safetensors$", entry):
            continue  # a killed writer's temporary (removed with the staging), or not a sample's file
        path = os.path.join(staging, entry)
        try:
            _, header = _file_layout(path)
            _check_sample(header, manifest, "the sample")
        except (OSError, ValueError) as err:
            raise StateCacheError(f"{path}: a staged sample of the target-state cache is corrupt ({err}); delete it "
                                  "and rerun (its states are computed again).") from None


def read_staged(directory: str, sample_id: int, final_hidden: bool) -> Optional[tuple]:
    """A staged sample's states (`stage_sample`; checked by `check_staged`), None when it was not staged."""
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
        if not os.path.isfile(os.path.join(directory, INDEX_NAME)):
            raise StateCacheError(f"the target-state cache {directory} is incomplete (no {INDEX_NAME}); rerun "
                                  "tools/cache_target_states.py with the same arguments to finish it.")
        self.checksums, headers = read_index(directory, self.manifest)
        self.where: dict[int, str] = {}
        for split in SPLITS:
            ranges = shard_ranges(self.manifest.samples[split], self.manifest.shard_size)
            for k, indices in enumerate(ranges):
                self._check_shard(shard_name(split, k), len(indices), headers)
        self._open: dict[str, object] = {}

    def _check_shard(self, name: str, samples: int, headers: dict) -> None:
        """Shard `name` from its header alone, at start: the header index.json recorded, the file's size, each
        sample's tensors as the manifest says, `samples` of them, none in another shard too."""
        path = os.path.join(self.directory, name)
        if not os.path.isfile(path):
            raise self.corrupt(name, "it is missing")
        try:
            raw, header = _file_layout(path)
        except (OSError, ValueError) as err:
            raise self.corrupt(name, f"its header cannot be read ({err})") from None
        if hashlib.sha256(raw).hexdigest() != headers[name]:
            raise self.corrupt(name, "its header differs from the one index.json recorded")
        try:
            ids = _shard_samples(header, self.manifest)
        except ValueError as err:
            raise self.corrupt(name, str(err)) from None
        if len(ids) != samples:
            raise self.corrupt(name, f"it holds {len(ids)} samples, not the {samples} of its range")
        for sample_id in ids:
            if self.where.setdefault(sample_id, name) != name:
                raise self.corrupt(name, f"sample {sample_id} is also in {self.where[sample_id]}")

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
