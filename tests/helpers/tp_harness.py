"""A pool of simulated tensor-parallel ranks for tests: gloo processes on the CPU.

Starting a rank costs seconds (torch and megatron imports), so a pool of `world_size`
processes is spawned once per test session and reused by every test:

    results = pool.run(fn, *args)      # -> [result of rank 0, result of rank 1, ...]

`fn` must be a module-level function (children import it by reference) and is called as
`fn(rank, world_size, *args)` on every rank, after megatron's `parallel_state` has been
set up for the requested tensor-parallel size. Arguments and results travel by pickle:
keep them to tensors, numbers, strings and containers of those.

Failure handling, so that a broken rank fails a test instead of hanging the session:
- an exception in `fn` on any rank is formatted in the child and re-raised in the parent
  as `RankError`, with every failing rank's traceback;
- the process group has a short collective timeout, so a rank stuck in a collective
  (because a peer raised) errors out by itself;
- the parent waits at most `timeout` seconds per call; on expiry it kills the pool and
  raises `RankError`;
- after any failure the pool is torn down (its ranks may disagree about which
  collectives ran) and the next `run` spawns a fresh one.

Resources: a call must leave nothing running behind it, so that a leak fails the test that
leaks instead of slowing every later one (each gloo process group owns threads; a megatron
set-up that is never released is about 60). After each call every rank checks that
- no process group the call created is still registered (megatron's own teardown leaves its
  groups registered: use `megatron_dflash.common.parallel`'s set-up / teardown pair), and
- it holds at most `THREAD_BOUND` threads (thread pools that were never joined).
"""

from __future__ import annotations

import datetime
import gc
import os
import pickle
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import wait
from typing import Any, Callable, Optional

import torch.multiprocessing as mp

# Seconds a rank may wait in one collective before it errors out.
COLLECTIVE_TIMEOUT_S = 60.0
# Seconds the parent waits for the ranks to start (spawn + imports + rendezvous).
START_TIMEOUT_S = 180.0
# Seconds the parent waits for one `run` call.
CALL_TIMEOUT_S = 120.0
# Once a rank has failed, seconds the others get to finish before the pool is killed
# (they are likely stuck in a collective the failed rank never joined).
FAILURE_GRACE_S = 5.0
# Threads a rank may hold when a call returns. Measured on the gloo ranks of the multi-rank
# modules (world 2 and 4): 4-13 without parallel_state, 64-68 with the pool's TP = world layout
# set up (about 60 for megatron's groups), up to ~90 while a finished training run's destroyed
# groups await the garbage collector, all back to <= 68 after it. A megatron set-up that is
# never released adds about 60 (122 over the pool's layout). The bound leaves ~30 threads of
# room above the steady state and is under one leaked set-up.
THREAD_BOUND = 100


class RankError(AssertionError):
    """A call on the simulated ranks failed; the message holds the ranks' tracebacks."""


# --------------------------------------------------------------------------------------
# The child side
# --------------------------------------------------------------------------------------


def _set_tensor_parallel(tp: Optional[int]) -> None:
    """Leave megatron's parallel_state set up for TP size `tp` (None: not set up).

    Reads the state rather than remembering the last call's: a called function may have torn it
    down or set up another layout (the training loop does when its job asks for other sizes).
    Set-up and teardown go through the product's pair, which releases the process groups (and
    their threads) that megatron's own teardown leaves behind.
    """
    from megatron.core import parallel_state

    from megatron_dflash.common.parallel import destroy_model_parallel, initialize_model_parallel

    if parallel_state.model_parallel_is_initialized():
        if tp is not None and _layout_is_plain_tp(tp):
            return
        destroy_model_parallel()
    if tp is not None:
        initialize_model_parallel(tensor_model_parallel_size=tp)


def _layout_is_plain_tp(tp: int) -> bool:
    """parallel_state is TP = `tp` with every other model-parallel size 1 (what `run` sets up)."""
    from megatron.core import parallel_state

    return (parallel_state.get_tensor_model_parallel_world_size() == tp
            and parallel_state.get_pipeline_model_parallel_world_size() == 1
            and parallel_state.get_context_parallel_world_size() == 1
            and parallel_state.get_expert_model_parallel_world_size() == 1)


