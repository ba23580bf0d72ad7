"""Domino: the DFlash backbone plus a causal GRU correction head (SpecForge #571, arXiv:2605.29707).

DFlash drafts a whole block in one bidirectional forward, so a drafted position is blind to the tokens
drafted before it in its block. Domino adds a small **causal** head on top of the backbone:

* ``prefix_gru``: a one-layer GRU (no biases) over the target's input embeddings of the tokens that
  precede each predicted position in the block, starting with the anchor. Its output at a position is a
  causal summary of the block so far.
* ``embed_proj``: ``Linear(H + G -> E) -> SiLU -> Linear(E -> V)`` applied to ``[backbone hidden | GRU
  state]``; its output is a **logit delta** added to the backbone's (base) logits:

      final_logits = base_logits + embed_proj([z | gru_state])      (corrected slots only)

  ``base_logits`` are the target output layer's logits of the backbone hidden ``z`` (with the draft's
  ``output_multiplier`` / ``final_logit_softcapping``), the delta is added after that transform.

Which slots are predicted, with which previous tokens (``W = block_size``, anchor at ``p``):

* default (``shift_label=False``, the DFlash convention): slot ``k = 1..W-1`` predicts ``x_{p+k}``;
  the GRU runs over ``x_p .. x_{p+W-2}`` and slot ``k`` reads its state after ``x_{p+k-1}``.
* ``shift_label=True``: slot ``k = 0..W-1`` predicts ``x_{p+1+k}`` (slot 0, the anchor, already makes
  a real next-token prediction); the GRU runs over ``x_p .. x_{p+W-1}`` and slot ``k`` reads its state
  after ``x_{p+k}``. The label of the last slot lies one past the block; it is supervised only where
  it is inside the sequence, in the anchor's document and in the loss mask.

In both cases the previous tokens are the block's ground truth, starting at the anchor (teacher
forcing), and the correction starts at slot ``correction_start = (0 if shift_label else 1) +
pure_draft_prefix_len``: the first ``pure_draft_prefix_len`` predicted slots keep the backbone's
logits (their tokens still feed the GRU).

**Training** (`domino_loss`) supervises both logits with the base-anchor curriculum of the reference::

    loss = (1 - lambda_base) * final_CE + lambda_base * base_CE

(decay-weighted CE on the corrected logits and on the backbone-only logits, both normalised by the same
global weight sum), with ``lambda_base = domino_lambda(step, total_steps, lambda_start=...,
decay_ratio=...)`` decaying linearly from ``lambda_start`` to 0 over the first ``decay_ratio`` of
training (clamped to [0, 1]): early steps keep the parallel backbone strong, later ones hand over to
the correction head.

**Decoding** (`domino_walk` / `domino_propose`, reached from `decoding.generate.spec_generate` through the
draft's ``propose_block`` hook) walks the block left to right: the GRU consumes the anchor, the
drafted slot's corrected logits pick (or sample) its token, that token is fed to the GRU for the next
slot. A walk that commits the ground-truth tokens computes exactly the training logits, so the
teacher-forced acceptance length of `DominoMetrics` is what the greedy walk would accept.

**Tensor parallelism and memory.** The GRU and ``embed_proj`` are replicated over the TP group (small:
``3G(H+G) + E(H+G) + V E`` weights). The delta is only ever formed for this rank's vocabulary shard
(rows ``vocab_range`` of ``embed_proj.2.weight``) and added to the shard's base logits, chunk by chunk:
the loss holds a few ``[chunk_slots, V / TP]`` fp32 buffers at a time (base and corrected logits, their
softmax, the delta), whatever the number of slots, in the one loss kernel of every variant (`objectives.head_loss.head_loss`). Each rank's gradient w.r.t. the replicated features and ``embed_proj.2`` is
summed over the group, so every rank holds the full, identical gradient of the replicated weights.

**HF format.** ``architectures: ["DominoDraftModel"]``; ``dflash_config`` adds ``projector_type:
"domino"``, ``emb_dim`` (E), ``gru_hidden_dim`` (G), ``shift_label``, ``pure_draft_prefix_len``;
``model.safetensors`` adds ``prefix_gru.weight_ih_l0 [3G, H]``, ``prefix_gru.weight_hh_l0 [3G, G]``,
``embed_proj.0.weight [E, H + G]`` and ``embed_proj.2.weight [V, E]``: the names, shapes and fields
of the published SpecForge / NeMo Domino drafters (``DominoDraftModel``), so their files load here and
ours there. A file labelled ``DFlashDraftModel`` with ``dflash_config.projector_type: "domino"`` (the
first SpecForge layout) is read too.

Deviations from the reference, on purpose: ``embed_proj.2`` starts at zero (an untrained Domino draft
is exactly its DFlash backbone, and training starts from it; the other weights still get gradients from
the second step), and the GRU reads the embeddings times ``input_embedding_scale`` (1.0 for every
Qwen3-family target), the same embeddings the draft blocks are built from.

Shapes: B batch, S sequence, N blocks per row, W block size, P predicted slots per block (``W - 1``, or
``W`` with ``shift_label``), H hidden, G ``gru_hidden_dim``, E ``emb_dim``, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..common.parallel import reduce_grad_over_group
from ..draft.body import DFlashBody
from ..draft.config import DFLASH_ARCHITECTURE, DFlashConfig
from ..objectives.dflash_loss import (
    EmittedPathMetrics,
    SlotTargets,
    acceptance_lengths,
    check_block_hidden,
    counted_blocks,
    decay_weights,
    shifted_supervision,
)
from ..objectives.head_loss import check_loss_options, head_loss
from ..plan.batch_plan import DFlashBatchPlan
from .dflash2 import GREEDY_TEMPERATURE_EPS
from .proposals import draw_token

__all__ = [
    "DOMINO_ARCHITECTURE",
    "DOMINO_PROJECTOR_TYPE",
    "DominoConfig",
    "is_domino_hf_config",
    "DominoHead",
    "DominoBody",
    "domino_lambda",
    "domino_block_targets",
    "DominoMetrics",
    "DominoLossOutput",
    "domino_loss",
    "domino_walk",
    "domino_propose",
]

DOMINO_ARCHITECTURE = "DominoDraftModel"
DOMINO_PROJECTOR_TYPE = "domino"
# Domino fields of `dflash_config` in config.json (published names).
_DOMINO_KEYS = ("emb_dim", "gru_hidden_dim", "shift_label", "pure_draft_prefix_len")


# ================================================================================== config


@dataclass
class DominoConfig(DFlashConfig):
    """`DFlashConfig` plus the Domino head fields (the in-block direction is DFlash's).

    Fields:
        emb_dim: E, width of the correction MLP (``embed_proj``); 256 in the published drafters.
        gru_hidden_dim: G, the GRU state size; 1024 in the published drafters.
        shift_label: slot ``k`` predicts ``x_{p+1+k}`` (slot 0 included) instead of ``x_{p+k}``.
        pure_draft_prefix_len: leading predicted slots that keep the backbone's logits uncorrected.
    """

    emb_dim: int = 256
    gru_hidden_dim: int = 1024
    shift_label: bool = False
    pure_draft_prefix_len: int = 0

    def validate(self) -> None:
        super().validate()
        for name in ("emb_dim", "gru_hidden_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer.")
        if not isinstance(self.shift_label, bool):
            raise ValueError(f"shift_label={self.shift_label!r} must be True or False.")
        p = self.pure_draft_prefix_len
        if not isinstance(p, int) or isinstance(p, bool) or p < 0:
            raise ValueError(f"pure_draft_prefix_len={p!r} must be a non-negative integer.")
        if self.correction_start > self.block_size - 1:
            raise ValueError(
                f"pure_draft_prefix_len={p} leaves no corrected slot in a block of {self.block_size} "
                f"(correction starts at slot {self.correction_start}, the last slot is {self.block_size - 1}); "
                "use a smaller pure_draft_prefix_len."
            )

    @property
    def correction_start(self) -> int:
        """First block slot whose logits the head corrects: ``(0 if shift_label else 1) + pure_draft_prefix_len``."""
        return (0 if self.shift_label else 1) + self.pure_draft_prefix_len

    def to_hf_dict(self, architecture: Optional[str] = None) -> dict[str, Any]:
        """The published Domino `config.json`: ``architectures: ["DominoDraftModel"]`` and
        ``dflash_config.{projector_type, emb_dim, gru_hidden_dim, shift_label, pure_draft_prefix_len}``.

        Always written as Domino: a Domino file served as plain DFlash would drop the correction head
        (and, with ``shift_label``, read every label one slot off).
        """
        if architecture not in (None, DFLASH_ARCHITECTURE, DOMINO_ARCHITECTURE):
            raise ValueError(
                f"architecture={architecture!r}: a Domino config is always written as {DOMINO_ARCHITECTURE!r}."
            )
        out = super().to_hf_dict(DOMINO_ARCHITECTURE)
        out["dflash_config"]["projector_type"] = DOMINO_PROJECTOR_TYPE
        out["dflash_config"].update({name: getattr(self, name) for name in _DOMINO_KEYS})
        return out

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any], **overrides: Any) -> "DominoConfig":
        """Read a Domino `config.json` (``DominoDraftModel``, or ``DFlashDraftModel`` with
        ``dflash_config.projector_type: "domino"``).

        Raises:
            ValueError: the file is not a Domino draft, or lacks ``emb_dim`` / ``gru_hidden_dim``.
        """
        data = dict(data)
        if not is_domino_hf_config(data):
            raise ValueError(
                f"config.json has architectures={data.get('architectures')} and dflash_config.projector_type="
                f"{(data.get('dflash_config') or {}).get('projector_type')!r}: not a Domino draft. Load it with "
                "DFlashConfig instead."
            )
        dflash = dict(data.get("dflash_config") or {})
        values: dict[str, Any] = {}
        for name in _DOMINO_KEYS:
            source = dflash if name in dflash else data
            if name in source:
                value = source[name]
                values[name] = bool(value) if name == "shift_label" else int(value)
        missing = [n for n in ("emb_dim", "gru_hidden_dim") if n not in values and n not in overrides]
        if missing:
            raise ValueError(
                f"config.json lacks the Domino fields {missing} (expected in dflash_config); the correction head "
                "cannot be built without them."
            )
        values.update(overrides)
        return super().from_hf_dict(data, **values)

    def save_pretrained(self, directory: str, architecture: Optional[str] = None) -> None:
        super().save_pretrained(directory, architecture=architecture)


def is_domino_hf_config(data: Mapping[str, Any]) -> bool:
    """Whether a `config.json` dict describes a Domino draft (see `DominoConfig.from_hf_dict`)."""
    architectures = data.get("architectures") or []
    projector = (data.get("dflash_config") or {}).get("projector_type", data.get("projector_type"))
    return DOMINO_ARCHITECTURE in architectures or projector == DOMINO_PROJECTOR_TYPE


# ================================================================================== curriculum


def domino_lambda(step: int, total_steps: int, *, lambda_start: float, decay_ratio: float) -> float:
    """Base-loss weight ``lambda_base`` at optimizer step ``step`` (0-based), the reference's schedule.

    The decay lasts ``D = max(1, int(total_steps * decay_ratio))`` steps (an integer, at least one):
    ``lambda_start * (1 - min(step / D, 1))``, clamped to ``[0, 1]``. So step 0 always gets
    ``lambda_start`` (also with ``decay_ratio = 0``, which decays over one step), and every step from
    ``D`` on gets 0.
    """
    for name, value in (("step", step), ("total_steps", total_steps)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name}={value!r} must be an integer.")
    if step < 0 or total_steps < 1:
        raise ValueError(f"step={step} must be >= 0 and total_steps={total_steps} >= 1.")
    if not (isinstance(decay_ratio, (int, float)) and 0.0 <= decay_ratio <= 1.0):
        raise ValueError(f"decay_ratio={decay_ratio!r} must be in [0, 1].")
    if not (isinstance(lambda_start, (int, float)) and math.isfinite(lambda_start)):
        raise ValueError(f"lambda_start={lambda_start!r} must be a finite number.")
    decay_steps = max(1, int(total_steps * decay_ratio))
    value = float(lambda_start) * (1.0 - min(step / decay_steps, 1.0))
    return min(1.0, max(0.0, value))


# ================================================================================== the head


class DominoHead(nn.Module):
    """The Domino correction head: ``prefix_gru`` and ``embed_proj`` (published names and shapes).

    Args:
        hidden_size: H, the backbone's (and the target embedding's) width.
        vocab_size: V, the target vocabulary (rows of ``embed_proj.2.weight``).
        emb_dim: E.
        gru_hidden_dim: G.
        shift_label: see the module docstring.
        pure_draft_prefix_len: see the module docstring.
        init_std: std of the normal init of ``embed_proj.0``; ``embed_proj.2`` starts at zero.

    The head computes on full tensors (it is replicated over TP); `local_delta` forms the logit delta of
    one vocabulary shard.
    """

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        emb_dim: int = 256,
        gru_hidden_dim: int = 1024,
        *,
        shift_label: bool = False,
        pure_draft_prefix_len: int = 0,
        init_std: float = 0.02,
        dtype: torch.dtype = torch.float32,
        device=None,
    ):
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("vocab_size", vocab_size), ("emb_dim", emb_dim),
                            ("gru_hidden_dim", gru_hidden_dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer.")
        pure = pure_draft_prefix_len
        if isinstance(pure, bool) or not isinstance(pure, int) or pure < 0:
            raise ValueError(f"pure_draft_prefix_len={pure_draft_prefix_len!r} must be a non-negative integer.")
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.emb_dim = emb_dim
        self.gru_hidden_dim = gru_hidden_dim
        self.shift_label = bool(shift_label)
        self.pure_draft_prefix_len = pure_draft_prefix_len
        self.init_std = init_std
        self.prefix_gru = nn.GRU(
            input_size=hidden_size, hidden_size=gru_hidden_dim, num_layers=1, batch_first=True, bias=False,
            dtype=dtype, device=device,
        )
        self.embed_proj = nn.Sequential(
            nn.Linear(hidden_size + gru_hidden_dim, emb_dim, bias=False, dtype=dtype, device=device),
            nn.SiLU(),
            nn.Linear(emb_dim, vocab_size, bias=False, dtype=dtype, device=device),
        )
        self.reset_parameters()

    @classmethod
    def from_config(cls, config: DominoConfig, *, dtype: torch.dtype = torch.float32, device=None) -> "DominoHead":
        return cls(
            config.hidden_size,
            config.vocab_size,
            config.emb_dim,
            config.gru_hidden_dim,
            shift_label=config.shift_label,
            pure_draft_prefix_len=config.pure_draft_prefix_len,
            init_std=config.initializer_range,
            dtype=dtype,
            device=device,
        )

    def reset_parameters(self) -> None:
        """GRU: torch's default uniform init; ``embed_proj.0``: normal(0, init_std); ``embed_proj.2``: zero,
        so the delta starts at 0 and the draft starts as its DFlash backbone."""
        with torch.no_grad():
            self.prefix_gru.reset_parameters()
            nn.init.normal_(self.embed_proj[0].weight, mean=0.0, std=self.init_std)
            self.embed_proj[2].weight.zero_()

    # ---------------------------------------------------------------- layout
    @property
    def correction_start(self) -> int:
        """First block slot that gets the correction (see `DominoConfig.correction_start`)."""
        return (0 if self.shift_label else 1) + self.pure_draft_prefix_len

    @property
    def label_offset(self) -> int:
        """Slot ``k`` predicts the token at ``p + k + label_offset``."""
        return 1 if self.shift_label else 0

    def predicted_slots(self, block_size: int) -> range:
        """The block slots that make a supervised prediction: ``1..W-1``, or ``0..W-1`` with ``shift_label``."""
        return range(0 if self.shift_label else 1, block_size)

    def decode_slots(self, block_size: int) -> range:
        """The slots whose predictions decoding proposes, the tokens at ``n + 1 .. n + W - 1``."""
        return range(0, block_size - 1) if self.shift_label else range(1, block_size)

    # ---------------------------------------------------------------- computation
    def states(
        self, prev_embeddings: torch.Tensor, state: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the GRU: ``prev_embeddings [..., L, H]`` -> (outputs ``[..., L, G]``, last state ``[1, prod(...), G]``).

        ``state`` continues a previous call (decoding feeds one token at a time); None starts at zero.
        """
        lead = prev_embeddings.shape[:-2]
        L, H = prev_embeddings.shape[-2:]
        if H != self.hidden_size:
            raise ValueError(
                f"prev_embeddings must be [..., L, {self.hidden_size}], got {tuple(prev_embeddings.shape)}."
            )
        x = prev_embeddings.reshape(-1, L, H).to(self.prefix_gru.weight_ih_l0.dtype)
        out, last = self.prefix_gru(x, state)
        return out.reshape(*lead, L, self.gru_hidden_dim), last

    def features(self, hidden: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """``silu(embed_proj.0([hidden | states]))``: ``[..., H]``, ``[..., G]`` -> ``[..., E]``."""
        first = self.embed_proj[0]
        x = torch.cat([hidden.to(first.weight.dtype), states.to(first.weight.dtype)], dim=-1)
        return self.embed_proj[1](first(x))

    def local_delta(self, features: torch.Tensor, head, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        """fp32 logit delta ``[..., V_local]`` of `head`'s vocabulary shard (zero on padding columns).

        Args:
            features: ``[..., E]`` from `features`.
            head: the `objectives.OutputHead` whose shard (``vocab_range``) to produce.
            weight: the rows ``vocab_range`` of ``embed_proj.2.weight`` (see `shard_weight`); computed
                here when None.
        """
        if weight is None:
            weight = self.shard_weight(head)
        return F.linear(features.to(weight.dtype), weight).float()

    def shard_weight(self, head, group=None) -> torch.Tensor:
        """Rows ``head.vocab_range`` of ``embed_proj.2.weight`` ``[V_local, E]``, zero rows for padding.

        With ``group`` (the head's TP group) the gradient of the full weight is summed over it, so every
        rank gets the full gradient of the replicated weight.
        """
        weight = self.embed_proj[2].weight
        if group is not None:
            weight = reduce_grad_over_group(weight, group)
        start, end = head.vocab_range
        rows = weight[min(start, self.vocab_size) : min(end, self.vocab_size)]
        missing = (end - start) - rows.shape[0]
        if missing:
            rows = F.pad(rows, (0, 0, 0, missing))
        return rows

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, vocab_size={self.vocab_size}, emb_dim={self.emb_dim}, "
            f"gru_hidden_dim={self.gru_hidden_dim}, shift_label={self.shift_label}, "
            f"pure_draft_prefix_len={self.pure_draft_prefix_len}"
        )


# ================================================================================== body


class DominoBody(DFlashBody):
    """`DFlashBody` plus the Domino head (`domino_head`, a `DominoHead` submodule).

    Same constructor and `forward` as `DFlashBody` (the backbone is unchanged; the head acts on its
    output). The head is replicated over TP and built in the parallel config's ``params_dtype``.

    State-dict names are the published ones: the head's tensors appear as ``prefix_gru.*`` and
    ``embed_proj.*`` at the top level (the published drafters register them on the model itself), not
    under ``domino_head.``; `state_dict` and `load_state_dict` translate (`HEAD_PREFIX`). `prefix_gru` /
    `embed_proj` read the head's modules.

    `propose_block` is this variant's decode proposer (`variants.registry`, `decoding.generate.spec_generate`).
    """

    HEAD_PREFIX = "domino_head."

    def __init__(self, config: DominoConfig, parallel_config=None, tp_group=None, attention_backend: str = "auto"):
        if not isinstance(config, DominoConfig):
            raise ValueError(
                f"DominoBody needs a DominoConfig, got {type(config).__name__}; build one with DominoConfig(...) "
                "or DominoConfig.from_pretrained(directory)."
            )
        super().__init__(
            config, parallel_config=parallel_config, tp_group=tp_group, attention_backend=attention_backend
        )
        self.domino_head = DominoHead.from_config(config, dtype=self.fc.weight.dtype, device=self.fc.weight.device)
        self.register_state_dict_post_hook(_publish_head_names)
        self.register_load_state_dict_pre_hook(_read_published_head_names)

    @property
    def prefix_gru(self) -> nn.GRU:
        return self.domino_head.prefix_gru

    @property
    def embed_proj(self) -> nn.Sequential:
        return self.domino_head.embed_proj

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
        """Draft tokens of one block per row: `domino_propose` with this body's head and config."""
        return domino_propose(
            hidden,
            anchor_ids,
            self.domino_head,
            head,
            embedding,
            input_embedding_scale=self.config.input_embedding_scale,
            temperature=temperature,
            generator=generator,
        )


def _publish_head_names(module: DominoBody, state_dict, prefix: str, local_metadata) -> None:
    """`domino_head.prefix_gru.*` -> `prefix_gru.*` (the published names), in place and in order."""
    inner = prefix + DominoBody.HEAD_PREFIX
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner):]] = state_dict.pop(key)


