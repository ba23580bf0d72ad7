"""Speculative decoding with a DFlash draft and a HF causal-LM target: `spec_generate`.

One decoding cycle per batch:

1. **Draft.** The block `[last token, MASK, ..., MASK]` (`W = block_size` slots, at positions
   `n .. n + W - 1` where `n` is the row's committed length) is embedded with the target's
   input embedding (times `input_embedding_scale`) and run through the draft's own forward
   (`DFlashBody.forward` with its `DraftKVCache`, the modules training runs). Its queries
   attend to the cached committed context and to the block's own slots; slots `1..W-1` become
   draft tokens through the target's LM head (with the draft's
   `output_multiplier` / `final_logit_softcapping`, exactly as in training). DFlash 2 drafts
   walk their candidate selector instead of taking each slot's argmax or sample, Domino drafts
   their GRU head: a variant with a proposer (`variants.registry`, its `propose_block`) picks its
   tokens itself from the whole block's hidden states. A variant whose every slot proposes
   (`Variant.proposes_every_slot`, DSpark: slot `k` predicts the token at `n + k + 1`) gives `T = W`
   tokens, the others `T = W - 1`; a DSpark row may stop early at a confidence threshold
   (`confidence_threshold`), its block then holding fewer proposals.
2. **Verify.** The target runs once over the block `[last token, d_1 .. d_T]` (`T + 1` tokens at
   positions `n .. n + T`; with its KV cache; a target without one, over the committed tokens and
   the block, see below). Greedy: the longest prefix of draft tokens equal to the target's argmax is
   accepted, plus the target's own token at the first mismatch (the bonus). Sampling: lossless
   rejection sampling (accept draft token `x` with probability `min(1, p(x) / q(x))`, on rejection
   sample from `max(p - q, 0)`), so the emitted tokens follow the target's distribution exactly.
   Rows that proposed fewer tokens than the block holds accept none of their padding, and take the
   target's token after their last proposal as the bonus.
3. **Commit.** The anchor and the accepted tokens become context: their target taps
   (`hidden_states[i + 1]` for `i` in `target_layer_ids`) go to the next draft forward, which
   turns them into context features `hidden_norm(fc(taps))` and writes each layer's
   `k_proj`/`v_proj` of them (k_norm and RoPE at their positions) into the draft KV cache before
   its block attends. The bonus token is the next anchor. The draft's cache holds committed
   positions only (the verified slots past a row's accepted ones are scratch, hidden and later
   overwritten), so it grows with what is committed, whatever the width of the verify block.

The target's side (`decoding.target_side`) comes in two kinds, chosen by its family
(`target.families.target_keeps_kv_cache`, docs/design.md §17 Target families), never by its class:
`CachedTarget` keeps a HF KV cache and rolls it back; `RecomputedTarget` recomputes the target over the
committed tokens plus the block every cycle (targets whose model code keeps no cache, or whose recurrent
layers cannot drop rejected tokens). Sampling and the two verification rules live in
`decoding.sampling`.

Batches: rows accept different lengths. The target's HF KV cache stays rectangular (rejected
slots become masked holes, `CachedTarget`); a recomputed target keeps each row's tokens at their
positions, right-padded (`RecomputedTarget`). Rows that hit `max_new_tokens` or a stop token are
dropped from the batch; their outputs are frozen. The draft cache is indexed by position, so a
block's visibility is simply "context positions `< n`" (`BlockVisibility` with `anchor = n`), also
for sliding-window layers.

Shapes: B batch (rows still decoding), W block size, T drafted tokens of a block (`W - 1`, or `W` when
every slot proposes), H hidden, V vocabulary, L cache length, Hq / Hkv query / KV heads, D head_dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import numpy as np
import torch
from torch import nn

from ..draft.body import DraftBody
from ..draft.kv_cache import DraftKVCache
from ..plan.batch_plan import DFlashBatchPlan
from ..target.families import resolve_text_config
from ..target.head import OutputHead
from ..variants.registry import variant_of
from .sampling import GREEDY_BELOW_TEMPERATURE, greedy_verify, rejection_verify, sample, sampling_probs
from .target_side import device_of, target_side

__all__ = ["SpecDecodeOutput", "spec_generate"]


# ================================================================================== output


@dataclass
class SpecDecodeOutput:
    """Tokens and statistics of one `spec_generate` call.

    Attributes:
        tokens: `[B, max(lengths)]` int64, each row its prompt followed by its generated
            tokens, right-padded with `pad_token_id`.
        lengths: `[B]` prompt + generated tokens per row.
        prompt_lengths: `[B]`.
        pad_token_id: the padding id of `tokens`.
        acceptance_lengths: per row, one entry per verify cycle the row took part in: the
            tokens that cycle committed, i.e. accepted draft tokens + 1 (the bonus token).
            The row's last cycle may be cut short by `max_new_tokens` or a stop token. A row's
            first generated token comes from the prefill, so for every row that generated
            anything `num_generated = 1 + sum(acceptance_lengths[row])`.
        stopped: `[B]` bool, the row ended with a stop token.
        num_target_forwards: batched verify forwards of the target (prefill excluded).
        num_prefill_forwards: target forwards over the prompts (1, or 0 if nothing was generated).
        num_draft_forwards: batched draft forwards.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    prompt_lengths: torch.Tensor
    pad_token_id: int
    acceptance_lengths: list[list[int]]
    stopped: torch.Tensor
    num_target_forwards: int = 0
    num_prefill_forwards: int = 0
    num_draft_forwards: int = 0

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_generated(self) -> torch.Tensor:
        """`[B]` generated tokens per row."""
        return self.lengths - self.prompt_lengths

    @property
    def num_cycles(self) -> list[int]:
        """Verify cycles each row took part in."""
        return [len(a) for a in self.acceptance_lengths]

    @property
    def mean_acceptance_length(self) -> float:
        """Mean tokens committed per (row, verify cycle): the usual `tau`. NaN without cycles."""
        flat = [a for row in self.acceptance_lengths for a in row]
        return float(sum(flat) / len(flat)) if flat else float("nan")

    def row_acceptance_length(self, row: int) -> float:
        values = self.acceptance_lengths[row]
        return float(sum(values) / len(values)) if values else float("nan")

    def generated(self, row: int) -> list[int]:
        """The generated tokens of `row` (without its prompt)."""
        return self.tokens[row, int(self.prompt_lengths[row]) : int(self.lengths[row])].tolist()

    def sequence(self, row: int) -> list[int]:
        """Prompt + generated tokens of `row`."""
        return self.tokens[row, : int(self.lengths[row])].tolist()

    def to_dict(self) -> dict:
        """JSON-friendly statistics (no tokens)."""
        return {
            "num_generated": self.num_generated.tolist(),
            "acceptance_lengths": [list(a) for a in self.acceptance_lengths],
            "mean_acceptance_length": self.mean_acceptance_length,
            "num_target_forwards": self.num_target_forwards,
            "num_prefill_forwards": self.num_prefill_forwards,
            "num_draft_forwards": self.num_draft_forwards,
            "stopped": self.stopped.tolist(),
        }



# ================================================================================== draft


def _check_draft(draft: nn.Module) -> None:
    if not isinstance(draft, DraftBody):
        raise ValueError(
            f"draft must be a draft body (a DFlashBody of any variant, or a KimiK3Body), got {type(draft).__name__}."
        )
    if draft.tp_group.size() != 1:
        raise ValueError(
            f"spec_generate runs the draft at tensor-parallel size 1, but it was built with TP="
            f"{draft.tp_group.size()}; load it with checkpoint.load_hf_checkpoint(directory) in a plain process."
        )



# ================================================================================== inputs


def _prompt_list(input_ids, attention_mask) -> list[list[int]]:
    """Prompts as lists of ids from a `[B, S]`/`[S]` tensor (+ optional mask) or a list of sequences."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must be integer token ids, got dtype {input_ids.dtype}.")
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
            if attention_mask is not None:
                attention_mask = attention_mask.reshape(1, -1)
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq] or [seq], got shape {tuple(input_ids.shape)}.")
        rows = input_ids.tolist()
        if attention_mask is None:
            return rows
        if tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids {tuple(input_ids.shape)}."
            )
        prompts = []
        for b, (row, mask) in enumerate(zip(rows, attention_mask.bool().tolist())):
            kept = [i for i, m in enumerate(mask) if m]
            if kept and kept != list(range(kept[0], kept[-1] + 1)):
                raise ValueError(
                    f"row {b}: the attention_mask marks non-contiguous tokens; each prompt must be one run "
                    "of real tokens (left or right padding)."
                )
            prompts.append([row[i] for i in kept])
        return prompts
    if attention_mask is not None:
        raise ValueError("attention_mask is only accepted with a tensor input_ids.")
    prompts = []
    for row in input_ids:
        if isinstance(row, torch.Tensor):
            row = row.reshape(-1).tolist()
        prompts.append([int(t) for t in row])
    return prompts


def _check_sampling(temperature, top_p, top_k, max_new_tokens) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a non-negative integer.")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature < math.inf:
        raise ValueError(f"temperature={temperature!r} must be a finite number >= 0 (0 = greedy).")
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p!r} must be in (0, 1].")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k={top_k!r} must be a non-negative integer (0 = off).")


def _stop_set(stop_token_ids) -> set:
    """`stop_token_ids` as a set: None, one id, or a sequence of ids."""
    if stop_token_ids is None:
        return set()
    if isinstance(stop_token_ids, (int, np.integer)) and not isinstance(stop_token_ids, bool):
        return {int(stop_token_ids)}
    if isinstance(stop_token_ids, torch.Tensor):
        stop_token_ids = stop_token_ids.reshape(-1).tolist()
    try:
        ids = list(stop_token_ids)
    except TypeError:
        raise ValueError(f"stop_token_ids={stop_token_ids!r} must be a token id or a sequence of token ids.") from None
    if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in ids):
        raise ValueError(f"stop_token_ids={stop_token_ids!r} must hold integer token ids.")
    return {int(t) for t in ids}


def _check_prompts(prompts: list, target: nn.Module, draft: DraftBody) -> None:
    """Ids inside the target's embedding, lengths inside the model's positions."""
    rows = getattr(target.get_input_embeddings(), "num_embeddings", None) or draft.config.vocab_size
    for b, prompt in enumerate(prompts):
        low, high = min(prompt), max(prompt)
        if low < 0 or high >= rows:
            raise ValueError(
                f"prompt {b} has token id {low if low < 0 else high}, outside the target's vocabulary [0, {rows}); "
                "tokenise with the target's tokenizer."
            )
    limit = min(int(getattr(resolve_text_config(target.config), "max_position_embeddings", None)
                    or draft.config.max_position_embeddings),
                int(draft.config.max_position_embeddings))
    longest = max(range(len(prompts)), key=lambda b: len(prompts[b]))
    if len(prompts[longest]) >= limit:
        raise ValueError(
            f"prompt {longest} has {len(prompts[longest])} tokens, but the model has {limit} positions "
            "(max_position_embeddings) and needs one more for the first generated token; shorten the prompt."
        )


def _check_pair(target: nn.Module, draft: DraftBody) -> None:
    cfg = draft.config
    tcfg = resolve_text_config(target.config)  # the text decoder's config of a multimodal wrapper
    layers = getattr(tcfg, "num_hidden_layers", None)
    if layers is not None and layers != cfg.num_target_layers:
        raise ValueError(
            f"the draft was built for a {cfg.num_target_layers}-layer target (num_target_layers) but the "
            f"target has {layers} layers; use the target the draft was trained with."
        )
    hidden = getattr(tcfg, "hidden_size", None)
    if hidden is not None and hidden != cfg.hidden_size:
        raise ValueError(
            f"draft hidden_size={cfg.hidden_size} differs from the target's hidden_size={hidden}; the draft "
            "reads the target's hidden states and embeddings, so they must match."
        )
    embedding = target.get_input_embeddings()
    rows = getattr(embedding, "num_embeddings", None)
    vocab = getattr(tcfg, "vocab_size", None) or rows
    if vocab is not None and cfg.vocab_size != vocab:
        raise ValueError(
            f"the draft's vocab_size={cfg.vocab_size} differs from the target's {vocab}; the draft's proposals "
            "and the target's distributions must share one vocabulary. Use the draft trained for this target."
        )
    if rows is not None and not cfg.mask_token_id < rows:
        raise ValueError(
            f"mask_token_id={cfg.mask_token_id} is not a row of the target embedding ({rows} rows)."
        )


def _propose(propose, hidden, anchor_ids, head, embedding, temperature, generator, proposals=None):
    """Call a draft's `propose_block` hook and check what it returns.

    The hook gets the whole block's draft hidden states `hidden [B, W, H]` (slot 0 included: a
    variant may propose from slots 0..W-2, or from every slot), the block's slot-0 tokens
    `anchor_ids [B]`, the target's output layer as an `OutputHead` (TP=1), the target's input
    embedding module (the draft applies its own `input_embedding_scale`), the temperature (0: greedy)
    and the generator. It returns `(tokens [B, T] int64, draft_probs)` or `(tokens, draft_probs,
    lengths)`, `T = proposals` (default `W - 1`, `Variant.proposals_per_block`): `draft_probs [B, T, V]`
    (V the head's width) is the distribution each token was drawn from (it may depend on the tokens
    drawn before it), required when sampling; None when greedy. `lengths [B]` (None: all `T`) is how
    many of its tokens each row proposes (a proposer that stops blocks early); the rest is padding.

    Returns:
        `(tokens [B, T], draft_probs or None, lengths [B] or None)`.
    """
    B, W, _ = hidden.shape
    T = W - 1 if proposals is None else proposals
    out = propose(hidden, anchor_ids, head, embedding, temperature, generator)
    tokens, probs, lengths = (*out, None) if len(out) == 2 else out
    if tuple(tokens.shape) != (B, T):
        raise ValueError(f"propose_block returned tokens of shape {tuple(tokens.shape)}, expected {(B, T)}.")
    if probs is not None and tuple(probs.shape) != (B, T, head.local_vocab_size):
        raise ValueError(
            f"propose_block returned draft_probs of shape {tuple(probs.shape)}, expected "
            f"{(B, T, head.local_vocab_size)}."
        )
    if temperature > 0 and probs is None:
        raise ValueError("propose_block must return its proposal distributions when sampling (temperature > 0).")
    if lengths is not None and (tuple(lengths.shape) != (B,) or bool(((lengths < 0) | (lengths > T)).any())):
        raise ValueError(f"propose_block returned lengths {lengths.tolist()}, expected {B} counts in [0, {T}].")
    return tokens.to(torch.int64), probs, None if lengths is None else lengths.to(torch.int64)


# ================================================================================== spec_generate


@dataclass
class _Rows:
    """Per-original-row bookkeeping (host side)."""

    generated: list[list[int]] = field(default_factory=list)
    acceptance: list[list[int]] = field(default_factory=list)
    stopped: list[bool] = field(default_factory=list)


@torch.inference_mode()
def spec_generate(
    target: nn.Module,
    draft: DraftBody,
    input_ids: Union[torch.Tensor, Sequence[Sequence[int]]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop_token_ids: Optional[Sequence[int]] = None,
    generator: Optional[torch.Generator] = None,
    attention_mask: Optional[torch.Tensor] = None,
    pad_token_id: Optional[int] = None,
    attention_backend: str = "chunked",
    confidence_threshold: Optional[float] = None,
) -> SpecDecodeOutput:
    """Generate with `target`, drafting blocks with `draft` (speculative decoding).

    Args:
        target: a HF causal LM (e.g. `Qwen3ForCausalLM`, `LlamaForCausalLM`), frozen, without
            sliding-window layers; its input embedding, LM head and hidden states are used. Or a
            causal LM of a family whose targets keep no KV cache (Kimi K3, `kimi_k3_target`) or
            with linear-attention layers (Qwen3.5): recomputed over the committed tokens every
            cycle (target work quadratic in the generated length; for measuring acceptance, not
            for serving).
        draft: a `DFlashBody` (any registered variant) or a `KimiK3Body` at TP=1 for this target.
        input_ids: `[B, S]` / `[S]` token ids (with `attention_mask` `[B, S]` when padded), or a
            list of B token-id sequences of any lengths (each >= 1 token).
        max_new_tokens: tokens to generate per row at most.
        temperature: 0 = greedy; > 0 samples (the draft proposes from `softmax(logits / T)`, the
            target distribution also gets `top_p` / `top_k`), losslessly.
        top_p, top_k: applied to the target's distribution (temperature > 0 only).
        stop_token_ids: a row stops after emitting any of these (the stop token is kept).
        generator: `torch.Generator` on the target's device for every random draw.
        attention_mask: marks real tokens of a padded tensor `input_ids` (left or right padding).
        pad_token_id: pads `tokens` of the result (default: the target's pad, else eos, else 0).
        attention_backend: the draft's block attention backend ("chunked": exact, any shape).
        confidence_threshold: drafts with a confidence head (DSpark) only; None (default): off. A row
            stops proposing at the first slot whose cumulative confidence (product of the slots'
            `sigmoid(confidence logit)`) is below it; lossless, only the acceptance per cycle changes.

    A DSpark draft proposes from every slot (`Variant.proposes_every_slot`, each token drawn given the one
    before it): its blocks verify `W + 1` tokens, a cycle commits up to `W + 1` (other variants: `W`).

    Returns:
        `SpecDecodeOutput`: tokens, lengths and acceptance statistics.
    """
    _check_draft(draft)
    if confidence_threshold is not None:  # refused now, before any forward: another variant, no head, a bad value
        variant_of(draft).propose_fn(draft, confidence_threshold)
    _check_sampling(temperature, top_p, top_k, max_new_tokens)
    _check_pair(target, draft)
    prompts = _prompt_list(input_ids, attention_mask)
    if not prompts:
        raise ValueError("input_ids holds no prompt.")
    empty = [b for b, p in enumerate(prompts) if len(p) == 0]
    if empty:
        raise ValueError(f"prompts {empty} are empty; every prompt needs at least one token.")
    _check_prompts(prompts, target, draft)
    if pad_token_id is None:
        pad_token_id = _default_pad(resolve_text_config(target.config))
    stop_set = _stop_set(stop_token_ids)
    if temperature < GREEDY_BELOW_TEMPERATURE:
        # softmax(logits / T) over- or underflows for tiny T; its limit is the argmax (the reference's rule)
        temperature = 0.0

    device = device_of(target)
    cfg = draft.config
    W = cfg.block_size
    B0 = len(prompts)
    prompt_lengths = [len(p) for p in prompts]
    sampling = temperature > 0
    rows = _Rows([[] for _ in range(B0)], [[] for _ in range(B0)], [False] * B0)
    stats = {"target": 0, "prefill": 0, "draft": 0}

    if max_new_tokens > 0:
        _decode(
            target, draft, prompts, rows, stats, device=device, max_new_tokens=max_new_tokens,
            temperature=temperature, top_p=top_p, top_k=top_k, stop_set=stop_set,
            generator=generator, sampling=sampling, W=W, attention_backend=attention_backend,
            confidence_threshold=confidence_threshold,
        )

    lengths = [prompt_lengths[b] + len(rows.generated[b]) for b in range(B0)]
    width = max(lengths)
    tokens = torch.tensor(
        [prompts[b] + rows.generated[b] + [int(pad_token_id)] * (width - lengths[b]) for b in range(B0)],
        dtype=torch.int64,
    )
    return SpecDecodeOutput(
        tokens=tokens.to(device),
        lengths=torch.tensor(lengths, dtype=torch.int64, device=device),
        prompt_lengths=torch.tensor(prompt_lengths, dtype=torch.int64, device=device),
        pad_token_id=int(pad_token_id),
        acceptance_lengths=rows.acceptance,
        stopped=torch.tensor(rows.stopped, dtype=torch.bool, device=device),
        num_target_forwards=stats["target"],
        num_prefill_forwards=stats["prefill"],
        num_draft_forwards=stats["draft"],
    )


def _default_pad(config) -> int:
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(config, name, None)
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0


def _decode(
    target, draft, prompts, rows: _Rows, stats, *, device, max_new_tokens, temperature, top_p, top_k,
    stop_set, generator, sampling, W, attention_backend, confidence_threshold=None,
) -> None:
    """Prefill + draft/verify cycles; fills `rows` (per original row) and `stats`.

    Its keyword arguments are the seam the decoding-parity oracle replaces (`spec_generate` calls it by
    name); from here on they travel as one `_DecodeSettings`.
    """
    settings = _DecodeSettings(
        device=device, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
        stop_set=stop_set, generator=generator, sampling=sampling, W=W, attention_backend=attention_backend,
    )
    side = _DraftSide.of(target, draft, confidence_threshold)
    # the widest verify block: the anchor and every proposal
    verifier = target_side(target, draft.config.target_layer_ids, draft.config.mask_token_id, side.proposals + 1)
    try:
        _cycles(verifier, side, prompts, rows, stats, settings)
    finally:
        verifier.close()


@dataclass(frozen=True)
class _DecodeSettings:
    """What `spec_generate` was asked for, fixed for the whole decode.

    ``W``: the block size; ``sampling``: ``temperature > 0``; ``stop_set``: the stop token ids.
    """

    device: torch.device
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop_set: set
    generator: Optional[torch.Generator]
    sampling: bool
    W: int
    attention_backend: str

    def target_dist(self, logits: torch.Tensor) -> torch.Tensor:
        """``[..., V]`` logits -> the target's sampling distribution ``[..., V]``."""
        return sampling_probs(logits, self.temperature, self.top_p, self.top_k)

    def draw(self, logits: torch.Tensor) -> torch.Tensor:
        """``[B, V]`` target logits -> ``[B]`` next token: sampled, or the argmax when greedy."""
        return sample(self.target_dist(logits), self.generator) if self.sampling else logits.argmax(dim=-1)


@dataclass(frozen=True)
class _DraftSide:
    """The draft and the target modules it proposes with: the target's input embedding and output layer (as
    an `OutputHead`), and the variant's proposer.

    ``propose`` (DFlash 2's selector walk, Domino's `propose_block`, DSpark's Markov walk): ``propose(hidden
    [B, W, H], anchor_ids [B], head, embedding, temperature, generator) -> (tokens [B, T], draft_probs [B, T, V]
    or None[, lengths [B] or None])``, see `_propose`; None: each slot proposes its own token. ``proposals``:
    ``T``, the tokens a block proposes (`Variant.proposals_per_block`).
    """

    draft: DraftBody
    embedding: nn.Module
    head_layer: nn.Module
    head: OutputHead
    propose: Optional[Callable]
    proposals: int

    @classmethod
    def of(cls, target: nn.Module, draft: DraftBody, confidence_threshold: Optional[float] = None) -> "_DraftSide":
        head_layer = target.get_output_embeddings()
        variant = variant_of(draft)
        # a reduced draft vocabulary: the draft's own head (docs/design.md §20)
        head = OutputHead.of_draft(draft, OutputHead.from_config(head_layer, draft.config))
        return cls(
            draft=draft,
            embedding=target.get_input_embeddings(),
            head_layer=head_layer,
            head=head,
            propose=variant.propose_fn(draft, confidence_threshold),
            proposals=variant.proposals_per_block(draft.config.block_size),
        )


@dataclass
class _DecodeState:
    """The batch rows still decoding (B of them) and what the next cycle starts from.

    ``committed [B]``: committed length = position of the next block's slot 0; ``last [B]``: the next block's
    anchor token; ``new_context [B, C, taps*H]``: context committed but not yet seen by the draft, which the
    next draft forward writes into ``draft_cache`` at positions ``new_start[b] + j`` (``new_start [B]``)
    before its block attends over the cache; ``row_ids``: the original row of each batch row; ``active``:
    which batch rows go on.
    """

    committed: torch.Tensor
    last: torch.Tensor
    new_context: torch.Tensor
    new_start: torch.Tensor
    draft_cache: DraftKVCache
    row_ids: list
    active: list


def _cycles(verifier, side: _DraftSide, prompts, rows: _Rows, stats, settings: _DecodeSettings) -> None:
    """The prefill and the draft / verify / commit cycles, the target's side through `verifier` (a
    `target_side.CachedTarget` or `RecomputedTarget`: `prefill`, `verify`, `commit`, `select_rows`)."""
    state = _prefill(verifier, side.draft, prompts, rows, stats, settings)
    while _drop_finished_rows(state, verifier, settings.device):
        block, draft_probs, lengths = _draft_block(state, side, stats, settings)
        # ---- verify: the target over the block [anchor, d_1 .. d_T] at positions committed .. committed + T ----
        target_logits, block_taps = verifier.verify(block, state.committed)  # [B, T+1, V], [B, T+1, taps*H]
        stats["target"] += 1
        if settings.sampling:
            accepted, bonus = rejection_verify(
                block[:, 1:], settings.target_dist(target_logits), draft_probs, settings.generator, lengths
            )
        else:
            accepted, bonus = greedy_verify(block[:, 1:], target_logits, lengths)
        # ---- commit: anchor + accepted become context (all T + 1 verified slots go to the draft's
        # next forward; those past the accepted ones are scratch); the bonus is the next anchor ----
        state.new_context, state.new_start = block_taps, state.committed
        verifier.commit(accepted)
        state.committed = state.committed + accepted + 1
        state.last = bonus
        _record_produced(rows, state, block, accepted, bonus, settings)


def _prefill(verifier, draft: DraftBody, prompts, rows: _Rows, stats, settings: _DecodeSettings) -> _DecodeState:
    """The target over the prompts, each row's first token recorded in `rows`; the state of the first cycle."""
    B = len(prompts)
    device = settings.device
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int64, device=device)
    S = int(lengths.max())
    last_logits, new_context = verifier.prefill(prompts, lengths)
    stats["prefill"] += 1
    first = settings.draw(last_logits)
    # The draft's KV cache, sized for the first cycles only; a forward that writes past its end
    # grows it (doubling), so it follows what is committed.
    W = settings.W
    draft_cache = DraftKVCache(draft, B, S + W + min(settings.max_new_tokens, 4 * W))
    active = []
    for b in range(B):
        token = int(first[b])
        rows.generated[b].append(token)
        done = token in settings.stop_set
        rows.stopped[b] = done
        active.append(not done and len(rows.generated[b]) < settings.max_new_tokens)
    # The prompt's taps go to the draft's first forward, at index = position.
    return _DecodeState(
        committed=lengths.clone(), last=first, new_context=new_context,
        new_start=torch.zeros(B, dtype=torch.int64, device=device), draft_cache=draft_cache,
        row_ids=list(range(B)), active=active,
    )


