"""Peak memory of a callable on the CPU, as the benchmarks measure it."""

from __future__ import annotations


def alloc_peak(step) -> int:
    """High-water mark of the bytes torch allocates during ``step()`` beyond what was live before it, from the
    profiler's memory events (``profile_memory=True``): the tensors the step needs at its worst moment,
    without what the C allocator keeps after a free (which the process RSS includes). The CPU counterpart of
    ``torch.cuda.max_memory_allocated``. Run it on an untimed pass: the profiler slows the step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak
