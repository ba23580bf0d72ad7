"""Tests for megatron_dflash.draft.attention.

The dense backend is the oracle; it is itself checked against a per-query Python loop written from the
visibility rule in the contract. The chunked backend must match the dense one in outputs and in every
gradient; flex is checked in forward (FlexAttention has no CPU backward).
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_dflash.draft import attention as attention_module
from megatron_dflash.draft.attention import BlockVisibility, block_attention, dense_block_attention_mask

NAMES = ("query", "context_key", "context_value", "block_key", "block_value")


# --------------------------------------------------------------------------------------------------------
# Fixtures and helpers
# --------------------------------------------------------------------------------------------------------


def make_visibility(causal=False, sliding_window=None) -> BlockVisibility:
    """B=3, N=5, S=24, W=4.

    row 0: unpacked; anchor 0 (empty context) and an anchor at the last possible position (20).
    row 1: packed documents [0, 9), [9, 17), [17, 24); a block at a document start (empty context, start > 0);
           the last two blocks are invalid.
    row 2: no valid block at all.
    """
    anchors = torch.tensor([[0, 3, 7, 12, 20], [9, 2, 13, 0, 0], [0, 0, 0, 0, 0]])
    starts = torch.tensor([[0, 0, 0, 0, 0], [9, 0, 9, 0, 0], [0, 0, 0, 0, 0]])
    valid = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    return BlockVisibility(anchors, starts, valid, causal=causal, sliding_window=sliding_window)


SEQ, BLOCK = 24, 4


def make_inputs(B=3, N=5, W=BLOCK, S=SEQ, Hq=4, Hkv=2, D=8, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = {
        "query": (B, N, W, Hq, D),
        "context_key": (B, S, Hkv, D),
        "context_value": (B, S, Hkv, D),
        "block_key": (B, N, W, Hkv, D),
        "block_value": (B, N, W, Hkv, D),
    }
    return {
        name: torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
        for name, shape in shapes.items()
    }


def run(inputs, visibility, backend, **kwargs):
    """Forward + backward with a fixed random cotangent; returns (output, {name: grad})."""
    for tensor in inputs.values():
        tensor.grad = None
    D = inputs["query"].shape[-1]
    out = block_attention(*(inputs[n] for n in NAMES), visibility, scale=D**-0.5, backend=backend, **kwargs)
    gen = torch.Generator().manual_seed(123)
    cotangent = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out.dtype)
    out.backward(cotangent)
    grads = {n: inputs[n].grad for n in NAMES}
    # A tensor that does not reach the output (context keys when S == 0) has no grad: count it as zero.
    grads = {n: torch.zeros_like(inputs[n]) if g is None else g.clone() for n, g in grads.items()}
    return out.detach(), grads


def naive_attention(inputs, visibility: BlockVisibility) -> torch.Tensor:
    """Per-query loop straight from the contract's visibility rule (fp64). Invalid blocks give zeros."""
    q, ck, cv, bk, bv = (inputs[n].detach().double() for n in NAMES)
    B, N, W, Hq, D = q.shape
    S, Hkv = ck.shape[1], ck.shape[2]
    group = Hq // Hkv
    window = visibility.sliding_window
    out = torch.zeros_like(q)
    for b in range(B):
        for n in range(N):
            if not bool(visibility.block_valid[b, n]):
                continue
            a = int(visibility.anchor_positions[b, n])
            start = int(visibility.context_start[b, n])
            for s in range(W):
                context = [j for j in range(start, a) if window is None or (a + s) - j < window]
                slots = [
                    k
                    for k in range(W)
                    if (not visibility.causal or k <= s) and (window is None or abs(s - k) < window)
                ]
                for h in range(Hq):
                    kv = h // group
                    keys = [ck[b, j, kv] for j in context] + [bk[b, n, k, kv] for k in slots]
                    values = [cv[b, j, kv] for j in context] + [bv[b, n, k, kv] for k in slots]
                    scores = torch.stack([q[b, n, s, h] @ key for key in keys]) * D**-0.5
                    probs = torch.softmax(scores, dim=0)
                    out[b, n, s, h] = (probs[:, None] * torch.stack(values)).sum(0)
    return out


