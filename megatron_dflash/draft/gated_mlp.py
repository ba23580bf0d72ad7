"""The gated MLP `down(act(gate(x), up(x)))` as one autograd function that keeps little for backward.

Autograd through the plain expression `down_proj(silu(gate_proj(x)) * up_proj(x))` keeps five
tensors per layer until backward: `x`, and four `[tokens, intermediate]` ones (the gate and up
outputs, `silu(gate)` and the product that enters `down_proj`); its backward then materialises
three more of that size at once (the gradient arriving from `down_proj` and the two it produces).
With a draft of `N * W` slots and an intermediate size of 3 * hidden, that is the largest part of a
layer's memory.

`gated_mlp` saves only `x`, the gate output and the up output, and runs backward in row chunks:
each chunk recomputes its activation (elementwise, no matmul), so `[tokens, intermediate]`
temporaries exist for one chunk at a time. The matmuls are the same as autograd's: no
recomputed GEMM. The activation is any elementwise function of `(gate, up)` (SwiGLU's
`silu(gate) * up`, Kimi K3's SiTU); its derivative comes from autograd on the chunk, so a new
activation needs no hand-written backward.

Tensor parallel (megatron-core's column/row split): the gate/up weights hold this rank's
`intermediate / TP` rows, the down weight the matching columns. Forward all-reduces the output's
partial sums (row-parallel), backward all-reduces the input gradient (column-parallel input), so
the function costs one all-reduce each way, like the two megatron layers it replaces in the hot
path. The layers themselves stay megatron-core `ColumnParallelLinear` / `RowParallelLinear`
modules: they own the weights, their initialisation and their tensor-parallel attributes.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from ..common.parallel import is_distributed_group

__all__ = ["gated_mlp", "swiglu"]

# Rows of one backward chunk: its `[rows, intermediate]` temporaries hold about this many elements each.
_CHUNK_ELEMENTS = 2**21

GatedActivation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` (SwiGLU)."""
    return torch.nn.functional.silu(gate) * up


def _all_reduce(tensor: torch.Tensor, group) -> torch.Tensor:
    if group is not None and is_distributed_group(group):
        dist.all_reduce(tensor, group=group)
    return tensor


class _GatedMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate_weight, up_weight, down_weight, activation, group, chunk_rows):
        gate = x @ gate_weight.t()  # [T, I_local]
        up = x @ up_weight.t()
        out = torch.empty(x.shape[0], down_weight.shape[0], dtype=x.dtype, device=x.device)  # [T, H]
        for lo in range(0, x.shape[0], chunk_rows):
            rows = slice(lo, lo + chunk_rows)
            torch.mm(activation(gate[rows], up[rows]), down_weight.t(), out=out[rows])
        ctx.save_for_backward(x, gate_weight, up_weight, down_weight, gate, up)
        ctx.activation, ctx.group, ctx.chunk_rows = activation, group, chunk_rows
        return _all_reduce(out, group)  # row-parallel: sum the ranks' partial outputs

    @staticmethod
    def backward(ctx, grad_out):
        x, gate_weight, up_weight, down_weight, gate, up = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        needs = ctx.needs_input_grad
        grad_x = torch.empty_like(x) if needs[0] else None
        # Weight gradients sum over the chunks: in fp32 (or wider) for half-precision weights, as one
        # GEMM over all rows would accumulate them.
        accumulate = torch.promote_types(gate_weight.dtype, torch.float32)
        grad_gate_weight = torch.zeros_like(gate_weight, dtype=accumulate) if needs[1] else None
        grad_up_weight = torch.zeros_like(up_weight, dtype=accumulate) if needs[2] else None
        grad_down_weight = torch.zeros_like(down_weight, dtype=accumulate) if needs[3] else None
        for lo in range(0, x.shape[0], ctx.chunk_rows):
            rows = slice(lo, lo + ctx.chunk_rows)
            with torch.enable_grad():
                gate_rows = gate[rows].detach().requires_grad_()
                up_rows = up[rows].detach().requires_grad_()
                activated = ctx.activation(gate_rows, up_rows)  # [rows, I_local], recomputed
            dy = grad_out[rows]
            if grad_down_weight is not None:
                grad_down_weight += dy.t() @ activated.detach()
            grad_gate, grad_up = torch.autograd.grad(activated, (gate_rows, up_rows), dy @ down_weight)
            del activated
            if grad_gate_weight is not None:
                grad_gate_weight += grad_gate.t() @ x[rows]
            if grad_up_weight is not None:
                grad_up_weight += grad_up.t() @ x[rows]
            if grad_x is not None:
                torch.mm(grad_gate, gate_weight, out=grad_x[rows])
                grad_x[rows].addmm_(grad_up, up_weight)
        if grad_x is not None:
            _all_reduce(grad_x, ctx.group)  # column-parallel input: sum the ranks' partial gradients
        grads = [None if g is None else g.to(w.dtype)
                 for g, w in ((grad_gate_weight, gate_weight), (grad_up_weight, up_weight),
                              (grad_down_weight, down_weight))]
        return (grad_x, *grads, None, None, None)


def gated_mlp(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    activation: GatedActivation = swiglu,
    group=None,
) -> torch.Tensor:
    """`activation(x @ gate_weight.T, x @ up_weight.T) @ down_weight.T`, summed over `group`'s ranks.

    Args:
        x: `[..., H]`, replicated on every rank of `group`.
        gate_weight, up_weight: `[I_local, H]`, this rank's rows of the column-parallel projections.
        down_weight: `[H, I_local]`, the matching columns of the row-parallel projection.
        activation: elementwise `(gate [rows, I_local], up [rows, I_local]) -> [rows, I_local]`.
        group: the tensor-parallel group (None or one rank: no communication).

    Returns:
        `[..., H]`, the full output on every rank.
    """
    leading = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    chunk_rows = max(1, _CHUNK_ELEMENTS // max(1, gate_weight.shape[0]))
    out = _GatedMLP.apply(flat, gate_weight, up_weight, down_weight, activation, group, chunk_rows)
    return out.reshape(*leading, out.shape[-1])
