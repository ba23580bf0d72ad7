"""Training from cached target states (docs/design.md §8 Data path, "Training from cached target states").

* `run_manifest`: what this run needs of a cache (`target.state_cache.CacheManifest`): the target's and the data's
  fingerprints, taps, dtype, sequence length;
* `write_target_cache`: the write pass (``--dflash-target-cache-mode write``, `tools/cache_target_states.py`):
  the frozen target over every training and validation sample, shard by shard, each data-parallel replica its
  own shards (``k % DP``), written by TP rank 0; prints the storage per sample first and refuses when the file
  system has too little free space;
* `CachedTarget`: the frozen target as the step sees it (`training.frozen_target.FrozenTarget`'s interface),
  its taps and final hidden state read from the cache, only the target's embedding and output head in memory;
* `HybridTarget`: ``--dflash-target-cache-mode hybrid``, the target online for the first epoch while its states
  are staged, then the cache gathered, the decoder layers released and the cache read.
"""

from __future__ import annotations

import gc
import hashlib
import os
import shutil
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..common.parallel import ProcessGroups, agree_or_raise
from ..data.batching import Collator
from ..data.formats import data_sha256
from ..target.frozen_heads import load_frozen_heads
from ..target.state_cache import (
    CACHE_FORMAT_VERSION,
    CacheManifest,
    StateCacheError,
    StateCacheReader,
    bytes_per_token,
    check_manifest,
    check_staged,
    missing_shards,
    read_manifest,
    publish_manifest,
    is_complete,
    read_staged,
    remove_stale_temporaries,
    remove_staging,
    shard_name,
    shard_ranges,
    stage_sample,
    write_index,
    write_shard,
)
from ..target.weight_digests import weights_fingerprint
from .datasets import build_datasets
from .device_shim import megatron_target_on_cpu
from .distributed import initialize_distributed
from .frozen_target import FrozenTarget, needs_final_hidden
from .job import Job

__all__ = ["run_manifest", "data_fingerprint", "target_fingerprint", "write_target_cache",
           "CachedTarget", "HybridTarget", "open_cache_reader", "build_cached_target",
           "write_cache_of_job", "data_files_of"]

def target_fingerprint(target_dir: str, target_layer_ids, final_hidden: bool) -> str:
    """What the cached states are a function of in the target (`target.weight_digests.weights_fingerprint`): its
    ``config.json`` and the bytes of the tensors up to the last tapped layer (every tensor when the final hidden
    state is cached), digested once per file and kept: a fine-tuned target with the same config is another one."""
    return weights_fingerprint(target_dir, None if final_hidden else max(int(i) for i in target_layer_ids))


def data_files_of(args) -> list:
    """The data files a run's samples are made of: ``--train-data`` / ``--valid-data`` (a Megatron indexed prefix
    as its ``.bin`` and ``.idx``); none for synthetic data (a function of its seed and sizes)."""
    if args.data_format == "synthetic":
        return []
    paths = [p for p in (args.train_path, args.valid_data) if p]
    if args.data_format == "indexed":
        return [p + ext for p in paths for ext in (".bin", ".idx")]
    return paths


_DATA_DIGESTS: dict = {}  # (real path, inode, size, mtime, ctime) -> digest: a run builds its manifest up to 3 times


def _data_digest(path: str) -> str:
    """`data.formats.data_sha256` of `path`; a file's read once per process while its size and mtime stay (a
    directory's mtime does not follow its files' contents: computed each time)."""
    if not os.path.isfile(path):
        return data_sha256(path)
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key not in _DATA_DIGESTS:
        _DATA_DIGESTS[key] = data_sha256(path)
    return _DATA_DIGESTS[key]


