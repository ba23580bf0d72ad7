"""Sampling and lossless verification (`decoding.sampling`): the greedy rule, rejection sampling's
distribution, and the top-k / top-p filters, each against numbers worked out by hand or the exact
distribution they must reproduce."""

from __future__ import annotations

import pytest
import torch

from megatron_dflash.decoding.sampling import greedy_verify, rejection_verify, sampling_probs

pytestmark = pytest.mark.usefixtures("one_thread")


def test_greedy_verify_rule():
    # Target argmax over a block of 4 slots: [3, 1, 2, 0]; draft tokens for slots 1..3.
    logits = torch.full((3, 4, 5), -1.0)
    for j, t in enumerate([3, 1, 2, 0]):
        logits[:, j, t] = 1.0
    draft = torch.tensor([[3, 1, 2], [3, 0, 2], [4, 1, 2]])
    accepted, bonus = greedy_verify(draft, logits)
    assert accepted.tolist() == [3, 1, 0]
    assert bonus.tolist() == [0, 1, 3]


def test_rejection_verify_is_lossless():
    """First emitted token ~ p[0]; second ~ p[1] given an accepted first (vectorised over rows)."""
    gen = torch.Generator().manual_seed(0)
    V, N = 5, 200_000
    p = torch.tensor([[0.5, 0.2, 0.2, 0.1, 0.0], [0.1, 0.1, 0.1, 0.1, 0.6], [0.2, 0.2, 0.2, 0.2, 0.2]])
    q = torch.tensor([[0.1, 0.1, 0.1, 0.2, 0.5], [0.3, 0.3, 0.2, 0.1, 0.1]])
    draft = torch.multinomial(q, N, replacement=True, generator=gen).T.contiguous()  # [N, 2]
    accepted, nxt = rejection_verify(draft, p.expand(N, -1, -1), q.expand(N, -1, -1), gen)
    first = torch.where(accepted >= 1, draft[:, 0], nxt)
    freq = torch.bincount(first, minlength=V).double() / N
    torch.testing.assert_close(freq, p[0].double(), atol=4e-3, rtol=0)
    second = torch.where(accepted >= 2, draft[:, 1], nxt)[accepted >= 1]
    freq = torch.bincount(second, minlength=V).double() / second.numel()
    torch.testing.assert_close(freq, p[1].double(), atol=6e-3, rtol=0)
    # Acceptance probability of the first token is sum_x min(p, q).
    assert (accepted >= 1).double().mean().item() == pytest.approx(torch.minimum(p[0], q[0]).sum().item(), abs=4e-3)


def test_sampling_probs_filters():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    torch.testing.assert_close(sampling_probs(logits, 1.0), torch.tensor([0.4, 0.3, 0.2, 0.1]))
    torch.testing.assert_close(sampling_probs(logits, 1.0, top_k=2), torch.tensor([4 / 7, 3 / 7, 0, 0]))
    # top-p 0.7: 0.4 (mass above 0) and 0.3 (mass above 0.4 < 0.7) kept; 0.2 has 0.7 above it.
    torch.testing.assert_close(sampling_probs(logits, 1.0, top_p=0.7), torch.tensor([4 / 7, 3 / 7, 0, 0]))
    torch.testing.assert_close(sampling_probs(logits, 1.0, top_p=0.75), torch.tensor([0.4, 0.3, 0.2, 0]) / 0.9)
