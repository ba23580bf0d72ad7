"""D-PACE slot weighting of the DSpark objective (docs/design.md §6 Objectives), single process, fp32.

Oracle: `test_dspark_loss`'s dense reference (full logits of every slot, plain autograd) with the decay
replaced by the D-PACE weights of `test_dflash_loss_dpace.reference_block_weights` (the definition, one
slot at a time) of each block's detached cross entropies. The fused kernel, which forms each chunk's weights
after its cross entropy pass (chunks rounded to whole blocks), must equal it in the loss, each term, the
denominator of every normalisation and every gradient (hidden states, Markov features, ``W2``, confidence
logits), for the full weighting and its two ablations and for any chunk size; the same weight weighs the
three terms of a slot.
"""

from __future__ import annotations

import pytest
import torch

from megatron_dflash.objectives.dflash_loss import DPACE_NORMALIZATIONS, DPACE_SCHEMES, LossWeighting

from dpace_reference import reference_block_weights
from dspark_reference import TERMS, V, close, dense_reference, make_case, run_loss

pytestmark = pytest.mark.usefixtures("one_thread")


def reference_weights(alpha: float, scheme: str):
    """``(ce [B, N, W], supervised [B, N, W]) -> [B, N, W]`` block by block from the definition."""
    def weights(ce, supervised):
        out = torch.zeros_like(ce)
        for b in range(ce.shape[0]):
            for n in range(ce.shape[1]):
                q = torch.exp(-ce[b, n]).tolist()
                out[b, n] = torch.tensor(reference_block_weights(q, supervised[b, n].tolist(), alpha, scheme))
        return out
    return weights


def denominator(normalization: str, w: torch.Tensor, supervised: torch.Tensor) -> torch.Tensor:
    if normalization == "weight_sum":
        return w.sum()
    if normalization == "supervised":
        return supervised.sum().float()
    return supervised.flatten(1).any(dim=1).sum().float()


@pytest.mark.parametrize("scheme", DPACE_SCHEMES)
@pytest.mark.parametrize("chunk", [None, 5, 16])
def test_equals_dense_reference(scheme, chunk):
    case = make_case(seed=3)
    alpha = 0.3
    slot_weights = reference_weights(alpha, scheme)
    want = dense_reference(case, gamma=None, slot_weights=slot_weights)
    for normalization in DPACE_NORMALIZATIONS:
        weighting = LossWeighting(scheme, dpace_alpha=alpha, normalization=normalization)
        out, grads = run_loss(case, chunk=chunk, gamma=None, weighting=weighting)
        close(out.loss_sum.detach(), want["loss"])
        m = out.metrics
        for term in TERMS:
            close(getattr(m, f"{term}_loss_sum").float(), want["sums"][term])
        for key in ("hidden", "features", "w2", "confidence"):
            assert float(want[key].abs().max()) > 0, key
            close(grads[key], want[key])
        assert float(grads["w2"][V:].abs().max()) == 0.0
        assert float(want["sums"]["ce"]) > 0
        w = slot_weights_of(case, alpha, scheme)
        close(out.weight_sum, denominator(normalization, w, want["supervised"]))
        close(m.loss_weight_sum.float(), w.sum())


def slot_weights_of(case, alpha, scheme):
    """The reference D-PACE weights of the case (from the dense reference's own cross entropies)."""
    seen = {}

    def record(ce, supervised):
        seen["w"] = reference_weights(alpha, scheme)(ce, supervised)
        return seen["w"]

    dense_reference(case, gamma=None, slot_weights=record)
    return seen["w"]


def test_weights_differ_from_the_decay_and_from_uniform():
    """The test above can fail: D-PACE's loss is neither the uniform nor the decayed one."""
    case = make_case(seed=3)
    weighting = LossWeighting("dpace", dpace_alpha=0.3)
    out, _ = run_loss(case, gamma=None, weighting=weighting)
    uniform, _ = run_loss(case, gamma=None)
    decayed, _ = run_loss(case, gamma=4.0)
    ratio = float(out.loss_sum / out.weight_sum)
    for other in (uniform, decayed):
        assert abs(ratio - float(other.loss_sum / other.weight_sum)) > 1e-3 * abs(ratio)


def test_dpace_takes_no_decay():
    case = make_case(seed=3)
    with pytest.raises(ValueError, match="leave decay_gamma"):
        run_loss(case, gamma=4.0, weighting=LossWeighting("dpace"))
