"""Sampling and lossless verification of a drafted block, for `decoding.generate.spec_generate`.

* `sampling_probs`: the target's sampling distribution, ``softmax(logits / temperature)`` after top-k, then top-p;
* `sample`: one draw per row of a distribution;
* `greedy_verify`: the longest prefix of draft tokens equal to the target's argmax, plus the target's token
  after it (the bonus);
* `rejection_verify`: speculative sampling (accept draft token ``x`` with probability ``min(1, p(x) / q(x))``,
  on rejection draw from ``max(p - q, 0)``), so the emitted tokens follow the target's distribution exactly.

Both take each row's number of proposals (``lengths [B]``, None: all ``T``) for blocks whose rows stopped
proposing early (a DSpark draft's confidence threshold): a row's slots past its length are padding, never
accepted, and a row that accepts all its proposals gets the target's own token after them, as a full block.

Shapes: B batch, T drafted slots of a block, V vocabulary.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["GREEDY_BELOW_TEMPERATURE", "sampling_probs", "sample", "greedy_verify", "rejection_verify"]

# Temperatures below this decode greedily: softmax(logits / T) over- or underflows long before T = 0,
# and its limit is the argmax (the reference decoder's rule and threshold).
GREEDY_BELOW_TEMPERATURE = 1e-5


def sampling_probs(
    logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0
) -> torch.Tensor:
    """fp32 `[..., V]` distribution of `softmax(logits / temperature)` after top-k, then top-p.

    top-k keeps exactly the `top_k` largest logits (0 or >= V: all). top-p then keeps the
    smallest set of most likely tokens whose mass reaches `top_p` (a token is kept when the
    mass of the tokens ranked above it is still below `top_p`; the most likely token always is)
    and renormalises.
    """
    scores = logits.float() / temperature
    V = scores.shape[-1]
    if 0 < top_k < V:
        kept = torch.topk(scores, top_k, dim=-1).indices
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, kept, True)
        scores = scores.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs * (mass_above < top_p)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    """One draw per row of `probs [..., V]` -> `[...]` int64."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def greedy_verify(
    draft_tokens: torch.Tensor, target_logits: torch.Tensor, lengths: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance.

    Args:
        draft_tokens: `[B, T]` tokens of slots `1..T`.
        target_logits: `[B, T + 1, V]` target logits over the block; entry `j` predicts slot `j + 1`.
        lengths: `[B]` proposals per row (None: `T`); slots past them are never accepted.
    Returns:
        `(accepted [B], bonus [B])`: the longest prefix of draft tokens equal to the target's
        argmax (at most `lengths`), and the target's argmax right after it.
    """
    posterior = target_logits.argmax(dim=-1)  # [B, T + 1]
    matches = draft_tokens == posterior[:, :-1]
    accepted = matches.to(torch.int64).cumprod(dim=1).sum(dim=1)
    if lengths is not None:
        accepted = torch.minimum(accepted, lengths)
    bonus = posterior.gather(1, accepted[:, None])[:, 0]
    return accepted, bonus


def rejection_verify(
    draft_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    generator: Optional[torch.Generator] = None,
    lengths: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless rejection sampling of a drafted block (speculative sampling).

    Args:
        draft_tokens: `[B, T]` proposals; token `t` was drawn from `draft_probs[:, t]` (which may
            depend on the tokens drawn before it).
        target_probs: `[B, T + 1, V]` the target's sampling distribution over the block; entry
            `j` is the distribution of the token after slot `j`.
        draft_probs: `[B, T, V]` the proposal distributions.
        generator: RNG of the uniforms and the residual draw.
        lengths: `[B]` proposals per row (None: `T`): a row's tokens past them are padding, never accepted.
    Returns:
        `(accepted [B], next_token [B])`. Token `t` is accepted with probability
        `min(1, p(x)/q(x))` while all before it were; at the first rejection the next token is
        drawn from `normalise(max(p - q, 0))` (from `p` if that is all zero); when everything
        (all of the row's `lengths`) is accepted it is drawn from `p` after the last one (the bonus).
    """
    B, T = draft_tokens.shape
    p_x = target_probs[:, :T].gather(-1, draft_tokens[..., None])[..., 0]
    q_x = draft_probs.gather(-1, draft_tokens[..., None])[..., 0]
    u = torch.rand(p_x.shape, generator=generator, device=p_x.device, dtype=p_x.dtype)
    # u < p/q without the division (q(x) > 0 for a drawn token; p(x) = 0 always rejects).
    accepted = (u * q_x < p_x).to(torch.int64).cumprod(dim=1).sum(dim=1)
    proposed = torch.full_like(accepted, T) if lengths is None else lengths
    accepted = torch.minimum(accepted, proposed)
    rows = torch.arange(B, device=draft_tokens.device)
    p_next = target_probs[rows, accepted]  # [B, V]
    # A rejection: the residual against the rejected token's proposal; all proposals accepted: p itself.
    rejected = (accepted < proposed).to(draft_probs.dtype)[:, None]
    q_next = draft_probs[rows, accepted.clamp(max=T - 1)] * rejected if T > 0 else torch.zeros_like(p_next)
    residual = (p_next - q_next).clamp_min(0)
    total = residual.sum(dim=-1, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp_min(torch.finfo(residual.dtype).tiny), p_next)
    return accepted, sample(residual, generator)
