"""Every rank of a launch runs the same job: agreement on the resolved arguments before any collective.

Each rank validates its own command line (`arguments.validate_args`), so ranks launched with different
flags would otherwise each train a different job: different seeds on the ranks of a tensor-parallel
group initialise different shards, different learning rates make data-parallel replicas diverge, and
shape-changing differences end in a collective that never completes. `agree_on_job(job)` compares a
digest of everything a rank resolved (its arguments, the draft config, the target directory): one
small all-reduce when they agree; when they do not, every rank raises the same `ArgumentError` that
names each differing field and its value on every rank.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
import torch.distributed as dist

from ..common.parallel import distributed_ready, gather_disagreement
from .arguments import ArgumentError

__all__ = ["job_fields", "agree_on_job"]

# Arguments that may differ between ranks without changing the job.
_PER_RANK_ARGS = {"debug"}
_DIGEST_WORDS = 4  # 4 x 60 bits of the SHA-256 digest


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=_canonical_default)


def _canonical_default(value: Any):
    # A set's iteration order depends on the process's hash seed: sort it so equal sets agree.
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    return repr(value)


def job_fields(job) -> dict[str, str]:
    """`{field name: canonical JSON value}` of everything the job was resolved to on this rank."""
    import dataclasses

    fields = {}
    for key, value in sorted(vars(job.args).items()):
        if key not in _PER_RANK_ARGS:
            fields["--" + key.replace("_", "-")] = _canonical(value)
    for key, value in dataclasses.asdict(job.draft_config).items():
        fields[f"draft config {key}"] = _canonical(value)
    fields["draft type"] = _canonical(type(job.draft_config).__name__)
    fields["target directory"] = _canonical(job.target_dir)
    fields["world size"] = _canonical(job.world_size)
    return fields


def _digest(fields: dict[str, str]) -> list[int]:
    digest = hashlib.sha256(_canonical(fields).encode()).digest()
    # 60-bit words: non-negative, and their negation fits int64 (gather_disagreement reduces MAX of +/-)
    return [int.from_bytes(digest[8 * i: 8 * i + 8], "big") >> 4 for i in range(_DIGEST_WORDS)]


def agree_on_job(job, group=None) -> None:
    """Raise the same `ArgumentError` on every rank of `group` (default: the world) unless all ranks
    resolved the same job. Collective; a no-op without `torch.distributed` or with one rank."""
    if not distributed_ready() or dist.get_world_size(group) == 1:
        return
    fields = job_fields(job)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    if gather_disagreement(None, _digest(fields), group, device) is None:
        return
    per_rank: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(per_rank, fields, group=group)
    names = sorted(set().union(*per_rank))
    differing = []
    for name in names:
        values = [ranks.get(name, "<unset>") for ranks in per_rank]
        if len(set(values)) > 1:
            shown = "; ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            differing.append(f"{name} ({shown})")
    listed = ", ".join(differing[:8]) + (f" and {len(differing) - 8} more" if len(differing) > 8 else "")
    raise ArgumentError(
        f"the ranks of this launch were started with different arguments: {listed}. Launch every rank with the "
        "same command line (and the same files)."
    )