def _drop_finished_rows(state: _DecodeState, verifier, device) -> bool:
    """Drop the rows that are not active from every piece of state; False when none is left."""
    if all(state.active):
        return True
    keep = [i for i, a in enumerate(state.active) if a]
    if not keep:
        return False
    index = torch.tensor(keep, dtype=torch.int64, device=device)
    verifier.select_rows(index)
    state.draft_cache.select_rows(index)
    state.committed, state.last = state.committed[index], state.last[index]
    state.new_context, state.new_start = state.new_context[index], state.new_start[index]
    state.row_ids = [state.row_ids[i] for i in keep]
    state.active = [True] * len(keep)
    return True


def _draft_block(
    state: _DecodeState, side: _DraftSide, stats, settings: _DecodeSettings
) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """One draft forward over ``[anchor, MASK, ..]`` (``W`` slots): ``(block [B, 1 + T] int64, draft_probs
    [B, T, V] or None, lengths [B] or None)``, slot 0 the anchor ``state.last``, then the ``T`` proposals (with
    the distributions they were drawn from when sampling). With per-row ``lengths`` (a proposer that stops
    early) the block is as wide as the longest row's proposals; a shorter row's slots past its own are padding."""
    cfg = side.draft.config
    W, device = settings.W, settings.device
    B = len(state.row_ids)
    inputs = torch.full((B, W), cfg.mask_token_id, dtype=torch.int64, device=device)
    inputs[:, 0] = state.last
    embedded = side.embedding(inputs)
    if isinstance(embedded, tuple):
        embedded = embedded[0]
    scale = float(cfg.input_embedding_scale)
    if scale != 1.0:
        embedded = embedded * scale
    plan = DFlashBatchPlan.for_decoding(
        state.committed, state.new_start[:, None] + torch.arange(state.new_context.shape[1], device=device),
        block_size=W,
    )
    hidden = side.draft(state.new_context, embedded[:, None], plan, state.draft_cache, settings.attention_backend)
    hidden = hidden[:, 0]  # [B, W, H]
    stats["draft"] += 1
    draft_probs = lengths = None
    if side.propose is not None:
        temperature = settings.temperature if settings.sampling else 0.0
        path, draft_probs, lengths = _propose(
            side.propose, hidden, state.last, side.head, side.embedding, temperature, settings.generator,
            side.proposals,
        )
        if lengths is not None:  # verify no slot that every row left out
            width = int(lengths.max())
            path = path[:, :width]
            draft_probs = None if draft_probs is None else draft_probs[:, :width]
    else:
        # The proposing slots (1..W-1, or all of them when every slot proposes) through the head's full
        # width (columns past the draft's vocab_size are -inf), so draft and target distributions share
        # one index space.
        slots = hidden[:, W - side.proposals:]
        draft_logits = side.head.local_logits(slots)  # [B, T, V] (a reduced vocabulary: [B, T, K])
        if settings.sampling:
            draft_probs = torch.softmax(draft_logits / settings.temperature, dim=-1)
            path = sample(draft_probs, settings.generator)
        else:
            path = draft_logits.argmax(dim=-1)
        if side.head.draft_vocab is not None:
            path, draft_probs = _on_target_ids(side, path, draft_probs)
    return torch.cat([state.last[:, None].to(torch.int64), path], dim=1), draft_probs, lengths