# --------------------------------------------------------------------------------------------------------
# The oracle
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, 2, 6, 100])
def test_dense_matches_naive_loop(causal, window):
    visibility = make_visibility(causal, window)
    inputs = make_inputs(dtype=torch.float64)
    with torch.no_grad():
        dense = block_attention(*(inputs[n] for n in NAMES), visibility, scale=8**-0.5, backend="dense")
    torch.testing.assert_close(dense, naive_attention(inputs, visibility), rtol=1e-10, atol=1e-10)


def test_dense_mask_contract():
    visibility = make_visibility()
    B, N, W, S = 3, 5, BLOCK, SEQ
    mask = dense_block_attention_mask(visibility, S, W, torch.float16)
    assert mask.shape == (B, 1, N * W, S + N * W) and mask.dtype == torch.float16
    assert bool(((mask == 0) | (mask == float("-inf"))).all())
    visible = (mask == 0).squeeze(1)
    assert bool(visible.any(-1).all()), "no row may be fully masked"
    # Row 0, block 2 (anchor 7): context 0..6 and its own 4 slots, nothing else.
    row = visible[0, 2 * W]
    assert row[:S].nonzero().flatten().tolist() == list(range(7))
    assert row[S:].nonzero().flatten().tolist() == [2 * W + k for k in range(W)]
    # Row 1, block 2 (anchor 13, document start 9): context 9..12.
    assert visible[1, 2 * W, :S].nonzero().flatten().tolist() == [9, 10, 11, 12]
    # Invalid blocks see their own slots only.
    for b, n in [(1, 3), (2, 0)]:
        rows = visible[b, n * W : (n + 1) * W]
        assert not bool(rows[:, :S].any())
        assert rows[:, S:].sum().item() == W * W


# --------------------------------------------------------------------------------------------------------
# Chunked == dense (outputs and gradients)
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, 3, 10], ids=["full", "window<block", "window<seq"])
@pytest.mark.parametrize("chunk_blocks", [1, 3, 5, None])
def test_chunked_matches_dense(causal, window, chunk_blocks):
    visibility = make_visibility(causal, window)
    inputs = make_inputs()
    dense_out, dense_grads = run(inputs, visibility, "dense")
    out, grads = run(inputs, visibility, "chunked", chunk_blocks=chunk_blocks)
    torch.testing.assert_close(out, dense_out, rtol=1e-5, atol=1e-5)
    for name in NAMES:
        torch.testing.assert_close(grads[name], dense_grads[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1), (6, 3)], ids=["mha", "gqa", "mqa", "gqa-6-3"])
def test_chunked_matches_dense_head_layouts(heads):
    Hq, Hkv = heads
    visibility = make_visibility(causal=False, sliding_window=5)
    inputs = make_inputs(Hq=Hq, Hkv=Hkv, seed=1)
    dense_out, dense_grads = run(inputs, visibility, "dense")
    out, grads = run(inputs, visibility, "chunked", chunk_blocks=2)
    torch.testing.assert_close(out, dense_out, rtol=1e-5, atol=1e-5)
    for name in NAMES:
        torch.testing.assert_close(grads[name], dense_grads[name], rtol=1e-5, atol=1e-5, msg=name)


def test_chunked_gradcheck_fp64():
    """Finite-difference check of the chunked path, including empty contexts and invalid blocks."""
    anchors = torch.tensor([[0, 2, 5], [3, 0, 0]])
    starts = torch.tensor([[0, 0, 3], [0, 0, 0]])
    valid = torch.tensor([[True, True, True], [True, False, False]])
    visibility = BlockVisibility(anchors, starts, valid, causal=True, sliding_window=3)
    inputs = make_inputs(B=2, N=3, W=3, S=8, Hq=2, Hkv=1, D=3, dtype=torch.float64)

    def fn(*tensors):
        return block_attention(*tensors, visibility, scale=0.7, backend="chunked", chunk_blocks=2)

    assert torch.autograd.gradcheck(fn, tuple(inputs[n] for n in NAMES), fast_mode=True)


