"""DFlash 2: the DFlash backbone plus in-block dynamic convolutions and a pairwise candidate selector.

Two additions to the plain DFlash draft (docs/design.md §12 Variants, §11 HF export format):

* **In-block convolutions.** Every decoder layer wraps its attention and its MLP in a
  `GroupedDynamicCausalConv`: before the sublayer each slot is replaced by a per-channel mix of
  itself and the slot before it *in the same block* (`prepare`), after the sublayer the output
  gets the same kind of mix with a second set of coefficients (`finish`). The coefficients are a
  learned base kernel plus a correction predicted from the sublayer input, one value per group
  of `conv_group_size` channels. Slot 0 (the anchor) has no predecessor: taps never reach into
  another block.
* **Candidate selector.** The backbone's logits give each drafted position a list of its top-k
  candidates; the selector rescores candidate `b` at position `t` after predecessor `a` as
  `S_t(a, b) = U_t(b) + <A[a] * (P h_t), B[b]>` (`U` the backbone logit, `A`/`B` two
  `[vocab, rank]` codebooks, `P` a projection of the draft hidden state) and decoding walks the
  block left to right, each step conditioned on the token it just picked.

Initialised as the identity (unit self-tap, zero dynamic projection, zero successor codebook), a
DFlash 2 draft computes exactly what the DFlash draft with the same backbone weights computes and
its walk emits the backbone's argmax tokens, so training starts from DFlash.

Everything added here acts on the full hidden size and on the full vocabulary, so under tensor
parallelism it is replicated: every rank computes the same values and the same gradients. The
only vocab-parallel piece is finding the top-k candidates, done by `topk_vocab_parallel` without
gathering the vocabulary.

Shapes: B batch, S context length, N blocks per row, W block size, T = W - 1 drafted positions,
H hidden, V vocabulary, K candidates per position (`selector_top_k`), R `selector_rank`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..draft.body import DFlashBody
from ..draft.config import DFLASH_ARCHITECTURE, DFlashConfig, resolve_causal
from ..draft.layers import DFlashLayerSubmodules
from ..objectives.dflash_loss import (
    EmittedPathMetrics,
    LossWeighting,
    check_block_hidden,
    check_weighting,
    dflash_metrics,
    slot_targets,
)
from ..objectives.head_loss import check_loss_options, head_loss, topk_vocab_parallel
from ..plan.batch_plan import DFlashBatchPlan

__all__ = [
    "DFLASH2_ARCHITECTURE",
    "NEMO_DFLASH2_ARCHITECTURE",
    "DFLASH2_DTYPES",
    "GREEDY_TEMPERATURE_EPS",
    "DFlash2Config",
    "GroupedDynamicCausalConv",
    "CandidateSelector",
    "topk_vocab_parallel",
    "DFlash2Body",
    "DFlash2Metrics",
    "DFlash2LossOutput",
    "dflash2_loss",
]

DFLASH2_ARCHITECTURE = "DFlash2DraftModel"

# Below this temperature the walk is greedy: dividing scores by a tiny positive temperature
# overflows the softmax into NaN long before it becomes a useful distribution.
GREEDY_TEMPERATURE_EPS = 1e-5

# NeMo AutoModel's name for the same drafter (its Qwen3 class).
NEMO_DFLASH2_ARCHITECTURE = "Qwen3DFlash2DraftModel"

# The weight dtypes DFlash 2 runs in: it overflows in float16 (its acceptance drops to 0).
DFLASH2_DTYPES = (torch.bfloat16, torch.float32)

# DFlash 2 fields of `dflash_config` in config.json (the reference reads `dflash_config` first,
# then the top level).
_DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


# ================================================================================== config


@dataclass
class DFlash2Config(DFlashConfig):
    """`DFlashConfig` plus the DFlash 2 fields.

    `causal` defaults to False: DFlash 2 is bidirectional in-block on every layer and its
    config.json says so with `is_causal: false` (the reference would otherwise make sliding
    layers causal). A file without `is_causal` is read with `causal=None`, which keeps the
    reference's per-layer resolution for that file.

    Fields:
        conv_kernel_size: taps of each in-block convolution (2: the slot itself and the one before).
        conv_group_size: channels sharing one dynamic coefficient; must divide `hidden_size`.
        selector_rank: width of the selector codebooks and of the hidden projection.
        selector_top_k: candidates per drafted position the selector chooses among.
    """

    causal: Optional[bool] = False
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16

    def validate(self) -> None:
        super().validate()
        for name in _DFLASH2_KEYS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer.")
        if self.hidden_size % self.conv_group_size:
            raise ValueError(
                f"conv_group_size={self.conv_group_size} must divide hidden_size={self.hidden_size} "
                "(each group of channels shares one dynamic coefficient)."
            )
        if self.selector_top_k > self.vocab_size:
            raise ValueError(
                f"selector_top_k={self.selector_top_k} exceeds vocab_size={self.vocab_size}; the "
                "selector picks among at most the whole vocabulary."
            )

    def to_hf_dict(self, architecture: Optional[str] = None) -> dict[str, Any]:
        """The published DFlash 2 `config.json`: `architectures: ["DFlash2DraftModel"]` and the
        four DFlash 2 fields inside `dflash_config`.

        A DFlash 2 file labelled as plain DFlash is served as plain DFlash (the convolutions and
        the selector silently dropped), so the architecture is always DFlash 2; asking for the
        plain DFlash name (the default of generic savers) gives DFlash 2 too.
        """
        if architecture not in (None, DFLASH_ARCHITECTURE, DFLASH2_ARCHITECTURE):
            raise ValueError(
                f"architecture={architecture!r}: a DFlash 2 config is always written as "
                f"{DFLASH2_ARCHITECTURE!r}."
            )
        out = super().to_hf_dict(DFLASH2_ARCHITECTURE)
        out["dflash_config"].update({name: getattr(self, name) for name in _DFLASH2_KEYS})
        return out

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any], **overrides: Any) -> "DFlash2Config":
        """Read a DFlash 2 `config.json` (fields in `dflash_config`, else at the top level), ours or
        NeMo AutoModel's (`Qwen3DFlash2DraftModel`).

        Raises:
            ValueError: the file is labelled as another architecture, or lacks a DFlash 2 field.
        """
        data = dict(data)
        architectures = data.get("architectures") or []
        if architectures and architectures[0] not in (DFLASH2_ARCHITECTURE, NEMO_DFLASH2_ARCHITECTURE):
            raise ValueError(
                f"config.json has architectures={architectures}, not {DFLASH2_ARCHITECTURE!r}: this "
                "is not a DFlash 2 draft. Load it with DFlashConfig instead."
            )
        dflash = dict(data.get("dflash_config") or {})
        values: dict[str, Any] = {}
        for name in _DFLASH2_KEYS:
            if name in dflash:
                values[name] = int(dflash[name])
            elif name in data:
                values[name] = int(data[name])
        missing = [name for name in _DFLASH2_KEYS if name not in values and name not in overrides]
        if missing:
            raise ValueError(
                f"config.json lacks the DFlash 2 fields {missing} (expected in dflash_config); "
                "the serving runtimes cannot build the draft without them."
            )
        if resolve_causal(data) is None:
            values["causal"] = None  # the file relies on the reference's per-layer default
        values.update(overrides)
        return super().from_hf_dict(data, **values)

    def save_pretrained(self, directory: str, architecture: Optional[str] = None) -> None:
        super().save_pretrained(directory, architecture=architecture)


# ================================================================================== convolution


def _grouped_convolve(
    x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group_size: int
) -> torch.Tensor:
    """`out[w] = sum_j (base[j] + dynamic[w, j]) * x[w - j]` within each block.

    Args:
        x: `[..., W, H]`; the second-to-last dimension is the slots of one block.
        dynamic: `[..., W, K, G]`, one coefficient per tap and channel group, from slot `w`.
        base: `[K, H]`.
    Returns:
        `[..., W, H]`. Taps before slot 0 read zeros, so nothing crosses a block.

    The arithmetic (order of the additions, `addcmul` for the dynamic part) follows the
    reference modeling code so that fp32 results agree to rounding.
    """
    *lead, W, H = x.shape
    K = base.shape[0]
    G = H // group_size
    blocks = x.reshape(*lead, W, G, group_size)
    dynamic = dynamic.reshape(*lead, W, K, G, 1)
    out = torch.zeros_like(blocks)
    for offset in range(min(K, W)):  # a tap reaching further back than the block reads only zeros
        # The slot `offset` earlier in the same block, zero where that is before slot 0.
        values = blocks if offset == 0 else F.pad(blocks[..., : W - offset, :, :], (0, 0, 0, 0, offset, 0))
        kernel = base[offset].view(G, group_size).to(x.dtype)
        out = out + kernel * values
        out = torch.addcmul(out, dynamic[..., offset, :, :], values)
    return out.view(x.shape)


class GroupedDynamicCausalConv(nn.Module):
    """Two in-block causal depthwise convolutions around one sublayer, with dynamic kernels.

    `prepare(x)` convolves the sublayer input with `base_kernel[0]` plus coefficients predicted
    from `x`, and returns the second set of predicted coefficients, which `finish(y, c)` applies
    (with `base_kernel[1]`) to the sublayer output. One projection serves both.

    Args:
        hidden_size: H.
        kernel_size: K taps; offset 0 is the slot itself, offset j the slot j earlier in its block.
        group_size: channels sharing one dynamic coefficient (H / group_size groups).

    Parameters (published names, docs/design.md §11 HF export format):
        base_kernel: `[2, K, H]` (index 0 before the sublayer, 1 after).
        kernel_projection: `Linear(H, 2 * K * H / group_size)`, no bias.
    """

    def __init__(
        self,
        hidden_size: int,
        kernel_size: int = 2,
        group_size: int = 16,
        *,
        dtype: torch.dtype = torch.float32,
        device=None,
    ):
        super().__init__()
        if kernel_size < 1:
            raise ValueError(f"kernel_size={kernel_size} must be >= 1.")
        if group_size < 1 or hidden_size % group_size:
            raise ValueError(f"group_size={group_size} must be positive and divide hidden_size={hidden_size}.")
        self.hidden_size = hidden_size
        self.kernel_size = kernel_size
        self.group_size = group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size, dtype=dtype, device=device))
        self.kernel_projection = nn.Linear(
            hidden_size, 2 * kernel_size * self.groups, bias=False, dtype=dtype, device=device
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The identity: unit self-tap, zero elsewhere, no dynamic correction."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0].fill_(1.0)
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`x [..., W, H]` (e.g. `[B, N, W, H]`) -> (convolved `[..., W, H]`, coefficients `[..., W, K, G]`)."""
        self._check(x)
        dynamic = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        convolved = _grouped_convolve(x, dynamic[..., 0, :, :], self.base_kernel[0], self.group_size)
        return convolved, dynamic[..., 1, :, :]

    def finish(self, y: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
        """`y [..., W, H]`, the sublayer output; `coefficients` from `prepare` -> `[..., W, H]`."""
        self._check(y)
        return _grouped_convolve(y, coefficients, self.base_kernel[1], self.group_size)

    def _check(self, x: torch.Tensor) -> None:
        if x.dim() < 2 or x.shape[-1] != self.hidden_size:
            raise ValueError(
                f"expected [..., block_size, hidden_size={self.hidden_size}], got shape {tuple(x.shape)}."
            )

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, kernel_size={self.kernel_size}, group_size={self.group_size}"


# ================================================================================== selector


def _pair_terms(predecessor_codebook, successor_codebook, projected, candidate_ids, predecessor_ids):
    """The selector's pair term and its factors, in the codebooks' dtype.

    `projected [..., R]`, `candidate_ids [..., K]`, `predecessor_ids [...]` -> `(A[a] [..., R],
    gate = A[a] * P h [..., R], B[b] [..., K, R], pair [..., K])`.
    """
    predecessor = F.embedding(predecessor_ids, predecessor_codebook)
    gate = predecessor * projected
    successor = F.embedding(candidate_ids, successor_codebook)
    pair = torch.einsum("...r,...kr->...k", gate, successor)
    return predecessor, gate, successor, pair


class CandidateSelector(nn.Module):
    """Pairwise rescoring of each drafted position's top-k candidates given its predecessor.

    `S_t(a, b) = U_t(b) + <A[a] * (P h_t), B[b]>`: the backbone logit of candidate `b` plus a
    low-rank match between predecessor `a` and `b`, gated by the draft hidden state `h_t`.

    The codebooks are plain `[vocab, rank]` parameters, not `nn.Embedding`, so the state-dict
    names are the published `candidate_selector.{predecessor,successor}_codebook`.

    Args:
        vocab_size: V, the full (target) vocabulary; the selector is replicated over TP.
        hidden_size: H.
        rank: R.
        top_k: K.
        init_std: std of the normal init of the predecessor codebook and the projection.
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        rank: int = 256,
        top_k: int = 16,
        *,
        init_std: float = 0.02,
        dtype: torch.dtype = torch.float32,
        device=None,
    ):
        super().__init__()
        if not 1 <= top_k <= vocab_size:
            raise ValueError(f"top_k={top_k} must be in [1, vocab_size={vocab_size}].")
        if rank < 1:
            raise ValueError(f"rank={rank} must be >= 1.")
        self.vocab_size = vocab_size
        self.rank = rank
        self.top_k = top_k
        self.init_std = init_std
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank, dtype=dtype, device=device))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank, dtype=dtype, device=device))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False, dtype=dtype, device=device)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """A no-op selector: every score equals the backbone logit.

        The pair term is bilinear in the codebooks, so one of them at zero removes it. Zeroing
        the successor codebook keeps it trainable from the first step (its gradient is
        `A[a] * P h`, non-zero), while the predecessor codebook and the projection, which
        multiply it, start moving on the second step.
        """
        with torch.no_grad():
            nn.init.normal_(self.predecessor_codebook, mean=0.0, std=self.init_std)
            nn.init.normal_(self.hidden_projection.weight, mean=0.0, std=self.init_std)
            self.successor_codebook.zero_()

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """`P h`: `[..., H]` -> `[..., R]`."""
        return self.hidden_projection(hidden)

    def pair_scores(
        self,
        projected: torch.Tensor,
        candidate_logits: torch.Tensor,
        candidate_ids: torch.Tensor,
        predecessor_ids: torch.Tensor,
    ) -> torch.Tensor:
        """Scores from the projected hidden `[..., R]`; see `score`. Returns fp32 `[..., K]`."""
        pair = _pair_terms(self.predecessor_codebook, self.successor_codebook, projected, candidate_ids,
                           predecessor_ids)[-1]
        return candidate_logits.float() + pair.float()

    def score(
        self,
        hidden: torch.Tensor,
        candidate_logits: torch.Tensor,
        candidate_ids: torch.Tensor,
        predecessor_ids: torch.Tensor,
    ) -> torch.Tensor:
        """`S_t(a, b)` for a batch of positions, all in parallel.

        Args:
            hidden: `[..., H]` draft hidden state of each scored position.
            candidate_logits: `[..., K]` backbone logits `U_t(b)` of the candidates.
            candidate_ids: `[..., K]` candidate token ids.
            predecessor_ids: `[...]` the token before each scored position.
        Returns:
            fp32 `[..., K]`.
        """
        return self.pair_scores(self.project(hidden), candidate_logits, candidate_ids, predecessor_ids)

    @torch.no_grad()
    def walk(
        self,
        hidden: torch.Tensor,
        logits: torch.Tensor,
        anchor_ids: torch.Tensor,
        temperature: float = 0.0,
        generator: Optional[torch.Generator] = None,
    ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """The decode-time path through one block's candidate lists.

        Args:
            hidden: `[B, T, H]` draft hidden states of the drafted positions (slots 1..W-1).
            logits: `[B, T, V]` draft logits there (output transform already applied).
            anchor_ids: `[B]` the last verified token, predecessor of position 0.
            temperature: below `GREEDY_TEMPERATURE_EPS` each step takes the best-scoring
                candidate; otherwise it samples from `softmax(scores / temperature)`.
            generator: optional RNG for sampling.
        Returns:
            `(path [B, T], candidate_ids [B, T, K], draft_probs [B, T, K] or None)`; `draft_probs`
            (sampling only) is the proposal distribution over `candidate_ids` that lossless
            rejection sampling needs.
        """
        if logits.shape[-1] < self.top_k:
            raise ValueError(f"logits have {logits.shape[-1]} entries, fewer than top_k={self.top_k}.")
        unary, candidates = torch.topk(logits.float(), self.top_k, dim=-1)
        return self.walk_candidates(self.project(hidden), unary, candidates, anchor_ids, temperature, generator)

    @torch.no_grad()
    def walk_candidates(
        self,
        projected: torch.Tensor,
        candidate_logits: torch.Tensor,
        candidate_ids: torch.Tensor,
        anchor_ids: torch.Tensor,
        temperature: float = 0.0,
        generator: Optional[torch.Generator] = None,
    ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """`walk` from precomputed candidates: `projected [..., T, R]`, `candidate_logits` /
        `candidate_ids [..., T, K]`, `anchor_ids [...]`. Any leading dimensions (e.g. `[B, N]`)."""
        if temperature < 0:
            raise ValueError(f"temperature={temperature} must be >= 0.")
        greedy = temperature < GREEDY_TEMPERATURE_EPS
        predecessor = anchor_ids
        path, q_rows = [], []
        for t in range(candidate_ids.shape[-2]):  # T steps, each needs the previous pick
            ids = candidate_ids[..., t, :]
            scores = self.pair_scores(projected[..., t, :], candidate_logits[..., t, :], ids, predecessor)
            if greedy:
                index = scores.argmax(dim=-1)
            else:
                q = torch.softmax(scores / temperature, dim=-1)
                index = torch.multinomial(q.reshape(-1, q.shape[-1]), 1, generator=generator).view(q.shape[:-1])
                q_rows.append(q)
            predecessor = ids.gather(-1, index.unsqueeze(-1)).squeeze(-1)
            path.append(predecessor)
        draft_probs = torch.stack(q_rows, dim=-2) if q_rows else None
        return torch.stack(path, dim=-1), candidate_ids, draft_probs

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, rank={self.rank}, top_k={self.top_k}"


# ================================================================================== body


def _in_block_conv(config: DFlash2Config, dtype: torch.dtype) -> GroupedDynamicCausalConv:
    return GroupedDynamicCausalConv(config.hidden_size, config.conv_kernel_size, config.conv_group_size, dtype=dtype)


# DFlash 2's layers: an in-block convolution around the attention and around the MLP.
DFLASH2_LAYER_SUBMODULES = DFlashLayerSubmodules(attention_conv=_in_block_conv, mlp_conv=_in_block_conv)


class DFlash2Body(DFlashBody):
    """`DFlashBody` whose layers carry in-block convolutions, plus a `candidate_selector`.

    Same constructor and `forward` as `DFlashBody`; see there. The convolutions and the selector
    are replicated over the TP group (they see the full hidden state and vocabulary). New
    parameters start as the identity, so an untrained DFlash 2 body equals a DFlash body with the
    same backbone weights.
    """

    def __init__(
        self,
        config: DFlash2Config,
        parallel_config=None,
        tp_group=None,
        attention_backend: str = "auto",
    ):
        if not isinstance(config, DFlash2Config):
            raise ValueError(
                f"DFlash2Body needs a DFlash2Config, got {type(config).__name__}; build one with "
                "DFlash2Config(...) or DFlash2Config.from_pretrained(directory)."
            )
        if parallel_config is not None and parallel_config.params_dtype not in DFLASH2_DTYPES:
            raise ValueError(
                f"DFlash 2 overflows in {parallel_config.params_dtype} (its acceptance drops to 0); train and serve "
                "it in bfloat16 (or float32)."
            )
        super().__init__(
            config, parallel_config=parallel_config, tp_group=tp_group, attention_backend=attention_backend,
            layer_submodules=DFLASH2_LAYER_SUBMODULES,
        )
        dtype = self.fc.weight.dtype
        device = self.fc.weight.device
        H = config.hidden_size
        self.candidate_selector = CandidateSelector(
            config.vocab_size,
            H,
            config.selector_rank,
            config.selector_top_k,
            init_std=config.initializer_range,
            dtype=dtype,
            device=device,
        )

    @torch.no_grad()
    def propose_block(
        self,
        hidden: torch.Tensor,
        anchor_ids: torch.Tensor,
        head,
        embedding: nn.Module,
        temperature: float = 0.0,
        generator: Optional[torch.Generator] = None,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Draft tokens of one block per row: the candidate selector's walk over slots 1..W-1.

        `hidden [B, W, H]` (the whole block), `anchor_ids [B]`, `head` the target's `OutputHead`.
        Returns `(tokens [B, W-1], draft_probs [B, W-1, V] or None)`: when sampling, the distribution
        each token was drawn from (a point mass where the walk was greedy); None when greedy.
        """
        drafted = hidden[:, 1:]
        # The head's full width (columns past vocab_size are -inf), so draft and target share one index space.
        logits = head.local_logits(drafted.to(head.layer.weight.dtype))  # [B, T, V]
        path, candidates, candidate_probs = self.candidate_selector.walk(
            drafted, logits, anchor_ids, temperature, generator
        )
        if temperature <= 0:
            return path, None
        probs = torch.zeros_like(logits)
        if candidate_probs is None:  # the walk was greedy: a point-mass proposal
            probs.scatter_(-1, path[..., None], 1.0)
        else:
            probs.scatter_(-1, candidates, candidate_probs.to(probs.dtype))
        return path, probs


# ================================================================================== objective


@dataclass
class DFlash2Metrics(EmittedPathMetrics):
    """Additive fp64 statistics of DFlash 2 training (sum over micro-batches, all-reduce over DP).

    The primary `correct_tokens` / `acceptance_sum` describe the **selector walk**: the path the
    draft emits at decode time, each step conditioned on the token it picked before (not on the
    true one). `base_*` describe the backbone's own argmax on the same denominators, so the two
    are directly comparable.

    Fields:
        supervised_tokens: supervised predicted slots.
        valid_blocks: counted blocks (valid, first predicted slot supervised).
        correct_tokens: supervised slots where the greedy walk emits the label.
        acceptance_sum: greedy acceptance lengths of the walk (bonus token included), summed.
        base_correct_tokens, base_acceptance_sum: the same for the backbone argmax.
        candidate_hits: supervised slots whose label is among the backbone's top-k candidates
            (the ceiling of the selector).
        teacher_forced_correct: supervised slots where the selector, given the true predecessor,
            ranks the label first (a training diagnostic, not a decode metric).
        base_loss_sum, selector_loss_sum: the two weighted loss numerators (no grad).
        loss_weight_sum: the backbone term's denominator `sum(w * mask)` (a D-PACE run: its normalisation's).
        selector_weight_sum: the selector term's, `sum(w * mask)` over the slots whose label is
            among the candidates.
    """

    candidate_hits: torch.Tensor
    teacher_forced_correct: torch.Tensor
    base_loss_sum: torch.Tensor
    selector_loss_sum: torch.Tensor
    loss_weight_sum: torch.Tensor
    selector_weight_sum: torch.Tensor

    derived = EmittedPathMetrics.derived + ("candidate_recall", "teacher_forced_accuracy", "base_loss", "selector_loss")
    logged = EmittedPathMetrics.logged + (
        ("candidate recall", "candidate_recall"), ("base loss", "base_loss"), ("selector loss", "selector_loss"),
    )

    @property
    def candidate_recall(self) -> torch.Tensor:
        """Fraction of supervised slots whose label is among the top-k candidates."""
        return self.candidate_hits / self.supervised_tokens.clamp(min=1)

    @property
    def teacher_forced_accuracy(self) -> torch.Tensor:
        return self.teacher_forced_correct / self.supervised_tokens.clamp(min=1)

    @property
    def base_loss(self) -> torch.Tensor:
        return self.base_loss_sum / self.loss_weight_sum.clamp(min=1e-12)

    @property
    def selector_loss(self) -> torch.Tensor:
        """The selector CE averaged over the slots it trains on (those with the label among the candidates)."""
        return self.selector_loss_sum / self.selector_weight_sum.clamp(min=1e-12)


@dataclass
class DFlash2LossOutput:
    """One micro-batch's contribution to the global-batch DFlash 2 objective.

    Attributes:
        loss_sum: differentiable fp32 scalar,
            `base_loss_sum + selector_weight * weight_sum * selector_loss_sum / selector_weight_sum`.
        weight_sum: fp32 scalar without grad, `sum(w * mask)`: the training loss is
            `sum(loss_sum) / sum(weight_sum)` over the global batch.
        metrics: `DFlash2Metrics`.
    """

    loss_sum: torch.Tensor
    weight_sum: torch.Tensor
    metrics: DFlash2Metrics


class _SelectorLoss(torch.autograd.Function):
    """Teacher-forced selector CE over the flattened slots, chunk by chunk, with its gradients formed in
    forward (the scheme of `head_loss`'s fused kernel: the term is a plain weighted sum, so backward only
    scales what forward computed).

    Per chunk of `c` slots: the codebook rows `A[a] [c, R]` and `B[b] [c, K, R]`, the scores
    `U + <A[a] * P h, B[b]>` (`_pair_terms`, the arithmetic `CandidateSelector.score` uses), the CE of the
    candidate equal to the label, and `G = (softmax - onehot) * w [c, K]`, from which
    `dU = G`, `d(P h) = (G B[b]) * A[a]`, `dA[a] += (G B[b]) * P h`, `dB[b] += G (x) (A[a] * P h)`.
    The codebook gradients go into one fp32 `[V, R]` buffer each (deterministic `index_put_` with
    accumulation), not a zero-filled `[V, R]` per chunk as an embedding backward would make, and nothing
    is recomputed in backward.

    Inputs: projected `[M, R]` (`P h`), unary `[M, K]` fp32 (the candidates' backbone logits), the two
    codebooks `[V, R]`, ids `[M, K]`, predecessor `[M]`, label `[M]`, weight `[M]` fp32, chunk (rows).
    Outputs: the weighted CE sum (fp32 scalar; slots whose label is not a candidate count 0) and,
    non-differentiable, `[M]` bool: the label is a candidate, the top-scored candidate is the label.
    """

    @staticmethod
    def forward(ctx, projected, unary, predecessor_codebook, successor_codebook, ids, predecessor, label, weight,
                chunk):
        M, K = ids.shape
        R = projected.shape[-1]
        device = projected.device
        needs = ctx.needs_input_grad
        zero = torch.zeros((), device=device)
        total = torch.zeros((), dtype=torch.float32, device=device)
        has_target = torch.empty(M, dtype=torch.bool, device=device)
        top1 = torch.empty(M, dtype=torch.bool, device=device)
        grad_projected = torch.empty(M, R, dtype=torch.float32, device=device) if needs[0] else None
        grad_unary = torch.empty(M, K, dtype=torch.float32, device=device) if needs[1] else None
        grad_a = torch.zeros(predecessor_codebook.shape, dtype=torch.float32, device=device) if needs[2] else None
        grad_b = torch.zeros(successor_codebook.shape, dtype=torch.float32, device=device) if needs[3] else None
        with_grad = any(needs[:4])
        for lo in range(0, M, chunk):
            rows = slice(lo, min(lo + chunk, M))
            p, i, a_ids = projected[rows], ids[rows], predecessor[rows]
            a, gate, b, pair = _pair_terms(predecessor_codebook, successor_codebook, p, i, a_ids)
            scores = unary[rows].float() + pair.float()  # [c, K]
            match = i == label[rows, None]
            hit = match.any(dim=-1)
            target = match.to(torch.float32).argmax(dim=-1)  # candidates are distinct: one match at most
            lse = torch.logsumexp(scores, dim=-1)
            nll = lse - scores.gather(-1, target[:, None]).squeeze(-1)
            w = torch.where(hit, weight[rows], zero)
            # `where`, not a product: the nll of an excluded slot is finite but must not count.
            total += torch.where(w > 0, nll * w, zero).sum()
            has_target[rows] = hit
            top1[rows] = (scores.argmax(dim=-1) == target) & hit
            if not with_grad:
                continue
            g = scores.sub_(lse[:, None]).exp_()  # softmax, in the scores' buffer
            g.scatter_add_(1, target[:, None], -hit.to(g.dtype)[:, None])
            g.mul_(w[:, None])  # excluded slots (w = 0) pass no gradient
            if grad_unary is not None:
                grad_unary[rows] = g
            grad_gate = torch.bmm(g.unsqueeze(1), b.float()).squeeze(1)  # [c, R]
            if grad_projected is not None:
                torch.mul(grad_gate, a.float(), out=grad_projected[rows])
            if grad_a is not None:
                grad_a.index_put_((a_ids,), grad_gate * p.float(), accumulate=True)
            if grad_b is not None:
                grad_b.index_put_((i.reshape(-1),), (g.unsqueeze(-1) * gate.float().unsqueeze(1)).view(-1, R),
                                  accumulate=True)
        ctx.save_for_backward(*(t if t is not None else zero for t in (grad_projected, grad_unary, grad_a, grad_b)))
        ctx.dtypes = (projected.dtype, unary.dtype, predecessor_codebook.dtype, successor_codebook.dtype)
        ctx.mark_non_differentiable(has_target, top1)
        return total, has_target, top1

    @staticmethod
    def backward(ctx, grad_total, grad_has_target, grad_top1):
        grads = []
        for saved, needed, dtype in zip(ctx.saved_tensors, ctx.needs_input_grad, ctx.dtypes):
            grads.append(saved.mul_(grad_total).to(dtype) if needed else None)  # saved once, used once
        return (*grads, None, None, None, None, None)


def dflash2_loss(
    hidden: torch.Tensor,
    plan: DFlashBatchPlan,
    input_ids: torch.Tensor,
    head,
    selector: CandidateSelector,
    *,
    decay_gamma: Optional[float] = None,
    selector_weight: float = 1.0,
    loss_mask: Optional[torch.Tensor] = None,
    weights: Optional[torch.Tensor] = None,
    chunk_slots: Optional[int] = 1024,
    selector_backbone_grad: bool = True,
    fused: Optional[bool] = None,
    weighting: Optional[LossWeighting] = None,
) -> DFlash2LossOutput:
    """DFlash 2 objective of one micro-batch: backbone block CE + candidate-selection CE.

    * Backbone: the DFlash CE (`objectives.dflash_loss.dflash_loss.slot_targets`, `objectives.head_loss.head_loss`).
    * Selector: at predicted slot `k` of a block at `p`, the backbone's top-k candidates are
      rescored given the **true** predecessor, the token at `p + k - 1` (the anchor for `k = 1`),
      which is what the walk would have committed had every earlier slot been accepted; the CE
      targets the candidate equal to the label. Slots whose label is not among the candidates
      are left out of this term (`metrics.candidate_recall` says how many are in).
    * With a D-PACE `weighting` the backbone CE takes its dynamic weights and the run's normalisation
      (`objectives.dflash_loss.dflash_loss.LossWeighting`); the selector keeps the plain mask weights (D-PACE
      weighs the cross entropy of the drafted tokens, and the selector's is another one) and is still
      scaled so that `loss_sum / weight_sum` is `base + selector_weight * selector`.
    * Both terms use the per-slot weights `w * mask`, and each is a weighted mean over the slots
      it trains on, as in the reference: the selector term over the slots with the label among
      the candidates, not over all supervised slots (that would scale its signal by the recall).
      In `loss_sum` the selector mean is multiplied by this micro-batch's `weight_sum`, so
      `loss_sum / weight_sum` is `base + selector_weight * selector` for one micro-batch, and over
      a global batch the selector means of the micro-batches are averaged with the backbone's
      weights.

    Metrics describe the **greedy walk** (each step after the token the walk itself picked, as
    decoding does) next to the backbone argmax, plus candidate recall.

    Args:
        hidden: `[B, N, W, H]` draft body output.
        plan, input_ids, head, decay_gamma, loss_mask, weights, chunk_slots, fused, weighting: as `dflash_loss`.
        selector: the body's `CandidateSelector`.
        selector_weight: multiplier of the selector term.
        selector_backbone_grad: whether the selector term also trains the backbone (through the
            hidden state and the candidate logits). False: it trains only the selector.

    Memory and compute: the head runs once per chunk for the backbone CE and the candidates together
    (the fused kernel takes the top-k from the logits before they turn into the gradient, and routes
    the candidates' gradient through their K rows of the head's weight); the selector term forms its
    gradients in the same forward pass, chunk by chunk (`_SelectorLoss`), and recomputes nothing.
    """
    _check_dflash2_loss_inputs(hidden, plan, head, selector, selector_weight, chunk_slots, fused)
    weighting = check_weighting(weighting, decay_gamma, weights)
    device = hidden.device
    plan = plan.to(device)
    B, N, W = plan.batch_size, plan.num_blocks, plan.block_size
    T = W - 1
    K = selector.top_k
    targets = slot_targets(input_ids.to(device), plan, decay_gamma=decay_gamma, loss_mask=loss_mask, weights=weights)
    flat_h = targets.flat_hidden(hidden)
    terms = head_loss(flat_h, targets.flat_labels, targets.flat_weights, head, chunk_slots=chunk_slots, fused=fused,
                      top_k=K, row_weights=weighting.row_weights(targets))
    unary_all, ids_all = terms.candidate_values, terms.candidate_ids  # [M, K]
    if not selector_backbone_grad:
        flat_h, unary_all = flat_h.detach(), unary_all.detach()
    labels = targets.tokens  # [B, N, W] ground truth, slot 0 = anchor
    flat_predecessor = labels[:, :, :-1].reshape(-1)  # slot k follows the true token at p + k - 1
    flat_label = labels[:, :, 1:].reshape(-1)
    flat_weight = targets.flat_weights

    size = max(1, flat_h.shape[0] if chunk_slots is None else min(chunk_slots, flat_h.shape[0]))
    selector_sum, hit, top1 = _SelectorLoss.apply(
        selector.project(flat_h), unary_all, selector.predecessor_codebook, selector.successor_codebook, ids_all,
        flat_predecessor, flat_label, flat_weight, size,
    )

    weight_sum = weighting.denominator(targets, terms.weights)
    with torch.no_grad():
        supervised = targets.supervised
        hits = hit.view(B, N, T) & supervised
        selector_weight_sum = torch.where(hits, targets.weights, torch.zeros((), device=device)).sum()
        # No slot with its label among the candidates: the selector term is zero (selector_sum is 0).
        scale = weight_sum / selector_weight_sum.clamp(min=1e-12)
    loss_sum = terms.loss_sum + selector_weight * scale * selector_sum

    metrics = _dflash2_metrics(hidden, targets, terms, plan, selector, hits=hits, top1=top1.view(B, N, T) & supervised,
                               selector_sum=selector_sum, selector_weight_sum=selector_weight_sum,
                               loss_weight_sum=weight_sum)
    return DFlash2LossOutput(loss_sum=loss_sum, weight_sum=weight_sum, metrics=metrics)


def _check_dflash2_loss_inputs(hidden, plan, head, selector, selector_weight, chunk_slots, fused) -> None:
    """`dflash2_loss`'s argument checks (shapes, the selector and its vocabulary, the selector weight)."""
    check_block_hidden(hidden, plan)
    check_loss_options(head, chunk_slots, fused)
    if not isinstance(selector, CandidateSelector):
        raise ValueError(f"selector must be a CandidateSelector, got {type(selector).__name__}.")
    if head.vocab_size != selector.vocab_size:
        raise ValueError(
            f"the head's vocab_size={head.vocab_size} differs from the selector's {selector.vocab_size}; "
            "the selector's codebooks are indexed by the target's token ids."
        )
    if not (isinstance(selector_weight, (int, float)) and selector_weight >= 0):
        raise ValueError(f"selector_weight={selector_weight!r} must be a non-negative number.")


@torch.no_grad()
def _dflash2_metrics(hidden, targets, terms, plan: DFlashBatchPlan, selector: CandidateSelector, *, hits, top1,
                     selector_sum, selector_weight_sum, loss_weight_sum) -> "DFlash2Metrics":
    """The additive metrics: the greedy walk (as decoding runs it) next to the backbone argmax, candidate recall.

    Args:
        hidden: ``[B, N, W, H]`` body output.
        targets: the slot targets; terms: `head_loss`'s output (top-k candidates ``[M, K]``, base loss).
        hits: ``[B, N, W - 1]`` supervised slots whose label is among the candidates.
        top1: ``[B, N, W - 1]`` supervised slots where the teacher-forced selector picks the label.
        selector_sum, selector_weight_sum: the selector term's loss and weight sums.
        loss_weight_sum: the backbone term's denominator (the loss's ``weight_sum``).
    """
    B, N, W = plan.batch_size, plan.num_blocks, plan.block_size
    T, K = W - 1, selector.top_k
    labels = targets.tokens
    base = dflash_metrics(targets, terms.base_correct, plan)
    # The decode-time walk: each step after the walk's own previous pick.
    path, _, _ = selector.walk_candidates(
        selector.project(hidden[:, :, 1:, :].detach()), terms.candidate_values.detach().view(B, N, T, K),
        terms.candidate_ids.view(B, N, T, K), labels[:, :, 0], 0.0,
    )
    walk = dflash_metrics(targets, path == labels[:, :, 1:], plan)
    f64 = torch.float64
    return DFlash2Metrics(
        supervised_tokens=walk.supervised_tokens,
        valid_blocks=walk.valid_blocks,
        correct_tokens=walk.correct_tokens,
        acceptance_sum=walk.acceptance_sum,
        base_correct_tokens=base.correct_tokens,
        base_acceptance_sum=base.acceptance_sum,
        candidate_hits=hits.sum().to(f64),
        teacher_forced_correct=top1.sum().to(f64),
        base_loss_sum=terms.base_sum.detach().to(f64),
        selector_loss_sum=selector_sum.detach().to(f64),
        loss_weight_sum=loss_weight_sum.to(f64),
        selector_weight_sum=selector_weight_sum.to(f64),
    )