def _on_target_ids(side: _DraftSide, path: torch.Tensor, draft_probs: Optional[torch.Tensor]):
    """A reduced draft vocabulary's proposals on the target's ids: ``path [B, T]`` draft ids -> target ids (``ids
    + d2t``), and the proposal distributions ``[B, T, K]`` placed on their target ids of the target's ``[B, T, V]``
    (zero elsewhere), so rejection sampling compares the draft's exact law with the target's and stays lossless
    (docs/design.md §20 Reduced draft vocabulary)."""
    ids = side.head.draft_vocab.ids.to(path.device)
    if draft_probs is not None:
        V = side.head_layer.weight.shape[0]
        placed = draft_probs.new_zeros(*draft_probs.shape[:-1], V)
        draft_probs = placed.index_copy_(-1, ids, draft_probs[..., : ids.numel()])
    return ids[path], draft_probs


def _record_produced(
    rows: _Rows, state: _DecodeState, block: torch.Tensor, accepted: torch.Tensor, bonus: torch.Tensor,
    settings: _DecodeSettings,
) -> None:
    """Each batch row's accepted tokens of ``block [B, 1 + T]`` (``accepted [B]`` of them) and its ``bonus [B]``
    token, cut at ``max_new_tokens`` and after a stop token, appended to its original row in `rows`; marks
    which batch rows go on."""
    max_new_tokens = settings.max_new_tokens
    block_host, accepted_host, bonus_host = block.tolist(), accepted.tolist(), bonus.tolist()
    for i, row in enumerate(state.row_ids):
        a = accepted_host[i]
        produced = block_host[i][1 : 1 + a] + [bonus_host[i]]
        produced = produced[: max_new_tokens - len(rows.generated[row])]
        for j, token in enumerate(produced):
            if token in settings.stop_set:
                produced = produced[: j + 1]
                rows.stopped[row] = True
                break
        rows.generated[row].extend(produced)
        rows.acceptance[row].append(len(produced))
        state.active[i] = not rows.stopped[row] and len(rows.generated[row]) < max_new_tokens
