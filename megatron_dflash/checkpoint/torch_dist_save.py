"""megatron's `torch_dist` checkpoint format, written in the calling process.

megatron-core 0.16's only `torch_dist` save strategy (`TorchDistSaveShardedStrategy`) always writes
through `FileSystemWriterAsync.write_preloaded_data_multiproc`, which starts one forked writer
process per file (independent of `thread_count`, async or not), and its `preload_tensors` calls
`torch.cuda.synchronize()`. Forking fails inside daemonic processes (the test rank pool, some
launchers) and the CUDA calls fail on a CPU-only torch. megatron offers no public switch for
either, so `InProcessTorchDistSaveStrategy` takes the same steps itself: keep the main replica of
each shard and give it its sharded key, translate megatron `ShardedTensor`s into torch
`ShardedTensor`s, plan with `MCoreSavePlanner`, then `torch.distributed.checkpoint.save` with
torch's synchronous `FileSystemWriter` (`thread_count` writer threads, files fsync'ed). The result
is the `torch_dist` backend, version 1, read by megatron's default loader.

A full file system: torch gathers the error of each rank's writes by pickling it, which drops its
`__context__`, the only place where torch's zip writer keeps the `OSError` (ENOSPC) of a failed
write (what is left says "unexpected pos 704 vs 598"). `_FileSystemWriter` raises such a failure
as `common.atomic.NoSpaceError` (the checkpoint directory) before the gather, so every rank's message
says it (docs/design.md §14).

This module and its reading counterpart `checkpoint/torch_dist_load.py` are the only places that use megatron's
private helpers (names starting with `_`) or internals of the `torch_dist` strategy;
`tests/test_convert.py::test_megatron_private_save_helpers` pins the signatures used there and fails
loudly when a megatron release changes them.
"""

from __future__ import annotations

import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing.strategies.base import SaveShardedStrategy
from megatron.core.dist_checkpointing.strategies.torch import (  # the private helper: see the module docstring
    MCoreSavePlanner,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)

from ..common.atomic import no_space_as_error

try:
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    _WRITER_FORMAT = {"serialization_format": SerializationFormat.TORCH_SAVE}
except ImportError:  # older torch: torch.save is the only format
    _WRITER_FORMAT = {}

__all__ = ["InProcessTorchDistSaveStrategy", "in_process_save_strategy"]


class _FileSystemWriter(dcp.FileSystemWriter):
    """torch's synchronous `FileSystemWriter`; a write that finds the file system full raises
    `common.atomic.NoSpaceError` naming the checkpoint directory (see the module docstring)."""

    def write_data(self, plan, planner):
        with no_space_as_error(str(self.path)):
            return super().write_data(plan, planner)

    def finish(self, metadata, results) -> None:
        with no_space_as_error(str(self.path)):
            super().finish(metadata, results)


class InProcessTorchDistSaveStrategy(SaveShardedStrategy):
    """megatron's `torch_dist` format (backend `torch_dist`, version 1), written in the calling
    process: no writer processes, no CUDA calls (see the module docstring)."""

    def __init__(self, backend: str = "torch_dist", version: int = 1, thread_count: int = 1):
        super().__init__(backend, version)
        if thread_count < 1:
            raise ValueError(f"thread_count={thread_count} must be >= 1.")
        self.thread_count = thread_count

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def save(self, sharded_state_dict, checkpoint_dir) -> None:
        grouped, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, keep_only_main_replica=True)
        pyt_state_dict = mcore_to_pyt_state_dict(grouped, False)
        writer = _FileSystemWriter(str(checkpoint_dir), thread_count=self.thread_count, **_WRITER_FORMAT)
        planner = MCoreSavePlanner(
            dedup_replicated_tensors=False, flatten_state_dict=False, can_run_decentralized_global_plan=False
        )
        dcp.save(pyt_state_dict, storage_writer=writer, planner=planner)


def in_process_save_strategy(thread_count: int = 1) -> InProcessTorchDistSaveStrategy:
    """A megatron `SaveShardedStrategy` writing the `torch_dist` format in the calling process.

    Pass it as `sharded_strategy=` to `megatron.core.dist_checkpointing.save`. Unlike megatron's
    default it works in daemonic processes and on CPU-only torch.
    """
    return InProcessTorchDistSaveStrategy(thread_count=thread_count)
