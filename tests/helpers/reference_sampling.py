"""The exact sampling distribution of a tiny target and a test against it: the oracle of sampled decoding.

`exact_joint` enumerates every prefix on a small vocabulary to give P(first `steps` generated tokens) under
temperature / top-k / top-p (written plainly, independently of `decoding.sampling`); `marginal` reduces it
to some positions; `chi_square_pvalue` compares counts of sampled tokens with it.
"""

from __future__ import annotations

import math
from collections import Counter

import torch


def _filtered(logits: list[float], temperature: float, top_p: float, top_k: int) -> list[float]:
    """Reference sampling distribution, written plainly: top-k, softmax, top-p, renormalise."""
    order = sorted(range(len(logits)), key=lambda i: -logits[i])
    if 0 < top_k < len(logits):
        order = order[:top_k]
    scaled = [logits[i] / temperature for i in order]
    top = max(scaled)
    weights = [math.exp(s - top) for s in scaled]
    total = sum(weights)
    probs = [w / total for w in weights]
    kept, mass = [], 0.0
    for i, pr in zip(order, probs):
        if mass >= top_p:
            break
        kept.append((i, pr))
        mass += pr
    norm = sum(pr for _, pr in kept)
    out = [0.0] * len(logits)
    for i, pr in kept:
        out[i] = pr / norm
    return out


def exact_joint(target, prompt: list[int], steps: int, temperature, top_p, top_k) -> dict[tuple, float]:
    """P(first `steps` generated tokens) by enumerating every prefix."""
    vocab = target.config.vocab_size
    joint = {(): 1.0}
    for _ in range(steps):
        prefixes = list(joint)
        ids = torch.tensor([prompt + list(prefix) for prefix in prefixes])
        with torch.no_grad():
            logits = target(ids).logits[:, -1].double().tolist()
        nxt = {}
        for prefix, row in zip(prefixes, logits):
            probs = _filtered(row, temperature, top_p, top_k)
            for token in range(vocab):
                if probs[token] > 0:
                    nxt[prefix + (token,)] = joint[prefix] * probs[token]
        joint = nxt
    return joint


def chi_square_pvalue(counts: Counter, expected: dict, n: int) -> float:
    """Pearson chi-square p-value; cells with expected count < 5 are pooled."""
    from scipy.stats import chi2

    assert set(counts) <= {k for k, v in expected.items() if v > 0}, "a token of probability 0 was emitted"
    stat, dof, pool_e, pool_o = 0.0, -1, 0.0, 0
    for key, prob in expected.items():
        e, o = prob * n, counts.get(key, 0)
        if e < 5:
            pool_e, pool_o = pool_e + e, pool_o + o
            continue
        stat += (o - e) ** 2 / e
        dof += 1
    if pool_e > 0:
        stat += (pool_o - pool_e) ** 2 / pool_e
        dof += 1
    return float(chi2.sf(stat, max(dof, 1)))


def marginal(joint: dict, positions: tuple) -> dict:
    out: dict = {}
    for key, prob in joint.items():
        sub = tuple(key[i] for i in positions)
        out[sub] = out.get(sub, 0.0) + prob
    return out