def _read_published_head_names(module: DominoBody, state_dict, prefix: str, *args) -> None:
    """The inverse of `_publish_head_names` for `load_state_dict`."""
    for name in ("prefix_gru.", "embed_proj."):
        for key in [k for k in state_dict if k.startswith(prefix + name)]:
            state_dict[prefix + DominoBody.HEAD_PREFIX + key[len(prefix):]] = state_dict.pop(key)


# ================================================================================== targets


def _embed(embedding: nn.Module, ids: torch.Tensor, scale: float) -> torch.Tensor:
    """The target's input embedding (module call: vocab-parallel tables do their own lookup) times `scale`."""
    out = embedding(ids)
    if isinstance(out, tuple):
        out = out[0]
    return out * scale if scale != 1.0 else out


def domino_block_targets(
    input_ids: torch.Tensor,
    plan: DFlashBatchPlan,
    *,
    shift_label: bool,
    input_mask: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Labels, supervision and previous tokens of the predicted slots.

    Returns ``(labels, supervised, prev_ids)``, each ``[B, N, P]``: index ``j`` is predicted slot
    ``k = j + 1`` (``k = j`` with ``shift_label``). ``labels`` is the token at ``p + k`` (``p + k + 1``),
    ``prev_ids`` the token before it (the anchor for ``j = 0``), which the GRU consumes.

    ``supervised``: without ``shift_label`` the plan's ``loss_mask`` (valid block, ``input_mask`` at the
    label). With ``shift_label`` slot ``k < W-1`` uses ``loss_mask[k + 1]`` (the same label position) and
    the last slot, whose label ``p + W`` lies past the block, is supervised when ``p + W < S``, the
    position continues the anchor's document (``context_position_ids`` keeps counting: a packed
    document boundary restarts them) and ``input_mask[p + W]`` (when ``input_mask [B, S]`` is given).
    """
    B, N, W, S = plan.batch_size, plan.num_blocks, plan.block_size, plan.seq_length
    if not isinstance(input_ids, torch.Tensor) or tuple(input_ids.shape) != (B, S):
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be [batch, seq_length] = {(B, S)}, got {shape}.")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be an integer tensor, got dtype {input_ids.dtype}.")
    if input_mask is not None and tuple(input_mask.shape) != (B, S):
        raise ValueError(f"input_mask must be [batch, seq_length] = {(B, S)}, got {tuple(input_mask.shape)}.")
    device = input_ids.device
    plan = plan.to(device)
    ids = input_ids.long()
    P = W if shift_label else W - 1
    # Predicted index j is slot j + 1 (slot j with shift_label); either way its label is at p + 1 + j
    # and the token before it, which the GRU consumes, at p + j.
    label_pos = plan.anchor_positions[:, :, None] + 1 + torch.arange(P, device=device)
    gather = lambda pos: torch.gather(ids, 1, pos.clamp(0, S - 1).reshape(B, N * P)).view(B, N, P)  # noqa: E731
    labels, prev_ids = gather(label_pos), gather(label_pos - 1)
    # loss_mask[k] is input_mask[p + k] & valid for slots k >= 1: the labels at p + 1 .. p + W - 1.
    supervised = shifted_supervision(plan, input_mask) if shift_label else plan.loss_mask[:, :, 1:]
    return labels, supervised.bool(), prev_ids


# ================================================================================== metrics


@dataclass
class DominoMetrics(EmittedPathMetrics):
    """Additive fp64 statistics of the Domino objective (sum over micro-batches and data parallelism).

    Fields:
        supervised_tokens: supervised predicted slots.
        valid_blocks: counted blocks (valid, first decoded slot supervised).
        correct_tokens / acceptance_sum: the corrected (final) logits' argmax against the labels, with the
            GRU fed the ground truth. Acceptance is counted over the decoded slots (`DominoHead.decode_slots`)
            and includes the bonus token; it equals the greedy decode-time walk's acceptance, because the
            walk feeds the GRU exactly the ground truth until its first miss.
        base_correct_tokens / base_acceptance_sum: the same for the backbone-only logits.
        final_loss_sum / base_loss_sum: weighted CE sums of the two logits; loss_weight_sum their shared
            denominator ``sum(w * mask)``.
    """

    final_loss_sum: torch.Tensor
    base_loss_sum: torch.Tensor
    loss_weight_sum: torch.Tensor

    derived = EmittedPathMetrics.derived + ("final_loss", "base_loss")
    logged = EmittedPathMetrics.logged + (("final loss", "final_loss"), ("base loss", "base_loss"))

    @property
    def final_loss(self) -> torch.Tensor:
        return self.final_loss_sum / self.loss_weight_sum.clamp(min=1e-12)

    @property
    def base_loss(self) -> torch.Tensor:
        return self.base_loss_sum / self.loss_weight_sum.clamp(min=1e-12)


@dataclass
class DominoLossOutput:
    """One micro-batch's contribution to the global-batch Domino objective.

    Attributes:
        loss_sum: differentiable fp32 scalar ``(1 - lambda_base) * final_loss_sum + lambda_base * base_loss_sum``.
        weight_sum: fp32 scalar without grad, ``sum(w * mask)``: the training loss is
            ``sum(loss_sum) / sum(weight_sum)`` over the global batch.
        metrics: `DominoMetrics`.
        lambda_base: the curriculum weight used (a float, for logging).
    """

    loss_sum: torch.Tensor
    weight_sum: torch.Tensor
    metrics: DominoMetrics
    lambda_base: float


# ================================================================================== loss


def _slot_weights(plan: DFlashBatchPlan, P: int, shift_label: bool, decay_gamma, device) -> torch.Tensor:
    """``[B, N, P]`` weights ``exp(-j / decay_gamma)`` for predicted index ``j`` (the first predicted slot
    has weight 1, as in DFlash and the reference), uniform when ``decay_gamma`` is None."""
    if shift_label:
        start = torch.zeros(plan.batch_size, plan.num_blocks, dtype=torch.int64, device=device)
        return decay_weights(plan, decay_gamma=decay_gamma, prefix_lengths=start, device=device)[:, :, :P]
    return decay_weights(plan, decay_gamma=decay_gamma, device=device)[:, :, 1:]


def domino_loss(
    hidden: torch.Tensor,
    plan: DFlashBatchPlan,
    input_ids: torch.Tensor,
    head,
    domino: DominoHead,
    embedding: nn.Module,
    *,
    lambda_base: float = 0.0,
    decay_gamma: Optional[float] = None,
    input_embedding_scale: float = 1.0,
    input_mask: Optional[torch.Tensor] = None,
    loss_mask: Optional[torch.Tensor] = None,
    weights: Optional[torch.Tensor] = None,
    chunk_slots: Optional[int] = 1024,
    fused: Optional[bool] = None,
) -> DominoLossOutput:
    """Domino objective of one micro-batch: ``(1 - lambda_base) * final CE + lambda_base * base CE``.

    Both CEs use the same per-slot weights ``w * mask`` (decay ``exp(-j / decay_gamma)`` from the first
    predicted slot) and share the denominator `weight_sum`, so ``sum(loss_sum) / sum(weight_sum)`` over
    the global batch is the reference's ``(1 - lambda) * final_loss + lambda * base_loss``. The final
    logits are the base logits plus the head's delta on slots ``>= domino.correction_start``, the GRU
    teacher-forced with the block's ground-truth previous tokens (`domino_block_targets`).

    Args:
        hidden: ``[B, N, W, H]`` backbone (body) output.
        plan: the batch plan.
        input_ids: ``[B, S]`` context tokens (labels and the GRU's previous tokens).
        head: the target's output layer (`objectives.OutputHead`, vocab-parallel or not).
        domino: the `DominoHead` (``body.domino_head``); its ``shift_label`` / ``pure_draft_prefix_len``
            decide the layout.
        embedding: the target's input embedding module (the GRU reads its rows of the previous tokens).
        lambda_base: curriculum weight in [0, 1] (`domino_lambda`).
        decay_gamma: slot decay length (None: uniform).
        input_embedding_scale: the draft's ``input_embedding_scale``.
        input_mask: ``[B, S]`` supervised tokens; only read for the last slot under ``shift_label``.
        loss_mask: ``[B, N, P]`` overrides the supervision of the predicted slots (P = W - 1, or W with
            ``shift_label``), e.g. to evaluate a subset.
        weights: ``[B, N, P]`` overrides the per-slot weights.
        chunk_slots: predicted slots per chunk (None: one chunk); peak memory a few ``[chunk_slots, V / TP]``
            fp32 buffers (base and corrected logits, their softmax, the delta).
        fused: as `objectives.dflash_loss.dflash_loss.dflash_loss` (`objectives.head_loss.head_loss`): None uses the fused head loss (gradients w.r.t. the hidden
            states, the features and ``embed_proj.2`` formed in forward in two reused ``[chunk_slots, V / TP]``
            buffers, nothing recomputed) whenever the target's head is frozen; False forces the recomputing
            per-chunk path. A slot is *correct* when its label's logit is its row maximum.

    Returns:
        `DominoLossOutput`.
    """
    _check_domino_loss_inputs(hidden, plan, head, domino, lambda_base, loss_mask, weights, chunk_slots, fused)
    B, N, W = plan.batch_size, plan.num_blocks, plan.block_size
    shift = domino.shift_label
    P = W if shift else W - 1
    device = hidden.device
    plan = plan.to(device)
    labels, supervised, prev_ids = domino_block_targets(
        input_ids.to(device), plan, shift_label=shift, input_mask=input_mask
    )
    if loss_mask is not None:
        supervised = loss_mask.to(device).bool() & plan.block_valid[:, :, None]
    if weights is None:
        weights = _slot_weights(plan, P, shift, decay_gamma, device)
    first = 0 if shift else 1
    targets = SlotTargets.from_mask(labels, supervised, weights, first_slot=first)

    # The GRU's state for each predicted slot (teacher forcing: ground-truth previous tokens).
    states, _ = domino.states(_embed(embedding, prev_ids, input_embedding_scale))  # [B, N, P, G]
    corrected = (torch.arange(P, device=device) + first) >= domino.correction_start  # [P]
    features = domino.features(hidden[:, :, first:, :], states)
    features = features * corrected[:, None].to(features.dtype)  # uncorrected slots: zero delta, no gradient

    lam = float(lambda_base)
    terms = head_loss(
        targets.flat_hidden(hidden), targets.flat_labels, targets.flat_weights, head, chunk_slots=chunk_slots,
        fused=fused, features=features.reshape(B * N * P, -1), shard=domino.shard_weight(head, head.tp_group),
        mix=lam,
    )

    metrics = _domino_metrics(terms, targets, supervised, plan, P)
    return DominoLossOutput(loss_sum=terms.loss_sum, weight_sum=targets.weight_sum, metrics=metrics, lambda_base=lam)


def _check_domino_loss_inputs(hidden, plan, head, domino, lambda_base, loss_mask, weights, chunk_slots, fused) -> None:
    """`domino_loss`'s argument checks (shapes, the head's vocabulary, the curriculum weight, the layout)."""
    check_block_hidden(hidden, plan, domino.hidden_size if isinstance(domino, DominoHead) else None)
    check_loss_options(head, chunk_slots, fused)
    if not isinstance(domino, DominoHead):
        raise ValueError(f"domino must be a DominoHead (body.domino_head), got {type(domino).__name__}.")
    if head.vocab_size != domino.vocab_size:
        raise ValueError(
            f"the head's vocab_size={head.vocab_size} differs from the Domino head's {domino.vocab_size}; "
            "embed_proj's rows are the target's token ids."
        )
    if not (isinstance(lambda_base, (int, float)) and not isinstance(lambda_base, bool) and 0.0 <= lambda_base <= 1.0):
        raise ValueError(f"lambda_base={lambda_base!r} must be in [0, 1] (see domino_lambda).")
    B, N, W = plan.batch_size, plan.num_blocks, plan.block_size
    if domino.correction_start > W - 1:
        raise ValueError(f"the Domino head corrects from slot {domino.correction_start}, past a block of {W}.")
    P = W if domino.shift_label else W - 1
    for name, tensor in (("loss_mask", loss_mask), ("weights", weights)):
        if tensor is not None and tuple(tensor.shape) != (B, N, P):
            raise ValueError(
                f"{name} must have shape [batch, blocks, predicted slots] = {(B, N, P)}, got {tuple(tensor.shape)}."
            )


@torch.no_grad()
def _domino_metrics(terms, targets: SlotTargets, supervised: torch.Tensor, plan: DFlashBatchPlan, P: int) -> "DominoMetrics":
    """The additive metrics of the corrected (final) and backbone-only (base) predictions.

    Args:
        terms: `head_loss`'s output (`final_correct` / `base_correct` flat over ``[B * N * P]``, the loss sums).
        targets: the slot targets (``supervised`` ``[B, N, P]``, `weight_sum`).
        supervised: ``[B, N, P]`` slots with a label (before the slot weights).
        plan: the batch plan (on the loss's device).
        P: predicted slots per block.
    """
    B, N, W = plan.batch_size, plan.num_blocks, plan.block_size
    # Decoding proposes W - 1 tokens: predicted indices 0..W-2 (slots 1..W-1, or 0..W-2 with shift).
    used = slice(0, W - 1)
    sup_used = supervised[:, :, used]
    counted = counted_blocks(sup_used, plan.block_valid)
    f64 = torch.float64
    stats = {}
    for name, hit in (("final", terms.final_correct), ("base", terms.base_correct)):
        correct = hit.view(B, N, P) & targets.supervised
        acceptance = acceptance_lengths(correct[:, :, used], sup_used, plan.block_valid)
        stats[name] = (correct.sum().to(f64), acceptance.sum().to(f64))
    return DominoMetrics(
        supervised_tokens=targets.supervised.sum().to(f64),
        valid_blocks=counted.sum().to(f64),
        correct_tokens=stats["final"][0],
        acceptance_sum=stats["final"][1],
        base_correct_tokens=stats["base"][0],
        base_acceptance_sum=stats["base"][1],
        final_loss_sum=terms.final_sum.detach().to(f64),
        base_loss_sum=terms.base_sum.detach().to(f64),
        loss_weight_sum=targets.weight_sum.to(f64),
    )


# ================================================================================== decoding


@torch.no_grad()
def domino_walk(
    hidden: torch.Tensor,
    base_logits: torch.Tensor,
    anchor_ids: torch.Tensor,
    domino: DominoHead,
    embed: Callable[[torch.Tensor], torch.Tensor],
    *,
    corrected: Optional[torch.Tensor] = None,
    temperature: float = 0.0,
    generator: Optional[torch.Generator] = None,
    forced_tokens: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """Left-to-right walk through one block: pick a token per step, feed it to the GRU for the next.

    Step ``t`` reads the GRU state after ``[anchor, token_1, .., token_t]``: ``logits_t = base_t +
    delta(hidden_t, state)`` where ``corrected[t]``, else ``base_t``; it then takes the argmax (below
    `GREEDY_TEMPERATURE_EPS`) or samples from ``softmax(logits_t / temperature)``.

    Args:
        hidden: ``[B, T, H]`` draft hidden states of the proposing slots (`DominoHead.decode_slots`).
        base_logits: ``[B, T, V]`` the head's logits of ``hidden`` (output transform applied), TP=1.
        anchor_ids: ``[B]`` the last committed token (the block's slot 0).
        domino: the `DominoHead`.
        embed: ``ids [B] -> [B, H]``, the target's input embedding (times ``input_embedding_scale``).
        corrected: ``[T]`` bool, which steps get the delta (default: all).
        temperature, generator: sampling; greedy below `GREEDY_TEMPERATURE_EPS`.
        forced_tokens: ``[B, T]`` feed these to the GRU instead of the picks (teacher forcing; tests and
            evaluation). The returned tokens are still the picks.

    Returns:
        ``(tokens [B, T], probs [B, T, V] or None, logits [B, T, V])``: the picks, the proposal
        distributions (sampling only; what lossless rejection sampling needs) and the corrected fp32 logits.
    """
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0.")
    B, T, _ = hidden.shape
    if tuple(base_logits.shape[:2]) != (B, T):
        raise ValueError(f"base_logits {tuple(base_logits.shape)} must be [B, T, V] for hidden {tuple(hidden.shape)}.")
    if corrected is None:
        corrected = torch.ones(T, dtype=torch.bool)
    corrected = [bool(c) for c in corrected]
    greedy = temperature < GREEDY_TEMPERATURE_EPS
    V = base_logits.shape[-1]
    weight = domino.embed_proj[2].weight
    if weight.shape[0] < V:  # the head is wider than the vocabulary (padding): those columns are -inf anyway
        weight = F.pad(weight, (0, 0, 0, V - weight.shape[0]))
    weight = weight[:V]
    state = None
    previous = anchor_ids
    tokens, probs, logits_out = [], [], []
    for t in range(T):
        step, state = domino.states(embed(previous)[:, None, :], state)  # [B, 1, G]
        logits = base_logits[:, t].float()
        if corrected[t]:
            logits = logits + F.linear(domino.features(hidden[:, t], step[:, 0]).to(weight.dtype), weight).float()
        logits_out.append(logits)
        token, q = draw_token(logits, 0.0 if greedy else temperature, generator)
        if q is not None:
            probs.append(q)
        tokens.append(token)
        previous = token if forced_tokens is None else forced_tokens[:, t]
    return (
        torch.stack(tokens, dim=1),
        torch.stack(probs, dim=1) if probs else None,
        torch.stack(logits_out, dim=1),
    )


@torch.no_grad()
def domino_propose(
    hidden: torch.Tensor,
    anchor_ids: torch.Tensor,
    domino: DominoHead,
    head,
    embedding: nn.Module,
    *,
    input_embedding_scale: float = 1.0,
    temperature: float = 0.0,
    generator: Optional[torch.Generator] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The ``W - 1`` draft tokens of one block per row (decoding, TP=1).

    Args:
        hidden: ``[B, W, H]`` the block's draft hidden states, **all** slots
            (`DFlashBody.forward` with a KV cache): with ``shift_label`` slots ``0..W-2`` propose, otherwise
            ``1..W-1``.
        anchor_ids: ``[B]`` the block's slot-0 token (the last committed one).
        domino: the `DominoHead`.
        head: the target's output layer as an `objectives.OutputHead` (TP=1).
        embedding: the target's input embedding module.
        input_embedding_scale: the draft's ``input_embedding_scale``.
        temperature, generator: greedy below `GREEDY_TEMPERATURE_EPS`, else sampling.

    Returns:
        ``(tokens [B, W-1], draft_probs [B, W-1, V_head] or None)``; ``draft_probs`` (sampling only) is
        the per-step proposal distribution over the head's columns, for `decoding.sampling.rejection_verify`.
    """
    B, W, _ = hidden.shape
    slots = list(domino.decode_slots(W))
    selected = hidden[:, slots[0] : slots[-1] + 1]
    base = head.local_logits(selected)
    corrected = torch.tensor([k >= domino.correction_start for k in slots])
    tokens, probs, _ = domino_walk(
        selected, base, anchor_ids, domino,
        lambda ids: _embed(embedding, ids, input_embedding_scale),
        corrected=corrected, temperature=temperature, generator=generator,
    )
    return tokens, probs