def test_empty_context_and_rows_without_valid_blocks():
    visibility = make_visibility(causal=True, sliding_window=3)
    inputs = make_inputs()
    for backend in ("dense", "chunked"):
        out, grads = run(inputs, visibility, backend, chunk_blocks=2)
        assert bool(torch.isfinite(out).all()), backend
        for name, grad in grads.items():
            assert bool(torch.isfinite(grad).all()), (backend, name)
        invalid = ~visibility.block_valid
        # Invalid blocks: output exactly zero, and nothing flows back through them.
        assert bool((out[invalid] == 0).all())
        for name in ("query", "block_key", "block_value"):
            assert bool((grads[name][invalid] == 0).all()), (backend, name)
        # Row 2 has no valid block: its context gets no gradient either.
        assert bool((grads["context_key"][2] == 0).all()) and bool((grads["context_value"][2] == 0).all())
        # Anchor 0 (row 0, block 0) and a block at its document start (row 1, block 0) see no context: they
        # still attend to their own slots, and changing the context does not change them.
        assert bool((out[0, 0] != 0).any()) and bool((out[1, 0] != 0).any())
        with torch.no_grad():
            shifted = dict(inputs)
            shifted["context_key"] = inputs["context_key"] + 1
            shifted["context_value"] = inputs["context_value"] - 2
            again = block_attention(
                *(shifted[n] for n in NAMES), visibility, scale=8**-0.5, backend=backend, chunk_blocks=2
            )
        assert torch.equal(again[:, 0], out[:, 0]) and not torch.equal(again[0, 1], out[0, 1])


@pytest.mark.parametrize("chunk_blocks", [1, 2])
def test_chunks_without_any_valid_block(chunk_blocks):
    """Chunks where no row has a valid block (or only blocks with empty context) have no context keys."""
    visibility = BlockVisibility(
        torch.tensor([[5, 0, 0, 0], [7, 3, 0, 0]]),
        torch.tensor([[0, 0, 0, 0], [0, 3, 0, 0]]),
        torch.tensor([[True, False, False, False], [True, True, False, False]]),
        causal=True,
    )
    inputs = make_inputs(B=2, N=4)
    dense_out, dense_grads = run(inputs, visibility, "dense")
    out, grads = run(inputs, visibility, "chunked", chunk_blocks=chunk_blocks)
    torch.testing.assert_close(out, dense_out, rtol=1e-5, atol=1e-5)
    for name in NAMES:
        assert bool(torch.isfinite(grads[name]).all()), name
        torch.testing.assert_close(grads[name], dense_grads[name], rtol=1e-5, atol=1e-5, msg=name)
    assert bool((out[:, 2:] == 0).all())


def test_empty_context_sequence():
    """S == 0: only in-block attention remains."""
    visibility = BlockVisibility(
        torch.zeros(1, 2, dtype=torch.long),
        torch.zeros(1, 2, dtype=torch.long),
        torch.tensor([[True, False]]),
    )
    inputs = make_inputs(B=1, N=2, S=0)
    dense_out, dense_grads = run(inputs, visibility, "dense")
    out, grads = run(inputs, visibility, "chunked")
    torch.testing.assert_close(out, dense_out, rtol=1e-5, atol=1e-5)
    for name in ("query", "block_key", "block_value"):
        torch.testing.assert_close(grads[name], dense_grads[name], rtol=1e-5, atol=1e-5)


def test_bf16_inputs_softmax_in_fp32():
    visibility = make_visibility(sliding_window=10)
    inputs = make_inputs(dtype=torch.bfloat16)
    out, grads = run(inputs, visibility, "chunked", chunk_blocks=2)
    assert out.dtype == torch.bfloat16
    assert all(g.dtype == torch.bfloat16 and bool(torch.isfinite(g).all()) for g in grads.values())
    with torch.no_grad():
        exact = block_attention(
            *(inputs[n].detach().float() for n in NAMES), visibility, scale=8**-0.5, backend="dense"
        )
    # Scores and softmax run in fp32, so only the final rounding to bf16 is lost (relative 2**-9 per
    # element); a bf16 softmax would be off by far more.
    error = (out.float() - exact).abs()
    assert bool((error <= exact.abs() * 2**-8 + 1e-30).all()), error.max()


