"""Setting up megatron's parallel_state and tearing it down leaves no process groups or threads behind.

Every gloo process group owns threads (about sixty per megatron set-up), and megatron's own
teardown only forgets its groups: a process that set up and tore down repeatedly (the test pool,
a user calling the training loop twice) grew by that much each time.
"""

from __future__ import annotations

import threading

import pytest

from tp_harness import THREAD_BOUND, RankError, RankPool, live_process_groups, rank_thread_count, thread_count

# Threads a rank may gain over a set-up / teardown cycle: teardown joins every group's threads,
# but a library may start a small worker pool once on first use. One leaked set-up is ~60.
CYCLE_SLACK = 12

LAYOUTS = [
    dict(tensor_model_parallel_size=2),
    dict(tensor_model_parallel_size=1),
    dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=2),
    dict(tensor_model_parallel_size=2),
]


def _set_up_and_tear_down(rank: int, world_size: int, layouts: list) -> dict:
    """Each layout set up and torn down in turn, next to a group of the caller's own."""
    import torch
    import torch.distributed as dist

    from megatron_dflash.common.parallel import destroy_model_parallel, initialize_model_parallel

    mine = dist.new_group(list(range(world_size)))
    start = {"groups": len(live_process_groups()), "threads": thread_count()}
    cycles = []
    for sizes in layouts:
        initialize_model_parallel(**sizes)
        during = len(live_process_groups())
        destroy_model_parallel()
        cycles.append({"during": during, "groups": len(live_process_groups()), "threads": thread_count()})
    value = torch.ones(1)
    dist.all_reduce(value, group=mine)  # the caller's group survived every teardown
    dist.destroy_process_group(mine)
    return {"start": start, "cycles": cycles, "mine": value.item()}


def test_model_parallel_teardown_releases_its_groups_and_threads(tp_pool):
    """`common.parallel.destroy_model_parallel` destroys every group `common.parallel.initialize_model_parallel` created
    (their threads end with them), over TP, DP and PP layouts, and leaves a group of the caller's alone."""
    for report in tp_pool(2).run(_set_up_and_tear_down, LAYOUTS, tp=None):
        start = report["start"]
        for sizes, cycle in zip(LAYOUTS, report["cycles"]):
            assert cycle["during"] > start["groups"], (sizes, report)
            assert cycle["groups"] == start["groups"], (sizes, report)
            assert cycle["threads"] <= start["threads"] + CYCLE_SLACK, (sizes, report)
        assert report["mine"] == 2.0


def _training_setup_cycles(rank: int, world_size: int, target: str, tp: int, cycles: int) -> dict:
    """The training loop's distributed set-up and close, `cycles` times, for a TP = `tp` job."""
    from megatron_dflash.training.arguments import parse_args
    from megatron_dflash.training.device_shim import megatron_target_on_cpu
    from megatron_dflash.training.job import prepare_job
    from megatron_dflash.training.distributed import initialize_distributed

    argv = ["--target", target, "--dflash-num-layers", "2", "--dflash-block-size", "8", "--data-format", "synthetic",
            "--seq-length", "48", "--tensor-model-parallel-size", str(tp), "--target-backend", "megatron",
            "--dflash-eval-prompts", "0"]
    with megatron_target_on_cpu():  # the megatron target backend on CPU ranks
        job = prepare_job(parse_args(argv), world_size, log=lambda *a: None)
    start = {"groups": len(live_process_groups()), "threads": thread_count()}
    after = []
    for _ in range(cycles):
        ctx = initialize_distributed(job)
        ctx.close()
        after.append({"groups": len(live_process_groups()), "threads": thread_count()})
    return {"start": start, "after": after}


def _tensor_parallel_size(rank: int, world_size: int):
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_tensor_model_parallel_world_size()


def test_training_setup_releases_its_groups_and_the_pool_restores_its_own(tp_pool, tiny_target):
    """The training loop's set-up and close, repeated in one process that already has a process group (a
    notebook, the test pool), ends where it started: megatron's groups are destroyed with their threads,
    both when parallel_state was unset and when the loop replaced a layout it was given (the pool's TP=2 by
    a TP=1 job). The pool's next call finds its own layout set up again."""
    pool = tp_pool(2)
    for tp, harness_tp in ((2, None), (1, 2)):
        for report in pool.run(_training_setup_cycles, tiny_target, tp, 3, tp=harness_tp):
            start = report["start"]
            for cycle in report["after"]:
                # the loop replaced the pool's layout: the pool's groups are released too (the world stays)
                expected = start["groups"] if harness_tp is None else 1
                assert cycle["groups"] == expected, (tp, harness_tp, report)
                assert cycle["threads"] <= start["threads"] + CYCLE_SLACK, (tp, harness_tp, report)
        assert pool.run(_tensor_parallel_size) == [2, 2]


def _leave_threads_behind(rank: int, world_size: int, count: int) -> int:
    """Start `count` threads that never end (until the process does)."""
    never = threading.Event()
    for _ in range(count):
        threading.Thread(target=never.wait, daemon=True).start()
    return thread_count()


def _megatron_set_up_and_torn_down_by_megatron(rank: int, world_size: int) -> None:
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    parallel_state.destroy_model_parallel()


def test_the_pool_fails_a_call_that_leaves_groups_or_threads_behind():
    """A call that leaves process groups it created registered (megatron's own teardown does), or after
    which a rank holds more than `THREAD_BOUND` threads, fails naming the function; the pool starts afresh
    for the next call."""
    with RankPool(1) as pool:
        with pytest.raises(RankError, match=r"_megatron_set_up_and_torn_down_by_megatron left \d+ process group"):
            pool.run(_megatron_set_up_and_torn_down_by_megatron, tp=None)
        with pytest.raises(RankError, match=r"threads in this rank after _leave_threads_behind \(bound"):
            pool.run(_leave_threads_behind, THREAD_BOUND, tp=None)
        assert pool.run(rank_thread_count, tp=None)[0] < THREAD_BOUND
