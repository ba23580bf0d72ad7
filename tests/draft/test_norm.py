"""`RMSNorm` against autograd through the reference expression (HF Qwen3's arithmetic)."""

from __future__ import annotations

import pytest
import torch

from megatron_dflash.draft.norm import RMSNorm


def _reference(x, weight, eps):
    """HF Qwen3RMSNorm: normalise in fp32, cast back, then scale."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_bit_identical_and_gradients_match(dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 7, 64, generator=gen) * 3).to(dtype).requires_grad_()
    weight = (1 + 0.1 * torch.randn(64, generator=gen)).to(dtype).requires_grad_()
    cotangent = torch.randn(3, 7, 64, generator=gen).to(dtype)
    norm = RMSNorm(64, 1e-6, dtype=dtype)
    out = norm(x, weight)
    expected = _reference(x, weight, 1e-6)
    assert torch.equal(out, expected)  # served drafts see the same bits
    grads = torch.autograd.grad(out, (x, weight), cotangent)
    expected_grads = torch.autograd.grad(expected, (x, weight), cotangent)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * want.abs().max().item())


def test_gradients_match_fp64_truth_and_own_weight():
    """The input's gradient against the exact derivative (fp64 all the way, where the reference's fp32
    cast is the identity), and the module's own weight gets its gradient when none is passed."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 32, generator=gen, dtype=torch.float64)
    norm = RMSNorm(32, 1e-5)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.2, generator=gen)
    cotangent = torch.randn(5, 32, generator=gen, dtype=torch.float64)
    x32 = x.float().requires_grad_()
    norm(x32).backward(cotangent.float())
    exact_x = x.clone().requires_grad_()
    exact_w = norm.weight.detach().double().requires_grad_()
    out = exact_w * exact_x * torch.rsqrt(exact_x.pow(2).mean(-1, keepdim=True) + 1e-5)
    truth = torch.autograd.grad(out, (exact_x, exact_w), cotangent)
    torch.testing.assert_close(x32.grad.double(), truth[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norm.weight.grad.double(), truth[1], rtol=1e-5, atol=1e-6)


def test_keeps_only_the_input_and_the_row_scale():
    """Backward keeps the input (and the small weight and per-row scale), not a normalised copy."""
    x = torch.randn(16, 48, requires_grad=True)
    norm = RMSNorm(48)
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        norm(x)
    full = [t for t in saved if t.shape == x.shape]
    assert len(full) == 1 and full[0].data_ptr() == x.data_ptr(), [tuple(t.shape) for t in saved]
