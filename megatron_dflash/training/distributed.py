"""The training job's distributed set-up: the process group, megatron's parallel_state, the job's process groups.

`initialize_distributed(job)` joins (or creates) the process group, checks that every rank resolved the same
job (`agreement.agree_on_job`, before any other collective), sets up megatron's tensor / pipeline / expert
parallel groups and returns a `DistContext` that holds the job's `common.parallel.ProcessGroups` (built once
here and handed down: nothing below reads megatron's global parallel_state) and releases what it set up
(`close`).
"""

from __future__ import annotations

import datetime
import os
import tempfile
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from ..common.parallel import ProcessGroups, destroy_model_parallel, initialize_model_parallel, megatron_ready
from .agreement import agree_on_job
from .job import Job

__all__ = ["DistContext", "initialize_distributed"]


@dataclass
class DistContext:
    """This rank's place in the job (rank, world size, device) and what the set-up owns and `close` releases."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    owns_process_group: bool
    owns_model_parallel: bool
    tmpdir: Optional[tempfile.TemporaryDirectory] = None
    # The job's process groups, built once here and handed down to the target, the step, the optimizer and
    # the checkpoints (nothing below reads megatron's global parallel_state).
    groups: ProcessGroups = field(default_factory=ProcessGroups.single)

    def close(self) -> None:
        # Drop the references first: a gloo group's threads end only when its last reference goes.
        self.groups = ProcessGroups.single()
        if self.owns_model_parallel and megatron_ready():
            destroy_model_parallel()
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        if self.tmpdir is not None:
            self.tmpdir.cleanup()
            self.tmpdir = None


def initialize_distributed(job: Job, env=None) -> DistContext:
    """Join (or create) the process group and set up megatron's parallel_state for TP/PP.

    * already initialised (e.g. by a test harness): reused;
    * torchrun / SLURM (`RANK`, `WORLD_SIZE`, `MASTER_ADDR` set): `env://` rendezvous;
    * a plain single process: a 1-rank group over a `file://` rendezvous in a temporary directory
      (megatron's dist_checkpointing needs `torch.distributed`).

    Backend: nccl with CUDA, gloo without.
    """

    env = os.environ if env is None else env
    args = job.args
    use_cuda = args.use_cuda
    local_rank = int(env.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank % max(1, torch.cuda.device_count()))
    owns_pg = False
    tmpdir = None
    if not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        timeout = datetime.timedelta(minutes=30)
        if "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env:
            dist.init_process_group(backend, init_method="env://", rank=int(env["RANK"]),
                                    world_size=int(env["WORLD_SIZE"]), timeout=timeout)
        else:
            if job.world_size != 1:
                raise RuntimeError(
                    f"world size {job.world_size} but no torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR); "
                    "launch with torchrun."
                )
            tmpdir = tempfile.TemporaryDirectory(prefix="dflash-rdzv-")
            dist.init_process_group(backend, init_method=f"file://{os.path.join(tmpdir.name, 'rendezvous')}",
                                    rank=0, world_size=1, timeout=timeout)
        owns_pg = True
    world = dist.get_world_size()
    if world != job.world_size:
        raise RuntimeError(f"the process group has {world} ranks but the job was validated for {job.world_size}.")
    # before megatron's groups and any other collective: every rank resolved the same job

    agree_on_job(job)
    tp, pp = job.tp, job.pp
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size
    owns_mp = False
    if megatron_ready():
        current = ProcessGroups.from_megatron()
        same = (current.tp_size == tp and current.pp_size == pp and current.ep_size == ep
                and current.etp_size == (tp if etp is None else etp))
        if not same:
            destroy_model_parallel()
    if not megatron_ready():
        initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                  expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
        owns_mp = True
    if use_cuda:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(args.seed)
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    return DistContext(dist.get_rank(), world, local_rank, device, owns_pg, owns_mp, tmpdir,
                       groups=ProcessGroups.from_megatron())
