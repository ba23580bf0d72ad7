"""`gated_mlp` against autograd through the plain expression `down(act(gate(x), up(x)))`.

The function saves only the input and the gate/up outputs and recomputes the activation in row chunks in
backward; the oracle is the unfused expression differentiated by autograd. Tensor parallelism is covered by
the body's TP tests (tests/test_body_tp.py, tests/test_kimi_k3_tp.py), which compare TP ranks with TP=1.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_dflash.draft import gated_mlp as gated_mlp_module
from megatron_dflash.draft.gated_mlp import gated_mlp, swiglu
from megatron_dflash.draft.kimi_k3.situ import situ_and_mul


def _situ(gate, up):
    return situ_and_mul(gate, up, 2.0, 3.0)


def _inputs(dtype, tokens=(2, 37), hidden=16, intermediate=24, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * std).to(dtype).requires_grad_()

    x = randn(*tokens, hidden)
    weights = (randn(intermediate, hidden, std=0.3), randn(intermediate, hidden, std=0.3),
               randn(hidden, intermediate, std=0.2))
    cotangent = torch.randn(*tokens, hidden, generator=gen, dtype=torch.float64).to(dtype)
    return x, weights, cotangent


def _reference(x, gate_weight, up_weight, down_weight, activation):
    return F.linear(activation(F.linear(x, gate_weight), F.linear(x, up_weight)), down_weight)


@pytest.mark.parametrize("activation", [swiglu, _situ], ids=["swiglu", "situ"])
@pytest.mark.parametrize("chunk_elements", [24 * 5, 2**21], ids=["15-chunks", "one-chunk"])
def test_matches_autograd_of_the_plain_expression(monkeypatch, activation, chunk_elements):
    monkeypatch.setattr(gated_mlp_module, "_CHUNK_ELEMENTS", chunk_elements)
    x, weights, cotangent = _inputs(torch.float64)
    out = gated_mlp(x, *weights, activation)
    grads = torch.autograd.grad(out, (x, *weights), cotangent)
    expected = _reference(x, *weights, activation)
    expected_grads = torch.autograd.grad(expected, (x, *weights), cotangent)
    # SiTU runs in fp32 whatever the input dtype (as K3's modeling code does): fp32 rounding there.
    tol = 1e-12 if activation is swiglu else 1e-6
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)
    for name, got, want in zip(("x", "gate", "up", "down"), grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=name)


def test_frozen_weights_and_input_without_grad(monkeypatch):
    """Only what requires a gradient gets one (a frozen MLP still passes the input's gradient)."""
    monkeypatch.setattr(gated_mlp_module, "_CHUNK_ELEMENTS", 24 * 7)
    x, (gate_weight, up_weight, down_weight), cotangent = _inputs(torch.float64)
    frozen = [w.detach() for w in (gate_weight, up_weight, down_weight)]
    (grad_x,) = torch.autograd.grad(gated_mlp(x, *frozen), (x,), cotangent)
    (expected,) = torch.autograd.grad(_reference(x, *frozen, swiglu), (x,), cotangent)
    torch.testing.assert_close(grad_x, expected, rtol=1e-12, atol=1e-12)
    out = gated_mlp(x.detach(), gate_weight, up_weight, down_weight)
    (grad_down,) = torch.autograd.grad(out, (down_weight,), cotangent)
    (expected,) = torch.autograd.grad(_reference(x.detach(), gate_weight, up_weight, down_weight, swiglu),
                                      (down_weight,), cotangent)
    torch.testing.assert_close(grad_down, expected, rtol=1e-12, atol=1e-12)


def test_bf16_weight_gradients_accumulate_in_fp32(monkeypatch):
    """Many row chunks must not add bf16 rounding per chunk: the weight gradients stay as close to the fp64
    truth as the one-GEMM autograd path's."""
    monkeypatch.setattr(gated_mlp_module, "_CHUNK_ELEMENTS", 24 * 4)
    x, weights, cotangent = _inputs(torch.bfloat16, tokens=(4, 64))
    grads = torch.autograd.grad(gated_mlp(x, *weights), weights, cotangent)
    unfused = torch.autograd.grad(_reference(x, *weights, swiglu), weights, cotangent)
    exact_inputs = [t.detach().double().requires_grad_() for t in (x, *weights)]
    truth = torch.autograd.grad(_reference(*exact_inputs, swiglu), exact_inputs[1:], cotangent.double())
    for got, baseline, want in zip(grads, unfused, truth):
        assert got.dtype == torch.bfloat16
        error = (got.double() - want).abs().max()
        assert error <= 2 * (baseline.double() - want).abs().max() + 1e-3 * want.abs().max()


def test_saves_no_intermediate_sized_tensor_but_gate_and_up():
    """What backward keeps: the input and the gate/up outputs, nothing else of the MLP's width (autograd
    through the plain expression keeps four `[tokens, intermediate]` tensors)."""
    x, weights, _ = _inputs(torch.float32, tokens=(64,), hidden=16, intermediate=40)
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        gated_mlp(x, *weights)
    wide = [t for t in saved if t.shape == (64, 40)]
    assert len(wide) == 2, [tuple(t.shape) for t in saved]
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _reference(x, *weights, swiglu)
    assert len({t.data_ptr() for t in saved if t.shape == (64, 40)}) >= 3
