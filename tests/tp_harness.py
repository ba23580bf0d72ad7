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
"""

from __future__ import annotations

import datetime
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


class RankError(AssertionError):
    """A call on the simulated ranks failed; the message holds the ranks' tracebacks."""


# --------------------------------------------------------------------------------------
# The child side
# --------------------------------------------------------------------------------------


def _set_tensor_parallel(tp: Optional[int], current: Optional[int]) -> Optional[int]:
    """(Re)initialise megatron's parallel_state for TP size `tp` (None: leave it unset)."""
    from megatron.core import parallel_state

    if tp == current:
        return current
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if tp is not None:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    return tp


def _child_main(rank: int, world_size: int, init_file: str, conn, collective_timeout_s: float) -> None:
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

    current_tp: Optional[int] = None
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
                current_tp = _set_tensor_parallel(tp, current_tp)
                result = fn(rank, world_size, *args, **kwargs)
                reply = ("ok", result)
            except BaseException:
                reply = ("error", traceback.format_exc())
            try:
                conn.send(reply)
            except Exception:  # e.g. an unpicklable result
                conn.send(("error", traceback.format_exc()))
    finally:
        try:
            _set_tensor_parallel(None, current_tp)
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
    ):
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be >= 1")
        self.world_size = world_size
        self.collective_timeout_s = collective_timeout_s
        self.start_timeout_s = start_timeout_s
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
                    args=(rank, self.world_size, init_file, child_conn, self.collective_timeout_s),
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