def data_fingerprint(datasets: dict, files=()) -> str:
    """sha256 of the whole data files (`data.formats.data_sha256`: a changed record anywhere changes it, refused
    before training), each split's length and the ids and tokens of its first, middle and last samples (what the
    tokenizer, chat template and sequence length made of them); every sample's tokens are also compared with the
    cache's when it is read (`CachedTarget`)."""
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{os.path.basename(path)}:{_data_digest(path)}".encode("utf-8", "surrogateescape"))
    for split, ds in sorted(datasets.items()):
        n = len(ds) if ds is not None else 0
        digest.update(f"{split}:{n}".encode())
        for i in sorted({0, n // 2, n - 1}) if n else []:
            sample = ds[i]
            digest.update(str(int(sample.sample_id)).encode() + sample.input_ids.numpy().tobytes())
    return digest.hexdigest()


def run_manifest(job: Job, train_ds, valid_ds, cached_final: bool = False) -> CacheManifest:
    """This run's manifest; `cached_final`: the cache holds the final hidden state (which this run may not read),
    so the target's fingerprint covers what made it too (every tensor), as the cache's does."""
    args, cfg = job.args, job.draft_config
    splits = {"train": train_ds, "valid": valid_ds}
    return CacheManifest(
        format_version=CACHE_FORMAT_VERSION,
        target=target_fingerprint(job.target_dir, cfg.target_layer_ids, needs_final_hidden(job) or cached_final),
        target_layer_ids=tuple(cfg.target_layer_ids), hidden_size=cfg.hidden_size,
        final_hidden=needs_final_hidden(job),
        dtype=args.dflash_target_cache_dtype, seq_length=args.seq_length, packing=bool(args.pack_sequences),
        data=data_fingerprint(splits, data_files_of(args)), shard_size=args.dflash_target_cache_shard_size,
        samples={k: (len(v) if v is not None else 0) for k, v in splits.items()},
    )


def _owned_missing(directory: str, manifest: CacheManifest, dp_rank: int, dp_size: int) -> list:
    """(split, shard, sample range) of the shards this DP replica writes that are not on disk yet."""
    work = []
    for split in ("train", "valid"):
        ranges = shard_ranges(manifest.samples[split], manifest.shard_size)
        work += [(split, k, ranges[k]) for k in missing_shards(directory, split, ranges) if k % dp_size == dp_rank]
    return work


def _storage_line(manifest: CacheManifest, samples_to_write: int, free: int) -> str:
    taps = len(manifest.target_layer_ids)
    per_sample = manifest.seq_length * bytes_per_token(manifest)
    return (f"[cache] storage per sample: up to {manifest.seq_length} tokens x ({taps} taps"
            f"{' + final hidden' if manifest.final_hidden else ''}) x {manifest.hidden_size} hidden x "
            f"{manifest.torch_dtype.itemsize} bytes = {per_sample / 2**20:.3f} MiB; {samples_to_write} sample(s) to "
            f"write: up to {per_sample * samples_to_write / 2**30:.3f} GiB, {free / 2**30:.3f} GiB free")


def _shard_states(get_target: Callable, ds, indices: range, collate, micro: int, manifest: CacheManifest,
                  staging: Optional[str]) -> dict:
    """The states of the samples ``indices`` of `ds`, by sample id in index order: the staged ones read from
    `staging` (hybrid mode), the others computed by ``get_target()`` (asked only then) in micro-batches of
    samples of similar lengths."""
    samples = {i: ds[i] for i in indices}  # read once: a dataset tokenizes its sample on every access
    states = {}
    if staging is not None:
        for i, sample in samples.items():
            found = read_staged(staging, sample.sample_id, manifest.final_hidden)
            if found is not None:
                states[i] = found
    # shortest first: a micro-batch holds samples of similar lengths, so the target, which runs up to its longest
    # real row (`FrozenTarget`), computes little padding; the states are returned in index order all the same
    todo = sorted((i for i in indices if i not in states), key=lambda i: len(samples[i].input_ids))
    for a in range(0, len(todo), micro):
        target = get_target()
        batch = collate([samples[i] for i in todo[a:a + micro]])
        batch = {key: (v.to(target.device) if isinstance(v, torch.Tensor) else v) for key, v in batch.items()}
        taps, final = target(batch)
        for b, i in enumerate(todo[a:a + micro]):
            states[i] = _row_states(batch, b, taps, final, manifest)
    return {int(samples[i].sample_id): states[i] for i in indices}


def _row_states(batch: dict, b: int, taps, final, manifest: CacheManifest) -> tuple:
    """Row `b`'s real tokens and their states, in the cache's dtype, on the CPU."""
    n = int((batch["document_ids"][b] >= 0).sum())
    return (batch["tokens"][b, :n].cpu(), taps[b, :n].to(manifest.torch_dtype).cpu(),
            final[b, :n].to(manifest.torch_dtype).cpu() if manifest.final_hidden else None)


def _publish_run_manifest(directory: str, manifest: CacheManifest, groups: ProcessGroups) -> None:
    """Create the cache's directory and manifest, or check the one there (a differing field is refused, the shard
    size included: the shards on disk cover its sample ranges). Collective over the world."""
    found = read_manifest(directory) if os.path.isdir(directory) else None
    if found is not None and found.shard_size != manifest.shard_size:
        raise StateCacheError(f"the target-state cache {directory} does not match this run (shard_size: cache "
                              f"{found.shard_size}, run {manifest.shard_size}); pass --dflash-target-cache-shard-size "
                              f"{found.shard_size} to finish it.")
    if found is not None:
        check_manifest(directory, manifest)  # a differing field refused on every rank alike, before the collective
    error = None
    if groups.rank == 0:
        try:
            publish_manifest(directory, manifest)
        except Exception as err:  # noqa: BLE001 - raised on every rank alike (a full disk), below
            error = err
    agree_or_raise(error, group=groups.world, elsewhere=StateCacheError(
        f"creating the target-state cache {directory} failed on rank 0 (see its error); fix that and rerun."))
    publish_manifest(directory, manifest)  # every rank checks it (a no-op where it matches)


def write_target_cache(job: Job, make_target: Callable, datasets: dict, directory: str, groups: ProcessGroups,
                       log: Callable[[str], None] = print, staged: bool = False) -> CacheManifest:
    """Write the shards of the cache that are missing (this DP replica's), then, on global rank 0 once every rank is
    done, ``index.json``. ``make_target()`` gives a `training.frozen_target.FrozenTarget` (PP = 1), called once the
    manifest and the free space are checked and only when a sample is to be computed. With `staged` (hybrid mode),
    the samples staged during the first epoch are read instead of computed. Collective over the world.

    Long on purpose: manifest, storage check, the shards and the index are one pass whose order matters."""
    manifest = run_manifest(job, datasets["train"], datasets.get("valid"))
    if staged:
        check_staged(directory, manifest)  # every rank alike, before any collective
    _publish_run_manifest(directory, manifest, groups)
    work = _owned_missing(directory, manifest, groups.dp_rank, groups.dp_size)
    if groups.is_distributed:  # every TP rank has listed the same shards before any is written
        dist.barrier()
    writes = groups.tp_rank == 0
    if writes:
        remove_stale_temporaries(directory, [shard_name(split, k) for split, k, _ in work])
    to_write = sum(len(r) for _, _, r in work)
    free = shutil.disk_usage(directory).free
    line = _storage_line(manifest, to_write, free)
    log(line)
    short = writes and to_write * manifest.seq_length * bytes_per_token(manifest) > free
    agree_or_raise(StateCacheError(  # every rank stops alike (replicas write different shards)
        f"not enough free space for the target-state cache in {directory}: {line[8:]}; free space or choose "
        "another directory (or --dflash-target-cache-dtype bfloat16).") if short else None, group=groups.world,
        elsewhere=StateCacheError(f"not enough free space for the target-state cache in {directory} on another "
                                  "rank (see its error); free space or choose another directory."))
    collate = Collator(job.pad_token_id, job.args.seq_length, False)
    target = []  # made by the first shard that computes a sample

    def get_target():
        if not target:
            target.append(make_target())
        return target[0]

    error = _write_shards(work, get_target, datasets, collate, job.args.micro_batch_size, manifest, directory,
                          directory if staged else None, groups, log)
    # every rank here (a barrier); a failed write (a full disk: the shard named) raised alike everywhere
    agree_or_raise(error, group=groups.world, elsewhere=StateCacheError(
        f"writing the target-state cache {directory} failed on another rank (see its error); the shards written "
        "are complete: fix that and rerun with the same arguments to write the rest."))
    error = None
    if groups.rank == 0:
        try:
            write_index(directory, manifest)
        except Exception as err:  # noqa: BLE001 - raised on every rank alike, below
            error = err
    agree_or_raise(error, group=groups.world, elsewhere=StateCacheError(
        f"writing the index of the target-state cache {directory} failed on rank 0 (see its error); the shards "
        "are complete: fix that and rerun with the same arguments."))
    return manifest


def _write_shards(work: list, get_target: Callable, datasets: dict, collate, micro: int, manifest: CacheManifest,
                  directory: str, staging: Optional[str], groups: ProcessGroups, log) -> Optional[BaseException]:
    """Compute and write this replica's missing shards (TP rank 0 writes); the first failed write stops the
    replica's TP ranks together (agreed per shard, so none is left in a collective) and is returned."""
    for split, k, indices in work:
        states = _shard_states(get_target, datasets[split], indices, collate, micro, manifest, staging)
        error = None
        if groups.tp_rank == 0:
            try:
                write_shard(directory, split, k, states)  # whole or not at all (a full disk: NoSpaceError)
            except Exception as err:  # noqa: BLE001 - returned, and raised on every rank alike by the caller
                error = err
        try:
            agree_or_raise(error, group=groups.tp, elsewhere=StateCacheError(
                f"writing {shard_name(split, k)} of the target-state cache {directory} failed on TP rank 0 (see "
                "its error); fix that and rerun with the same arguments."))
        except Exception as err:  # noqa: BLE001 - the caller agrees over the world
            return err
        log(f"[cache] wrote {shard_name(split, k)} ({len(indices)} samples)")
    return None


class CachedTarget:
    """The frozen target read from a cache: ``__call__(batch) -> (taps [B, S, T*H], final [B, S, H] or None)``
    in the run's dtype (zeros on padding), `embedding` and `head` (`target.frozen_heads`); nothing else of the
    target is loaded (`skipped_bytes` of its weights stay on disk)."""

    placement = None
    is_draft = True
    hf_model = None

    def __init__(self, job: Job, reader: StateCacheReader, device: torch.device, dtype: torch.dtype,
                 groups: ProcessGroups, heads: Optional[tuple] = None):
        args = job.args
        self.reader, self.device, self.dtype = reader, device, dtype
        self.need_final_hidden = needs_final_hidden(job)
        if heads is not None:  # hybrid mode: the online target's own embedding and head, kept
            self.embedding, self.head = heads
            self.loaded_bytes = self.skipped_bytes = 0
            return
        tied = bool(job.target_text_config.get("tie_word_embeddings", job.target_config.get("tie_word_embeddings")))
        heads = load_frozen_heads(job.target_dir, job.draft_config, dtype, groups.tp, tied=tied,
                                  vocab_parallel=args.target_backend == "megatron")
        self.embedding = heads.embedding.to(device)
        self.head = heads.head
        self.head.layer.to(device)
        self.loaded_bytes, self.skipped_bytes = heads.loaded_bytes, heads.skipped_bytes

    def before_step(self, iteration: int) -> None:
        """Called by the loop before every optimizer step; a complete cache has nothing to do."""

    @torch.no_grad()
    def __call__(self, batch: dict):
        # Assembled on the host and moved once: one device sync per batch, not one per row.
        tokens = batch["tokens"].cpu()
        B, S = tokens.shape
        width = len(self.reader.manifest.target_layer_ids) * self.reader.manifest.hidden_size
        taps = torch.zeros(B, S, width, dtype=self.dtype)
        final = torch.zeros(B, S, self.reader.manifest.hidden_size, dtype=self.dtype) if self.need_final_hidden \
            else None
        supervised = batch["loss_mask"].any(dim=1).tolist()
        for b, sample_id in enumerate(batch["sample_ids"].tolist()):
            if sample_id not in self.reader.where and not supervised[b]:
                continue  # a stand-in row that supervises nothing (`training.step.RankData`): no states needed
            ids, sample_taps, sample_final = self.reader.sample(sample_id)
            n = ids.shape[0]
            if n > S or not torch.equal(ids, tokens[b, :n]):
                raise StateCacheError(f"sample {sample_id}: its tokens differ from those the target-state cache "
                                      f"{self.reader.directory} holds; write the cache again for this data.")
            taps[b, :n] = sample_taps
            if final is not None:
                final[b, :n] = sample_final
        return taps.to(self.device), final.to(self.device) if final is not None else None


def open_cache_reader(job: Job, train_ds, valid_ds) -> StateCacheReader:
    """The reader of ``--dflash-target-cache`` for this run (its manifest must match the run's)."""
    directory = job.args.dflash_target_cache
    found = read_manifest(directory) if os.path.isdir(directory) else None
    cached_final = found is not None and found.final_hidden
    return StateCacheReader(directory, run_manifest(job, train_ds, valid_ds, cached_final=cached_final))


def _parameter_bytes(modules) -> dict:
    """data pointer -> bytes of the distinct parameters and buffers of `modules`."""
    out = {}
    for module in modules:
        for t in [*module.parameters(), *module.buffers()]:
            out[t.data_ptr()] = t.numel() * t.element_size()
    return out


class HybridTarget:
    """``--dflash-target-cache-mode hybrid`` (docs/design.md §8 Data path, "Training from cached target states"):
    during the first epoch, the steps ``[0, ceil(train samples / global batch))`` that draw a sample of the first pass
    over the training data, the target runs online (as without a cache) and TP rank 0 of each replica stages every
    supervised row's states (`target.state_cache.stage_sample`); before the first step after it, `before_step`
    gathers the shards (the staged samples read, the others — validation samples, those a killed run lost —
    computed), publishes ``index.json``, removes the staging, releases the target's decoder layers (the embedding and
    head stay) and from then on reads the cache (`CachedTarget`). Collective over the world at that step."""

    placement = None
    is_draft = True
    hf_model = None  # the acceptance evaluation is skipped, as when reading a cache

    def __init__(self, job: Job, datasets: dict, device: torch.device, dtype: torch.dtype, groups: ProcessGroups,
                 log: Callable[[str], None] = print):
        self.job, self.datasets, self.device, self.dtype, self.groups, self.log = job, datasets, device, dtype, \
            groups, log
        self.directory = job.args.dflash_target_cache
        self.manifest = run_manifest(job, datasets["train"], datasets.get("valid"))
        check_staged(self.directory, self.manifest)  # an interrupted run's staged samples, before any collective
        _publish_run_manifest(self.directory, self.manifest, groups)  # refused before the first epoch, not after
        self.online: Optional[FrozenTarget] = FrozenTarget(job, device, dtype, groups)
        self.embedding, self.head = self.online.embedding, self.online.head
        self.cached: Optional[CachedTarget] = None
        self.first_epoch_steps = -(-len(datasets["train"]) // job.args.global_batch_size)
        log(f"[cache] hybrid: the target runs online for the first {self.first_epoch_steps} step(s) (one epoch) "
            f"while its states are staged in {self.directory}; the cache is read after them")

    @torch.no_grad()
    def __call__(self, batch: dict):
        if self.cached is not None:
            return self.cached(batch)
        taps, final = self.online(batch)
        if self.groups.tp_rank == 0:
            supervised = batch["loss_mask"].any(dim=1).tolist()  # one sync, not one per row
            for b in range(taps.shape[0]):
                if supervised[b]:  # not a stand-in row (`training.step.RankData`)
                    stage_sample(self.directory, int(batch["sample_ids"][b]),
                                 _row_states(batch, b, taps, final, self.manifest))
        return taps, final

    def before_step(self, iteration: int) -> None:
        """At the first step after the first epoch (or the first of a run resumed past it): complete the cache."""
        if self.cached is None and iteration >= self.first_epoch_steps:
            self.complete()

    def complete(self) -> None:
        write_target_cache(self.job, lambda: self.online, self.datasets, self.directory, self.groups, log=self.log,
                           staged=True)
        if self.groups.rank == 0:
            remove_staging(self.directory)
        reader = open_cache_reader(self.job, self.datasets["train"], self.datasets.get("valid"))
        kept = _parameter_bytes([self.embedding, self.head.layer])
        held = [m for m in (self.online.module, self.online.hf_model) if isinstance(m, torch.nn.Module)]
        freed = sum(n for ptr, n in _parameter_bytes(held).items() if ptr not in kept)
        self.online = None  # the decoder layers and the final norm go with it
        gc.collect()
        self.cached = CachedTarget(self.job, reader, self.device, self.dtype, self.groups,
                                   heads=(self.embedding, self.head))
        self.log(f"[cache] hybrid: the cache is complete; target states read from {self.directory} from now on; "
                 f"released the target's decoder layers: {freed / 2**20:.2f} MiB freed (embedding and output head "
                 f"kept: {sum(kept.values()) / 2**20:.2f} MiB)")


def build_cached_target(job: Job, datasets: dict, device: torch.device, dtype: torch.dtype, groups: ProcessGroups,
                        log: Callable[[str], None] = print):
    """The run's `CachedTarget`; with ``--dflash-target-cache-mode write`` the missing shards are written first
    with the whole target, which is then released; with ``hybrid`` a `HybridTarget` unless the cache is complete
    (collective over the world)."""
    args = job.args
    if args.dflash_target_cache_mode == "hybrid" and not is_complete(args.dflash_target_cache):
        return HybridTarget(job, datasets, device, dtype, groups, log=log)
    if args.dflash_target_cache_mode == "write":
        write_target_cache(job, lambda: FrozenTarget(job, device, dtype, groups), datasets, args.dflash_target_cache,
                           groups, log=log)
    reader = open_cache_reader(job, datasets["train"], datasets.get("valid"))
    target = CachedTarget(job, reader, device, dtype, groups)
    log(f"[cache] target states read from {args.dflash_target_cache} ({reader.manifest.dtype}); target weights "
        f"loaded: {target.loaded_bytes / 2**20:.2f} MiB (embedding, output head), not loaded: "
        f"{target.skipped_bytes / 2**20:.2f} MiB (decoder layers, final norm)")
    return target


def write_cache_of_job(job: Job, env=None, log: Callable[[str], None] = print) -> CacheManifest:
    """`tools/cache_target_states.py`: the write pass of this job's cache in this process (one rank of the launch),
    the megatron target on CPU ranks as `training.loop.train` runs it."""
    if job.args.target_backend == "megatron" and not job.args.use_cuda:
        with megatron_target_on_cpu():
            return _write_cache_of_job(job, env, log)
    return _write_cache_of_job(job, env, log)


def _write_cache_of_job(job: Job, env, log) -> CacheManifest:
    ctx = initialize_distributed(job, env)
    try:
        train_ds, valid_ds = build_datasets(job)
        dtype = torch.bfloat16 if job.args.bf16 else torch.float32
        say = log if ctx.rank == 0 else (lambda text: None)
        return write_target_cache(job, lambda: FrozenTarget(job, ctx.device, dtype, ctx.groups),
                                  {"train": train_ds, "valid": valid_ds}, job.args.dflash_target_cache, ctx.groups,
                                  log=say)
    finally:
        ctx.close()