def test_no_grad_path_matches_grad_path_and_auto():
    visibility = make_visibility(sliding_window=6)
    inputs = make_inputs()
    with_grad, _ = run(inputs, visibility, "chunked", chunk_blocks=2)
    with torch.no_grad():
        plain = block_attention(
            *(inputs[n] for n in NAMES), visibility, scale=8**-0.5, backend="chunked", chunk_blocks=2
        )
        auto = block_attention(*(inputs[n] for n in NAMES), visibility, scale=8**-0.5, chunk_blocks=2)
    assert torch.equal(plain, with_grad)
    assert torch.equal(auto, plain), "auto must pick the chunked backend on CPU"


# --------------------------------------------------------------------------------------------------------
# Flex
# --------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _flex_cpu_skip_reason() -> str | None:
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError as error:
        return f"flex_attention is not available in this torch build: {error}"
    visibility = BlockVisibility(
        torch.tensor([[2]]), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool)
    )
    inputs = make_inputs(B=1, N=1, W=2, S=4, Hq=2, Hkv=1, D=4)
    try:
        with torch.no_grad():
            block_attention(*(inputs[n] for n in NAMES), visibility, scale=0.5, backend="flex")
    except (NotImplementedError, RuntimeError) as error:
        return f"eager flex_attention does not run on CPU in this torch build: {error}"
    return None