def thread_count() -> int:
    """Threads of this process, as the kernel counts them (OpenMP and gloo threads included)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/status has no Threads line")


def rank_thread_count(rank: int, world_size: int) -> int:
    """`thread_count()` as a pool call: `pool.run(rank_thread_count)` -> threads of every rank."""
    return thread_count()


def live_process_groups() -> set:
    """The process groups torch.distributed holds in this rank (the world group included)."""
    from torch.distributed.distributed_c10d import _world

    return set(_world.pg_map)


def _check_nothing_left_behind(name: str, groups_before: set, thread_bound: int) -> None:
    """Fail the call if it left process groups registered or more than `thread_bound` threads.

    `groups_before`: the groups alive when `fn` was called. Garbage is collected before the
    thread count fails: a destroyed group dropped inside a reference cycle (a model that held
    it) keeps its threads until the collector frees it.
    """
    left = len(live_process_groups() - groups_before)
    if left:
        raise AssertionError(
            f"{name} left {left} process group(s) it created alive in this rank: destroy them before "
            "returning (megatron_dflash.common.parallel.destroy_model_parallel for megatron's parallel_state)."
        )
    count = thread_count()
    if count > thread_bound:
        gc.collect()
        count = thread_count()
    if count > thread_bound:
        raise AssertionError(
            f"{count} threads in this rank after {name} (bound {thread_bound}): the call left threads "
            "behind; join the thread pools it started."
        )


def _child_main(rank: int, world_size: int, init_file: str, conn, collective_timeout_s: float,
                thread_bound: int) -> None:
    """Rank process: join the gloo group, then serve calls until told to stop."""
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout_s),
        )
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", None))

    try:
        while True:
            try:
                payload = conn.recv_bytes()
            except EOFError:  # the parent went away
                break
            try:
                message = pickle.loads(payload)
                if message[0] == "stop":
                    break
                _, fn, args, kwargs, tp = message
                _set_tensor_parallel(tp)
                groups_before = live_process_groups()
                result = fn(rank, world_size, *args, **kwargs)
                _check_nothing_left_behind(getattr(fn, "__qualname__", repr(fn)), groups_before, thread_bound)
                reply = ("ok", result)
            except BaseException:
                reply = ("error", traceback.format_exc())
            try:
                conn.send(reply)
            except Exception:  # e.g. an unpicklable result
                conn.send(("error", traceback.format_exc()))
    finally:
        try:
            _set_tensor_parallel(None)
            dist.destroy_process_group()
        except Exception:
            pass
        # A normal interpreter exit takes seconds here (library shutdown hooks); the rank
        # has nothing left to save, so leave at once.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


# --------------------------------------------------------------------------------------
# The parent side
# --------------------------------------------------------------------------------------


class RankPool:
    """`world_size` gloo ranks in child processes, started once, reused by `run`."""

    def __init__(
        self,
        world_size: int,
        *,
        collective_timeout_s: float = COLLECTIVE_TIMEOUT_S,
        start_timeout_s: float = START_TIMEOUT_S,
        thread_bound: int = THREAD_BOUND,
    ):
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be >= 1")
        self.world_size = world_size
        self.collective_timeout_s = collective_timeout_s
        self.start_timeout_s = start_timeout_s
        self.thread_bound = thread_bound
        self._procs: list = []
        self._conns: list = []
        self._tmpdir: Optional[tempfile.TemporaryDirectory] = None

    # ---------------------------------------------------------------- life cycle
    @property
    def started(self) -> bool:
        return bool(self._procs)

    def start(self) -> None:
        if self.started:
            return
        ctx = mp.get_context("spawn")
        self._tmpdir = tempfile.TemporaryDirectory(prefix=f"tp{self.world_size}_")
        init_file = os.path.join(self._tmpdir.name, "rendezvous")
        # Children inherit the environment at spawn: one thread each, set before torch loads.
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            for rank in range(self.world_size):
                parent_conn, child_conn = ctx.Pipe(duplex=True)
                proc = ctx.Process(
                    target=_child_main,
                    args=(rank, self.world_size, init_file, child_conn, self.collective_timeout_s,
                          self.thread_bound),
                    name=f"tp-rank-{rank}-of-{self.world_size}",
                    daemon=True,
                )
                proc.start()
                child_conn.close()
                self._procs.append(proc)
                self._conns.append(parent_conn)
        finally:
            if saved is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        replies = self._collect(self.start_timeout_s, what="start")
        errors = [(r, text) for r, (kind, text) in enumerate(replies) if kind != "ready"]
        if errors:
            self.close()
            raise RankError(self._format_errors(f"{self.world_size} ranks failed to start", errors))

    def close(self, join_timeout_s: float = 10.0) -> None:
        """Stop every child by its handle: stop message, join, then terminate / kill."""
        for conn in self._conns:
            try:
                conn.send_bytes(pickle.dumps(("stop",)))
            except Exception:
                pass
        deadline = time.monotonic() + join_timeout_s
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(3.0)
            if proc.is_alive():
                proc.kill()
                proc.join(3.0)
        for conn in self._conns:
            try:
                conn.close()
            except Exception:
                pass
        self._procs, self._conns = [], []
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    def __enter__(self) -> "RankPool":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- calls
    def run(
        self,
        fn: Callable,
        *args: Any,
        tp: Optional[int] = -1,
        timeout: float = CALL_TIMEOUT_S,
        **kwargs: Any,
    ) -> list:
        """`[fn(rank, world_size, *args, **kwargs) for each rank]`, run on all ranks at once.

        Args:
            fn: a module-level function (pickled by reference).
            tp: tensor-parallel size for megatron's parallel_state in the children;
                default: the world size; None: leave parallel_state uninitialised.
            timeout: seconds to wait for all ranks before the pool is killed.

        Raises:
            RankError: with every failing rank's traceback, if `fn` raised on any rank,
                a rank died, or the call ran past `timeout`.
        """
        __tracebackhide__ = True  # pytest: show the test and the ranks' tracebacks, not this frame
        if tp == -1:
            tp = self.world_size
        try:
            payload = pickle.dumps(("call", fn, args, kwargs, tp))
        except Exception as err:
            raise RankError(f"cannot send {fn!r} and its arguments to the ranks: {err}") from err
        self.start()
        for conn in self._conns:
            conn.send_bytes(payload)
        replies = self._collect(timeout, what=getattr(fn, "__qualname__", repr(fn)))
        errors = [(r, text) for r, (kind, text) in enumerate(replies) if kind != "ok"]
        if errors:
            # Ranks that failed part-way may disagree on the collectives that ran: start over.
            self.close(join_timeout_s=2.0)
            name = getattr(fn, "__qualname__", repr(fn))
            raise RankError(self._format_errors(f"{name} failed on {len(errors)} of {self.world_size} ranks", errors))
        return [value for _, value in replies]

    def _collect(self, timeout: float, *, what: str) -> list:
        """One reply per rank, or ("error", why) for ranks that died or ran out of time."""
        replies: list = [None] * self.world_size
        pending = {conn: rank for rank, conn in enumerate(self._conns)}
        deadline = time.monotonic() + timeout
        failed_first: Optional[int] = None
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready = wait(list(pending) + [self._procs[r].sentinel for r in pending.values()], timeout=left)
            for obj in ready:
                if obj in pending:
                    rank = pending.pop(obj)
                    try:
                        replies[rank] = obj.recv()
                    except (EOFError, OSError):
                        self._procs[rank].join(1.0)
                        replies[rank] = ("error", f"rank {rank} died (exit code {self._procs[rank].exitcode})")
                    except Exception:
                        replies[rank] = ("error", "reply could not be read:\n" + traceback.format_exc())
            for rank in list(pending.values()):
                proc = self._procs[rank]
                conn = self._conns[rank]
                if not proc.is_alive() and not conn.poll():
                    pending.pop(conn)
                    replies[rank] = ("error", f"rank {rank} died (exit code {proc.exitcode})")
            if failed_first is None and pending:
                failed = [r for r, reply in enumerate(replies) if reply is not None and reply[0] == "error"]
                if failed:
                    failed_first = failed[0]
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        if pending:
            for rank in pending.values():
                if failed_first is not None:
                    why = f"rank {rank} did not finish {what} after rank {failed_first} failed (killed)"
                else:
                    why = f"rank {rank} gave no answer to {what} within {timeout:.0f} s (killed)"
                replies[rank] = ("error", why)
            # The pending ranks are stuck: do not wait long for them to stop.
            self.close(join_timeout_s=1.0)
        return replies

    @staticmethod
    def _format_errors(title: str, errors: list) -> str:
        parts = [title + ":"]
        for rank, text in errors:
            parts.append(f"---- rank {rank} ----\n{text}")
        return "\n".join(parts)


class RankPools:
    """Session-wide pools, one per world size, spawned on first use."""

    def __init__(self):
        self._pools: dict[int, RankPool] = {}

    def __call__(self, world_size: int) -> RankPool:
        pool = self._pools.get(world_size)
        if pool is None:
            pool = self._pools[world_size] = RankPool(world_size)
        pool.start()
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
