"""The training step (`training.step`): its statistics are summed over the process groups the job hands
down."""

from __future__ import annotations


def _step_totals_with_handed_down_groups(rank: int, world_size: int) -> dict:
    """The step's statistics reduced with a collection whose data-parallel group (the world) differs from
    megatron's (TP = 2, so megatron's data-parallel group is this rank alone)."""
    import dataclasses
    import types

    import torch
    import torch.distributed as dist

    from megatron_dflash.common.parallel import ProcessGroups, current_process_groups
    from megatron_dflash.training.step import StepCounts, StepRunner, StepStatistics

    megatron = current_process_groups()
    groups = dataclasses.replace(ProcessGroups.single(dist.group.WORLD), dp=dist.group.WORLD)
    runner = StepRunner(types.SimpleNamespace(args=None, draft_config=None), None, None,
                         types.SimpleNamespace(placement=None), torch.device("cpu"), groups)

    def counts(value: float) -> StepCounts:
        return StepCounts(*(torch.tensor(value, dtype=torch.float64) for _ in StepCounts.field_names()))

    totals = runner.reduce(StepStatistics(counts(rank + 1.0), counts(10.0 * (rank + 1))))
    return {"megatron": (megatron.tp_size, megatron.dp_size), "groups": (groups.tp_size, groups.dp_size),
            "loss_sum": float(totals.counts.loss_sum), "metric": float(totals.metrics.loss_sum)}


def test_training_step_reduces_over_the_handed_down_groups_not_megatrons(tp_pool):
    """The training step sums its statistics over the data-parallel group of the `ProcessGroups` the job
    handed down, not over megatron's global parallel_state (here they differ)."""
    for report in tp_pool(2).run(_step_totals_with_handed_down_groups, tp=2):
        assert report["megatron"] == (2, 1) and report["groups"] == (1, 2)
        assert report["loss_sum"] == 3.0 and report["metric"] == 30.0  # 1 + 2 and 10 + 20: summed over both ranks