@pytest.mark.parametrize(
    "causal, window, heads",
    [
        (False, None, (4, 2)),
        (True, None, (4, 2)),
        (False, 3, (4, 2)),
        (True, 10, (4, 2)),
        (False, 10, (2, 2)),
    ],
)
def test_flex_forward_matches_dense(causal, window, heads):
    reason = _flex_cpu_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    visibility = make_visibility(causal, window)
    inputs = make_inputs(Hq=heads[0], Hkv=heads[1], seed=2)
    with torch.no_grad():
        args = [inputs[n] for n in NAMES]
        dense = block_attention(*args, visibility, scale=8**-0.5, backend="dense")
        flex = block_attention(*args, visibility, scale=8**-0.5, backend="flex")
    assert bool(torch.isfinite(flex).all())
    assert bool((flex[~visibility.block_valid] == 0).all())
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------------------
# Memory: the chunked path never builds [B, *, N*W, S + N*W]
# --------------------------------------------------------------------------------------------------------


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor produced by any aten op (forward, recompute and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in torch.utils._pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        return out


def _peak_live_bytes(fn) -> int:
    """Peak of (allocated - freed) CPU bytes while ``fn`` runs, from the profiler's allocator events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def _memory_case():
    B, N, W, S, Hq, Hkv, D = 1, 32, 4, 256, 4, 2, 8
    anchors = torch.arange(N).view(1, N) * 7 + 20
    visibility = BlockVisibility(anchors, torch.zeros_like(anchors), torch.ones(1, N, dtype=torch.bool))
    inputs = make_inputs(B=B, N=N, W=W, S=S, Hq=Hq, Hkv=Hkv, D=D)
    return visibility, inputs, (B, N, W, S, Hq, Hkv, D)


def test_chunked_never_materialises_dense_scores():
    visibility, inputs, (B, N, W, S, Hq, Hkv, D) = _memory_case()
    chunk_scores = B * Hq * 1 * W * S  # context scores of one block
    largest_input = max(t.numel() for t in inputs.values())
    bound = max(chunk_scores, largest_input)
    dense_scores = B * Hq * N * W * (S + N * W)
    assert dense_scores > 40 * bound  # the case separates the two regimes

    with _LargestTensor() as probe:
        run(inputs, visibility, "chunked", chunk_blocks=1)
    assert probe.largest <= bound, (probe.largest, bound)

    # The probe is able to see the dense path's big tensors.
    with _LargestTensor() as probe:
        run(inputs, visibility, "dense")
    assert probe.largest >= dense_scores


class _LargestBoolTensor(_LargestTensor):
    """Records the largest bool tensor (masks) produced by any aten op."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in torch.utils._pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.bool:
                self.largest = max(self.largest, tensor.numel())
        return out


def test_chunked_context_mask_has_one_row_per_block_without_window():
    """Without a sliding window the context rule does not depend on the slot: the kernel's masks stay
    ``[blocks, keys]`` (forward and backward), not ``W`` times that; a window needs the slot and gets it."""
    visibility, inputs, (B, N, W, S, Hq, Hkv, D) = _memory_case()
    with _LargestBoolTensor() as probe:
        run(inputs, visibility, "chunked", chunk_blocks=N)
    assert probe.largest <= B * N * S, (probe.largest, B * N * S)

    windowed = BlockVisibility(visibility.anchor_positions, visibility.context_start, visibility.block_valid,
                               sliding_window=64)
    with _LargestBoolTensor() as probe:
        run(inputs, windowed, "chunked", chunk_blocks=N)
    assert probe.largest > B * N * S


def test_chunked_peak_memory_is_bounded_by_one_chunk():
    visibility, inputs, (B, N, W, S, Hq, Hkv, D) = _memory_case()
    small = _peak_live_bytes(lambda: run(inputs, visibility, "chunked", chunk_blocks=1))
    whole = _peak_live_bytes(lambda: run(inputs, visibility, "chunked", chunk_blocks=N))
    dense = _peak_live_bytes(lambda: run(inputs, visibility, "dense"))
    one_chunk_scores = 4 * B * Hq * W * S
    all_scores = 4 * B * Hq * N * W * S
    # Checkpointing must keep one chunk at a time alive: with chunk_blocks=1 the peak is a small multiple
    # of one chunk (plus inputs, outputs and gradients), far below the scores of all blocks.
    assert small < all_scores / 2, (small, all_scores)
    assert small < whole / 4, (small, whole)
    assert small < dense / 10, (small, dense)
    assert whole > all_scores  # the measurement does see score tensors
    assert one_chunk_scores < small


class _OpCounter(TorchDispatchMode):
    """Counts matmuls, and the allocations of tensors with exactly `numel` elements, while active."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.matmuls, self.full_size = numel, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.bmm):
            self.matmuls += 1
        inputs = {x.untyped_storage().data_ptr() for x in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(x, torch.Tensor)}
        for x in torch.utils._pytree.tree_leaves(out):
            if isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() not in inputs and x.numel() == self.numel:
                self.full_size += 1
        return out


@pytest.mark.parametrize("chunk_blocks", [1, 5])
def test_chunked_backward_recomputes_only_scores(chunk_blocks):
    """Backward runs 5 matmuls per part and chunk (the scores, dV, dP, dQ, dK: no second P V product), and
    the context key/value gradients of all chunks land in one buffer each (no full-size zero tensor per
    chunk): the number of full-size context-gradient tensors does not grow with the number of chunks."""
    visibility = make_visibility(causal=False)
    inputs = make_inputs(Hq=4, Hkv=4)  # no grouped heads: one matmul per product
    D = inputs["query"].shape[-1]
    out = block_attention(*(inputs[n] for n in NAMES), visibility, scale=D**-0.5, backend="chunked",
                          chunk_blocks=chunk_blocks)
    chunks = math.ceil(visibility.num_blocks / chunk_blocks)
    # Chunks whose blocks see any context key run the context part too (here every chunk but the first one
    # when chunk_blocks=1: row 0's block 0 and row 1's block 0 both have an empty context).
    with _OpCounter(inputs["context_key"].numel()) as counter:
        out.backward(torch.ones_like(out))
    parts = counter.matmuls / 5
    assert parts == int(parts) and chunks <= parts <= 2 * chunks, (counter.matmuls, chunks)
    assert counter.full_size <= 2, counter.full_size


# --------------------------------------------------------------------------------------------------------
# Construction and errors
# --------------------------------------------------------------------------------------------------------


def test_from_plan_duck_typed():
    plan = SimpleNamespace(
        anchor_positions=torch.tensor([[3, 0]]),
        context_start=torch.tensor([[1, 0]]),
        block_valid=torch.tensor([[True, False]]),
        block_size=4,
    )
    visibility = BlockVisibility.from_plan(plan, causal=True, sliding_window=8)
    assert visibility.causal and visibility.sliding_window == 8
    assert visibility.anchor_positions is plan.anchor_positions
    assert (visibility.batch_size, visibility.num_blocks) == (1, 2)
    with pytest.raises(TypeError, match="context_start"):
        BlockVisibility.from_plan(SimpleNamespace(anchor_positions=plan.anchor_positions, block_valid=None))


def test_from_real_plan_with_documents():
    plan_module = pytest.importorskip("megatron_dflash.plan.batch_plan")
    document_ids = torch.tensor([[0] * 10 + [1] * 8 + [2] * 6, [0] * 24])
    plan = plan_module.DFlashBatchPlan.from_anchors(
        torch.tensor([[2, 10, 13, 18], [0, 5, 9, 20]]),
        block_size=BLOCK,
        seq_length=SEQ,
        block_valid=torch.tensor([[True, True, True, False], [True, True, True, True]]),
        document_ids=document_ids,
    )
    visibility = BlockVisibility.from_plan(plan, causal=False, sliding_window=7)
    assert visibility.context_start[0, :3].tolist() == [0, 10, 10]
    inputs = make_inputs(B=2, N=4)
    dense_out, dense_grads = run(inputs, visibility, "dense")
    out, grads = run(inputs, visibility, "chunked", chunk_blocks=3)
    torch.testing.assert_close(out, dense_out, rtol=1e-5, atol=1e-5)
    for name in NAMES:
        torch.testing.assert_close(grads[name], dense_grads[name], rtol=1e-5, atol=1e-5, msg=name)


def test_visibility_validation():
    a = torch.zeros(2, 3, dtype=torch.long)
    ok = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="same shape"):
        BlockVisibility(a, torch.zeros(2, 4, dtype=torch.long), ok)
    with pytest.raises(ValueError, match=r"\[B, N\]"):
        BlockVisibility(torch.zeros(6, dtype=torch.long), torch.zeros(6, dtype=torch.long), ok.flatten())
    with pytest.raises(ValueError, match="bool"):
        BlockVisibility(a, a, a)
    with pytest.raises(ValueError, match="integer"):
        BlockVisibility(a.float(), a, ok)
    with pytest.raises(ValueError, match="sliding_window"):
        BlockVisibility(a, a, ok, sliding_window=0)


def test_bad_inputs_raise_clear_errors():
    visibility = make_visibility()
    good = make_inputs()
    args = [good[n].detach() for n in NAMES]

    def call(*tensors, vis=visibility, **kwargs):
        return block_attention(*tensors, vis, scale=0.1, **kwargs)

    q, ck, cv, bk, bv = args
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        call(q[..., :3, :], ck, cv, bk, bv)
    with pytest.raises(ValueError, match="batch size mismatch"):
        call(q, ck[:2], cv[:2], bk, bv)
    with pytest.raises(ValueError, match="leading dims"):
        call(q, ck, cv, bk[:, :4], bv[:, :4])
    with pytest.raises(ValueError, match="head dim"):
        call(q[..., :4], ck, cv, bk, bv)
    with pytest.raises(ValueError, match="context_key and context_value"):
        call(q, ck, cv[:, :5], bk, bv)
    with pytest.raises(ValueError, match=r"\[B, N, W, Hq, D\]"):
        call(q[0], ck, cv, bk, bv)
    with pytest.raises(ValueError, match="dtypes differ"):
        call(q.double(), ck, cv, bk, bv)
    with pytest.raises(ValueError, match="visibility is for"):
        call(*args, vis=BlockVisibility.from_plan(SimpleNamespace(
            anchor_positions=torch.zeros(3, 4, dtype=torch.long),
            context_start=torch.zeros(3, 4, dtype=torch.long),
            block_valid=torch.ones(3, 4, dtype=torch.bool),
        )))
    with pytest.raises(ValueError, match="backend"):
        call(*args, backend="sdpa")
    with pytest.raises(ValueError, match="chunk_blocks"):
        call(*args, chunk_blocks=0)
    with pytest.raises(ValueError, match="scale"):
        block_attention(*args, visibility, scale=math.nan)
    with pytest.raises(TypeError, match="BlockVisibility"):
        block_attention(*args, object(), scale=0.1)


def test_flex_without_backward_on_cpu_says_so():
    if _flex_cpu_skip_reason() is not None:
        pytest.skip(_flex_cpu_skip_reason())
    inputs = make_inputs()
    with pytest.raises(ValueError, match="chunked"):
        block_attention(*(inputs[n] for n in NAMES), make_visibility(), scale=0.1, backend="flex")


# --------------------------------------------------------------------------------------------------------
# Key tiles and mask bands (the CPU kernel's fast paths)
# --------------------------------------------------------------------------------------------------------


def make_sorted_visibility(causal=False, sliding_window=None) -> BlockVisibility:
    """B=2, N=6, S=40, W=4, anchors sorted as the batch plan samples them, so a chunk's blocks share most of
    their context keys. Row 1 is packed (documents [0, 14) and [14, 40)) and has an invalid block inside a
    chunk."""
    anchors = torch.tensor([[5, 9, 14, 22, 30, 36], [3, 12, 16, 20, 27, 33]])
    starts = torch.tensor([[0, 0, 0, 0, 0, 0], [0, 0, 14, 14, 14, 14]])
    valid = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 1, 1]], dtype=torch.bool)
    return BlockVisibility(anchors, starts, valid, causal=causal, sliding_window=sliding_window)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, 3, 10], ids=["full", "window<block", "window<seq"])
@pytest.mark.parametrize("chunk_blocks", [2, 6])
@pytest.mark.parametrize("key_tile", [3, 7])
def test_chunked_key_tiles_and_mask_bands_match_dense(monkeypatch, causal, window, chunk_blocks, key_tile):
    """Context keys split into tiles merged by log-sum-exp, and masks applied only around the keys every
    block of a chunk sees: outputs and every gradient equal the dense oracle's."""
    monkeypatch.setattr(attention_module, "_KEY_TILE_CPU", key_tile)
    visibility = make_sorted_visibility(causal, window)
    inputs = make_inputs(B=2, N=6, S=40)
    dense_out, dense_grads = run(inputs, visibility, "dense")
    out, grads = run(inputs, visibility, "chunked", chunk_blocks=chunk_blocks)
    torch.testing.assert_close(out, dense_out, rtol=1e-5, atol=1e-5)
    for name in NAMES:
        torch.testing.assert_close(grads[name], dense_grads[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("window", [None, 3, 10])
@pytest.mark.parametrize("chunk_blocks", [1, 2, 3, 6])
def test_open_key_range_is_seen_by_every_valid_slot(window, chunk_blocks):
    """The keys a chunk leaves unmasked are visible, by the dense mask's rule, to every slot of every valid
    block of the chunk; and the range is not empty where the chunk's blocks share keys."""
    visibility = make_sorted_visibility(sliding_window=window)
    S, W = 40, 4
    mask = dense_block_attention_mask(visibility, S, W, torch.float32)[:, 0, :, :S]  # [B, N*W, S]
    ranges = attention_module._chunk_key_ranges(visibility, S, W, chunk_blocks)
    opened = 0
    for index, (lo, hi, open_lo, open_hi) in enumerate(ranges):
        assert lo <= open_lo and open_hi <= hi
        blocks = range(index * chunk_blocks, min((index + 1) * chunk_blocks, visibility.num_blocks))
        for b in range(visibility.batch_size):
            for n in blocks:
                if visibility.block_valid[b, n]:
                    rows = mask[b, n * W:(n + 1) * W, open_lo:open_hi]
                    assert bool((rows == 0).all()), (index, b, n, open_lo, open_hi)
        opened += max(0, open_hi - open_lo)
    if window is None and chunk_blocks <= 3:  # one chunk of the whole batch shares no key across documents
        assert opened > 0
