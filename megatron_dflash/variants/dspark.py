"""DSpark: the DFlash backbone plus a low-rank Markov head and a confidence head (arXiv 2607.05147).

docs/design.md §18 DSpark. A DSpark block at anchor ``p`` has ``W = block_size`` slots that all predict:
slot ``k`` (0-based; slot 0 holds the anchor token, the others MASK) predicts ``x_{p+k+1}``. The backbone
drafts every slot at once, blind to the tokens drafted before it in the block; the **Markov head** adds a
logit bias that depends on the previous token of the slot (``x_{p+k}``: the true token in training, the
token drafted for slot ``k - 1`` at decoding):

    logits_k = head(h_k) + W2 @ f_k,   f_k = features(x_{p+k}, h_k [, s_{k-1}])

with ``W1 [V, r]`` an embedding of the previous token and ``W2 [V, r]`` a projection to the vocabulary.
The features ``f_k [r]`` take one of three forms (``markov_head_type``):

* ``vanilla``: ``f_k = W1[x_{p+k}]``;
* ``gated``: ``f_k = sigmoid(gate_proj([h_k | W1[x_{p+k}]])) * W1[x_{p+k}]``;
* ``rnn``: a recurrence over the block, ``[g | c | o] = joint_proj([s_{k-1} | W1[x_{p+k}] | h_k])``,
  ``s_k = sigmoid(g) * s_{k-1} + (1 - sigmoid(g)) * tanh(c)`` (``s_{-1} = 0``), ``f_k = tanh(o)``.

The **confidence head** ``confidence_head.proj``, ``Linear(H (+ r) -> 1)`` with bias, predicts from
``[h_k (| W1[x_{p+k}])]`` whether slot ``k``'s token will be accepted (a logit; decoding may stop a block at
the first slot below ``--dflash-confidence-threshold``).

**Tensor parallelism.** ``markov_w2`` is vocab-parallel with the row partition of the target's output
layer: megatron pads the vocabulary to a multiple of ``128 * TP`` and gives rank ``k`` rows
``[k * V_pad / TP, (k + 1) * V_pad / TP)``; this rank's part of ``W2`` holds the real rows of that range
(the padding rows are not stored: an uneven split, `draft.sharding.mark_uneven_split`), and
`DSparkHeads.markov_w2_rows(head)` returns them padded with zero rows to the head's shard, ready for the loss
kernel (``bias_local = f @ W2_local^T``). ``markov_w1``, ``gate_proj``, ``joint_proj`` and the confidence head
are replicated: the features are ``r`` wide per slot and are needed whole on every rank (the gate, the
recurrence, the confidence head), so a vocab-parallel ``W1`` would cost an all-reduce of the features in every
forward to save ``V * r`` weights; replicated, every rank computes the same features, and their gradient is
made whole by summing the vocab shards' partial gradients over the group (the loss kernel's backward, or
`reduce_grad_over_group` in `markov_logits`), so ``W1`` needs no extra communication.

**Formats.** Our HF export is the layout vLLM (``qwen3_dspark``) and SGLang (``DSPARK``) serve:
``architectures: ["Qwen3DSparkModel"]`` (``["KimiK3DSparkModel"]`` for the Kimi K3 MLA draft), the DSpark
fields ``markov_rank``, ``markov_head_type``, ``enable_confidence_head``, ``confidence_head_with_markov`` and
``block_size``, ``mask_token_id``, ``target_layer_ids``, ``num_target_layers`` at the top level (also in
``dflash_config``), and the tensors ``markov_head.{markov_w1,markov_w2}.weight``,
``markov_head.gate_proj.{weight,bias}`` / ``markov_head.joint_proj.{weight,bias}``,
``confidence_head.proj.{weight,bias}`` next to the backbone's. NeMo AutoModel writes the same layout plus
copies of the target's ``embed_tokens.weight`` / ``lm_head.weight`` (dropped on load: the draft uses the
target's own); SpecForge 0.2.0 writes ``DSparkDraftModel`` with the DSpark fields in ``dflash_config``
(``projector_type: "dspark"``) and the same tensor names. ModelOpt's layout (``markov_w1`` / ``markov_w2`` at
the top level) is refused.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..common.parallel import reduce_grad_over_group
from ..draft.body import DFlashBody
from ..draft.config import DFlashConfig
from ..draft.kimi_k3.body import KimiK3Body
from ..draft.kimi_k3.config import KimiK3DraftConfig
from ..draft.sharding import mark_uneven_split, uneven_split_rows
from ..objectives.dspark_loss import dspark_loss
from ..plan.batch_plan import DFlashBatchPlan
from ..target.megatron.config import padded_vocab_size
from .dflash2 import GREEDY_TEMPERATURE_EPS
from .options import DSPARK_OPTIONS
from .proposals import draw_token

__all__ = [
    "DSPARK_ARCHITECTURE",
    "KIMI_K3_DSPARK_ARCHITECTURE",
    "SPECFORGE_DSPARK_ARCHITECTURE",
    "DSPARK_PROJECTOR_TYPE",
    "DSPARK_SERVING_METHOD",
    "MARKOV_HEAD_TYPES",
    "DSparkFields",
    "DSparkConfig",
    "KimiK3DSparkConfig",
    "is_dspark_hf_config",
    "is_kimi_k3_dspark_hf_config",
    "MarkovHead",
    "ConfidenceHead",
    "DSparkHeads",
    "DSparkBody",
    "KimiK3DSparkBody",
    "dspark_prev_tokens",
    "DSparkWalk",
    "dspark_walk",
    "confident_lengths",
    "read_dspark_tensors",
    "target_copy_mismatch",
    "dspark_variant_loss",
]

DSPARK_ARCHITECTURE = "Qwen3DSparkModel"
KIMI_K3_DSPARK_ARCHITECTURE = "KimiK3DSparkModel"
SPECFORGE_DSPARK_ARCHITECTURE = "DSparkDraftModel"
DSPARK_PROJECTOR_TYPE = "dspark"
# vLLM's `--speculative-config` method for `Qwen3DSparkModel` drafters (checkpoint/serving.py).
DSPARK_SERVING_METHOD = "dspark"
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
# The DSpark fields of config.json (top level in NeMo's / vLLM's layout, `dflash_config` in SpecForge's).
_DSPARK_KEYS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")
# The fields NeMo's classes require and read at the top level besides the DSpark ones.
_TOP_LEVEL_KEYS = ("block_size", "mask_token_id", "target_layer_ids", "num_target_layers")
# NeMo's classes need `num_anchors` to be built; it is a training setting, written as the recipe's value.
_RECIPE_NUM_ANCHORS = 512
# Copies of the target's tensors that NeMo AutoModel saves with its drafter; the draft uses the target's own.
FROZEN_COPIES = ("embed_tokens.weight", "lm_head.weight")


# ================================================================================== config


@dataclass
class DSparkFields:
    """The DSpark fields, shared by the Qwen3-style and the Kimi K3 configs.

    Fields:
        markov_rank: r, the Markov head's width; 0: no Markov head.
        markov_head_type: "vanilla", "gated" or "rnn" (module docstring).
        enable_confidence_head: the draft has the confidence head.
        confidence_head_with_markov: the confidence head also reads ``W1[prev]`` (needs a Markov head); False
            whenever the confidence head is off.
    """

    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True

    def validate_dspark(self) -> None:
        """Raise `ValueError` naming the first inconsistent DSpark field."""
        rank = self.markov_rank
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise ValueError(f"markov_rank={rank!r} must be an integer >= 0 (0: no Markov head).")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(f"markov_head_type={self.markov_head_type!r}: choose one of {list(MARKOV_HEAD_TYPES)}.")
        for name in ("enable_confidence_head", "confidence_head_with_markov"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be true or false.")
        if not self.enable_confidence_head:
            self.confidence_head_with_markov = False  # meaningless without the head, as the published readers do
        if self.confidence_head_with_markov and rank == 0:
            raise ValueError(
                "confidence_head_with_markov=true needs a Markov head (markov_rank > 0); set markov_rank or "
                "turn confidence_head_with_markov off."
            )

    def dspark_hf_fields(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _DSPARK_KEYS}

    @staticmethod
    def read_dspark_fields(data: dict[str, Any]) -> dict[str, Any]:
        """Pop the DSpark fields of a config.json dict (top level, else `dflash_config`) into keyword arguments;
        `confidence_head_alpha > 0` (SpecForge's training weight) turns the confidence head on when no explicit
        `enable_confidence_head` is given."""
        dflash = dict(data.get("dflash_config") or {})
        out: dict[str, Any] = {}
        for name in _DSPARK_KEYS:
            for source in (data, dflash):
                if source.get(name) is not None:
                    out[name] = source[name]
                    break
            data.pop(name, None)
            dflash.pop(name, None)
        alpha = dflash.pop("confidence_head_alpha", data.pop("confidence_head_alpha", None))
        if "enable_confidence_head" not in out:
            out["enable_confidence_head"] = bool(alpha) if alpha is not None else False
        out.setdefault("confidence_head_with_markov", False)
        out.setdefault("markov_rank", 0)
        if "markov_rank" in out:
            out["markov_rank"] = int(out["markov_rank"])
        if "markov_head_type" in out:
            out["markov_head_type"] = str(out["markov_head_type"]).lower()
        for name in ("projector_type", "attention_mode", "num_anchors"):
            dflash.pop(name, None)
        data["dflash_config"] = dflash
        return out


def _dspark_hf_dict(config, out: dict[str, Any]) -> dict[str, Any]:
    """Add the DSpark fields (and the top-level copies NeMo, vLLM and SGLang read) to a written config dict."""
    fields = config.dspark_hf_fields()
    out.update(fields)
    out["dflash_config"].update(fields)
    out["dflash_config"]["projector_type"] = DSPARK_PROJECTOR_TYPE
    for name in _TOP_LEVEL_KEYS:
        value = getattr(config, name)
        out[name] = list(value) if isinstance(value, list) else value
    out.setdefault("num_anchors", _RECIPE_NUM_ANCHORS)
    return out


@dataclass
class DSparkConfig(DFlashConfig, DSparkFields):
    """`DFlashConfig` (the Qwen3-style backbone) plus the DSpark fields (`DSparkFields`).

    ``block_size`` is the number of slots of a block, all predicting (slot ``k`` predicts ``x_{p+k+1}``).
    """

    def validate(self) -> None:
        super().validate()
        self.validate_dspark()

    def to_hf_dict(self, architecture: Optional[str] = None) -> dict[str, Any]:
        """The layout vLLM / SGLang serve: ``architectures: ["Qwen3DSparkModel"]`` and the DSpark fields at the
        top level (module docstring). Always written as DSpark: served as plain DFlash it would drop both heads
        and read every label one slot off."""
        if architecture not in (None, DSPARK_ARCHITECTURE, "DFlashDraftModel"):
            raise ValueError(f"architecture={architecture!r}: a DSpark config is always written as "
                             f"{DSPARK_ARCHITECTURE!r}.")
        return _dspark_hf_dict(self, super().to_hf_dict(DSPARK_ARCHITECTURE))

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any], **overrides: Any) -> "DSparkConfig":
        """Read a DSpark `config.json`: ours, NeMo AutoModel's (``Qwen3DSparkModel``) or SpecForge's
        (``DSparkDraftModel``, fields in ``dflash_config``)."""
        data = dict(data)
        if not is_dspark_hf_config(data):
            raise ValueError(f"config.json has architectures={data.get('architectures')}: not a DSpark draft.")
        values = cls.read_dspark_fields(data)
        data.pop("num_anchors", None)
        values.update(overrides)
        return super().from_hf_dict(data, **values)

    def save_pretrained(self, directory: str, architecture: Optional[str] = None) -> None:
        super().save_pretrained(directory, architecture=architecture)


@dataclass
class KimiK3DSparkConfig(KimiK3DraftConfig, DSparkFields):
    """`KimiK3DraftConfig` (the Kimi K3 MLA backbone, docs/design.md §16) plus the DSpark fields."""

    def validate(self) -> None:
        super().validate()
        self.validate_dspark()

    def to_hf_dict(self, architecture: Optional[str] = None) -> dict[str, Any]:
        """NeMo AutoModel's ``KimiK3DSparkModel`` layout (the K3 draft's fields, the DSpark fields on top)."""
        if architecture not in (None, KIMI_K3_DSPARK_ARCHITECTURE):
            raise ValueError(f"architecture={architecture!r}: a Kimi K3 DSpark config is always written as "
                             f"{KIMI_K3_DSPARK_ARCHITECTURE!r}.")
        return _dspark_hf_dict(self, super().to_hf_dict(KIMI_K3_DSPARK_ARCHITECTURE))

    @classmethod
    def from_hf_dict(cls, data: Mapping[str, Any], **overrides: Any) -> "KimiK3DSparkConfig":
        """Read NeMo AutoModel's (or our) ``KimiK3DSparkModel`` config.json, or a K3 target's text config
        (`from_target_config`; the registry tells files apart by their architecture)."""
        data = dict(data)
        values = cls.read_dspark_fields(data)
        if not data["dflash_config"]:
            data.pop("dflash_config")
        data.pop("num_anchors", None)
        values.update(overrides)
        return super().from_hf_dict(data, **values)

    def save_pretrained(self, directory: str, architecture: Optional[str] = None) -> None:
        super().save_pretrained(directory, architecture=architecture or KIMI_K3_DSPARK_ARCHITECTURE)


def is_dspark_hf_config(data: Mapping[str, Any]) -> bool:
    """Whether a config.json dict is a Qwen3-style DSpark draft (ours, NeMo's, SpecForge's)."""
    architecture = (data.get("architectures") or [None])[0]
    projector = (data.get("dflash_config") or {}).get("projector_type", data.get("projector_type"))
    return architecture in (DSPARK_ARCHITECTURE, SPECFORGE_DSPARK_ARCHITECTURE) or (
        architecture == "DFlashDraftModel" and projector == DSPARK_PROJECTOR_TYPE
    )


def is_kimi_k3_dspark_hf_config(data: Mapping[str, Any]) -> bool:
    """Whether a config.json dict is a Kimi K3 MLA DSpark draft (NeMo's ``KimiK3DSparkModel``, ours)."""
    return (data.get("architectures") or [None])[0] == KIMI_K3_DSPARK_ARCHITECTURE


def read_dspark_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of a DSpark file as the body loads them: NeMo's copies of the target's embedding and LM head
    dropped (`FROZEN_COPIES`; the draft uses the target's own), ModelOpt's layout refused.

    Raises:
        ValueError: the file holds ``markov_w1`` / ``markov_w2`` at the top level (ModelOpt's DSpark export).
    """
    if any(name.split(".")[0] in ("markov_w1", "markov_w2") for name in tensors):
        raise ValueError(
            "this is ModelOpt's DSpark layout (markov_w1 / markov_w2 at the top level), which is not read; "
            "export the drafter as a NeMo AutoModel / SpecForge DSpark checkpoint (markov_head.markov_w1.weight)."
        )
    return {name: t for name, t in tensors.items() if name not in FROZEN_COPIES}


def _local_rows(weight: torch.Tensor, start: int, vocab_size: int) -> tuple[int, torch.Tensor]:
    """``(start, rows)``: the real vocabulary rows of a shard that begins at row `start` (padding dropped)."""
    return start, weight[: max(0, min(weight.shape[0], vocab_size - start))]


def target_copy_mismatch(tensors: Mapping[str, torch.Tensor], embedding: nn.Module, head) -> Optional[str]:
    """None when the copies of the target's input embedding and output layer that NeMo AutoModel saves with its
    drafter (`FROZEN_COPIES`) equal the target's own (this rank's vocabulary rows of them), or are absent; else a
    one-line message naming the first that differs. The draft trains with the target's own tensors, so a drafter
    whose copies differ was trained against another target.

    Args:
        tensors: the drafter file's tensors (before `read_dspark_tensors` drops the copies).
        embedding: the target's input embedding module (``nn.Embedding``, or megatron's vocab-parallel one with
            ``vocab_start_index``); head: its `target.head.OutputHead`.
    """
    V = head.vocab_size
    weight = head.weight if head.weight is not None else head.layer.weight
    ours = {
        "embed_tokens.weight": _local_rows(embedding.weight, int(getattr(embedding, "vocab_start_index", 0)), V),
        "lm_head.weight": _local_rows(weight, head.vocab_range[0], V),
    }
    for name in FROZEN_COPIES:
        copy = tensors.get(name)
        if copy is None:
            continue
        start, rows = ours[name]
        # compared in the narrower of the two dtypes: a copy saved in another precision is still the same tensor
        dtype = min((copy.dtype, rows.dtype), key=lambda d: torch.finfo(d).bits)
        if copy.dim() != 2 or copy.shape[1] != rows.shape[1] or copy.shape[0] != V or not torch.equal(
                copy[start:start + rows.shape[0]].to(device=rows.device, dtype=dtype), rows.detach().to(dtype)):
            return (f"the drafter's {name} {list(copy.shape)} is not the target's own ({name.split('.')[0]} of "
                    f"vocab_size={V}, hidden {rows.shape[1]}): it was trained against another target; load it with "
                    "its own target or drop the tensor from the file")
    return None


# ================================================================================== the heads


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer.")


class MarkovHead(nn.Module):
    """The Markov head: ``markov_w1`` (replicated embedding ``[V, r]``), ``markov_w2`` (vocab-parallel
    ``[V, r]``, this rank's real rows of the target head's partition), and ``gate_proj`` (gated) or
    ``joint_proj`` (rnn). Published names and shapes (module docstring).

    Args:
        vocab_size, hidden_size, markov_rank, head_type: V, H, r and the form.
        tp_size, tp_rank: the TP group's size and this rank (W2's rows).
        init_std: std of the normal init of every weight; biases start at zero.
        dtype: the parameters' dtype.
        generator: the random stream of the init (None: torch's default).

    Every weight is drawn whole (W2 too, then sliced), so the weights of a stream do not depend on the TP size.
    """

    def __init__(self, vocab_size: int, hidden_size: int, markov_rank: int, head_type: str, *, tp_size: int = 1,
                 tp_rank: int = 0, init_std: float = 0.02, dtype: torch.dtype = torch.float32,
                 generator: Optional[torch.Generator] = None):
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("hidden_size", hidden_size), ("markov_rank", markov_rank)):
            _positive(name, value)
        if head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(f"markov_head_type={head_type!r}: choose one of {list(MARKOV_HEAD_TYPES)}.")
        V, H, r = vocab_size, hidden_size, markov_rank
        self.vocab_size, self.hidden_size, self.markov_rank, self.head_type = V, H, r, head_type
        self.w2_chunk = padded_vocab_size(V, tp_size) // tp_size  # rows of the target head's shard
        start, end = uneven_split_rows(V, self.w2_chunk, tp_rank)
        if uneven_split_rows(V, self.w2_chunk, tp_size - 1)[0] >= V:
            raise ValueError(f"vocab_size={V} is too small for TP={tp_size}: the last ranks' vocabulary shards hold "
                             "only padding, so they would hold no row of markov_w2; use a smaller TP size.")
        self.w2_rows = (start, end)
        self.markov_w1 = nn.Embedding(V, r, dtype=dtype)
        self.markov_w2 = nn.Linear(r, end - start, bias=False, dtype=dtype)
        with torch.no_grad():
            self.markov_w1.weight.normal_(0.0, init_std, generator=generator)
            full_w2 = torch.empty(V, r, dtype=dtype).normal_(0.0, init_std, generator=generator)
            self.markov_w2.weight.copy_(full_w2[start:end])
        mark_uneven_split(self.markov_w2.weight, 0, V, self.w2_chunk)
        if head_type == "gated":
            self.gate_proj = self._linear(H + r, r, init_std, dtype, generator)
        elif head_type == "rnn":
            self.joint_proj = self._linear(2 * r + H, 3 * r, init_std, dtype, generator)

    @staticmethod
    def _linear(inputs: int, outputs: int, init_std: float, dtype, generator=None) -> nn.Linear:
        layer = nn.Linear(inputs, outputs, dtype=dtype)
        with torch.no_grad():
            layer.weight.normal_(0.0, init_std, generator=generator)
            layer.bias.zero_()
        return layer

    def prev_embeddings(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """``W1[prev_ids]``: ``[...]`` -> ``[..., r]``."""
        return self.markov_w1(prev_ids.long())

    def step(self, prev_ids: torch.Tensor, hidden: torch.Tensor,
             state: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """One slot: ``prev_ids [...]``, ``hidden [..., H]`` (and the rnn's state ``[..., r]``, None: zero) ->
        ``(features [..., r], next state or None)``. Decoding calls it slot by slot with its own drafted tokens."""
        e = self.prev_embeddings(prev_ids)
        h = hidden.to(e.dtype)
        if self.head_type == "vanilla":
            return e, None
        if self.head_type == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([h, e], dim=-1))) * e, None
        state = torch.zeros_like(e) if state is None else state
        gate, candidate, output = self.joint_proj(torch.cat([state, e, h], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        return torch.tanh(output), gate * state + (1.0 - gate) * torch.tanh(candidate)

    def features(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """Teacher-forced features of every slot: ``hidden [B, N, W, H]``, ``prev_ids [B, N, W]`` (slot ``k``'s
        previous token) -> ``[B, N, W, r]``; the rnn runs its recurrence along ``W`` from a zero state."""
        if self.head_type != "rnn":
            return self.step(prev_ids, hidden)[0]
        out, state = [], None
        for k in range(hidden.shape[-2]):
            f, state = self.step(prev_ids[..., k], hidden[..., k, :], state)
            out.append(f)
        return torch.stack(out, dim=-2)

    def local_rows(self, head) -> torch.Tensor:
        """``[V_local, r]``: the rows of ``W2`` for `head`'s vocabulary shard (``head.vocab_range``), this rank's
        own rows followed by zero rows for the shard's padding (differentiable w.r.t. ``markov_w2.weight``).

        Raises:
            ValueError: `head` splits the vocabulary otherwise than this rank's ``W2`` (another TP size or
                padding rule), or has another vocabulary size.
        """
        start, end = head.vocab_range
        own_start, own_end = self.w2_rows
        if head.vocab_size != self.vocab_size or start != own_start or min(end, self.vocab_size) != own_end:
            raise ValueError(
                f"the target head's vocabulary shard [{start}, {end}) of vocab_size={head.vocab_size} is not this "
                f"rank's markov_w2 rows [{own_start}, {own_end}) of {self.vocab_size}: build the draft and the target "
                "with the same tensor-parallel group (megatron's vocabulary padding to 128 * TP)."
            )
        weight = self.markov_w2.weight
        padding = (end - start) - weight.shape[0]
        # No padding rows (a vocabulary that is a multiple of 128 * TP): the weight itself, not a [V, r] copy.
        return F.pad(weight, (0, 0, 0, padding)) if padding else weight

    def extra_repr(self) -> str:
        return (f"vocab_size={self.vocab_size}, markov_rank={self.markov_rank}, head_type={self.head_type}, "
                f"w2_rows={self.w2_rows}")


class ConfidenceHead(nn.Module):
    """``proj``: ``Linear(H (+ r) -> 1)`` with bias; `forward(features [..., in]) -> [...]` fp32 logits."""

    def __init__(self, input_dim: int, *, init_std: float = 0.02, dtype: torch.dtype = torch.float32,
                 generator: Optional[torch.Generator] = None):
        super().__init__()
        _positive("input_dim", input_dim)
        self.proj = MarkovHead._linear(input_dim, 1, init_std, dtype, generator)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features.to(self.proj.weight.dtype)).squeeze(-1).float()


class DSparkHeads:
    """The DSpark heads on a draft body (`DSparkBody`, `KimiK3DSparkBody`): ``markov_head`` (a `MarkovHead`,
    None when ``markov_rank == 0``) and ``confidence_head`` (a `ConfidenceHead`, None when off). The body's
    forward is its backbone's and returns hidden states; these methods act on them."""

    @staticmethod
    def heads_seed() -> int:
        """The seed of the heads' init, drawn from torch's default stream before the backbone is built: the
        backbone's init consumes that stream differently at each TP size, so drawing after it would not give
        TP-independent heads."""
        return int(torch.randint(0, 2**62, (1,)).item())

    def build_dspark_heads(self, seed: int) -> None:
        """Build ``markov_head`` and ``confidence_head`` from `seed` (`heads_seed`)."""
        config = self.config
        dtype, group = self.fc.weight.dtype, self.tp_group
        generator = torch.Generator().manual_seed(seed)
        self.markov_head = MarkovHead(
            config.vocab_size, config.hidden_size, config.markov_rank, config.markov_head_type,
            tp_size=group.size(), tp_rank=group.rank(), init_std=config.initializer_range, dtype=dtype,
            generator=generator,
        ) if config.markov_rank > 0 else None
        width = config.hidden_size + (config.markov_rank if config.confidence_head_with_markov else 0)
        self.confidence_head = ConfidenceHead(
            width, init_std=config.initializer_range, dtype=dtype, generator=generator,
        ) if config.enable_confidence_head else None

    def markov_features(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> Optional[torch.Tensor]:
        """``[B, N, W, r]`` features of every slot (None without a Markov head); the bias is
        ``markov_w2_rows(head) @ features`` (`MarkovHead.features`)."""
        return None if self.markov_head is None else self.markov_head.features(hidden, prev_ids)

    def markov_w2_rows(self, head) -> Optional[torch.Tensor]:
        """``[V_local, r]``: ``W2``'s rows of `head`'s vocabulary shard (`MarkovHead.local_rows`)."""
        return None if self.markov_head is None else self.markov_head.local_rows(head)

    def confidence_logits(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> Optional[torch.Tensor]:
        """``[B, N, W]`` fp32 logits of "slot k's token is accepted" (None without a confidence head)."""
        if self.confidence_head is None:
            return None
        features = hidden
        if self.config.confidence_head_with_markov:
            e = self.markov_head.prev_embeddings(prev_ids)
            features = torch.cat([hidden.to(e.dtype), e], dim=-1)
        return self.confidence_head(features)

    @torch.no_grad()
    def propose_block(self, hidden: torch.Tensor, anchor_ids: torch.Tensor, head, embedding: nn.Module,
                      temperature: float = 0.0, generator: Optional[torch.Generator] = None, *,
                      confidence_threshold: Optional[float] = None):
        """The ``W`` draft tokens of one block per row (this variant's decode proposer, TP=1; the registry says
        it proposes every slot): `dspark_walk` over slots ``0..W-1`` from the anchor, slot ``k`` proposing the
        token at ``n + k + 1``. `embedding` is not used: the Markov head embeds the previous tokens itself.

        With `confidence_threshold`, a row stops proposing at the first slot whose cumulative confidence (the
        product of ``sigmoid(confidence logit)`` over the slots so far, the chance that the whole prefix is
        accepted) is below it; its tokens past that are padding.

        Returns:
            ``(tokens [B, W], probs [B, W, V] or None (greedy), lengths [B] proposals per row or None (all))``.
        """
        walk = dspark_walk(self, hidden, anchor_ids, head, temperature=temperature, generator=generator)
        if confidence_threshold is None:
            return walk.tokens, walk.probs, None
        self.check_confidence_stop(confidence_threshold)
        return walk.tokens, walk.probs, confident_lengths(walk.confidence, confidence_threshold)

    def check_confidence_stop(self, confidence_threshold: float) -> None:
        """Raise `ValueError` unless blocks can stop at `confidence_threshold` (a confidence head, a value in
        [0, 1])."""
        if self.confidence_head is None:
            raise ValueError("this DSpark draft has no confidence head (enable_confidence_head is false), so it "
                             "cannot stop a block early; leave the confidence threshold off.")
        value = confidence_threshold
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
            raise ValueError(f"confidence_threshold={value!r} must be a number in [0, 1] (None: off).")

    def confidence_proposer(self, confidence_threshold: float):
        """`propose_block` that stops each block at `confidence_threshold` (checked now)."""
        self.check_confidence_stop(confidence_threshold)
        return functools.partial(self.propose_block, confidence_threshold=float(confidence_threshold))

    def markov_logits(self, hidden: torch.Tensor, prev_ids: torch.Tensor, head) -> torch.Tensor:
        """fp32 ``[B, N, W, V_local]``: the head's logits of this rank's vocabulary shard plus the Markov bias
        (teacher-forced with `prev_ids`; the uncorrected logits without a Markov head)."""
        logits = head.local_logits(hidden)
        if self.markov_head is None:
            return logits
        features = reduce_grad_over_group(self.markov_features(hidden, prev_ids), head.tp_group)
        rows = self.markov_w2_rows(head)
        return logits + F.linear(features.to(rows.dtype), rows).float()


def _check_dspark_config(config, expected: type, body: str) -> None:
    if not isinstance(config, expected):
        raise ValueError(f"{body} needs a {expected.__name__}, got {type(config).__name__}; build one with "
                         f"{expected.__name__}(...) or {expected.__name__}.from_pretrained(directory).")


class DSparkBody(DSparkHeads, DFlashBody):
    """`DFlashBody` (the Qwen3-style backbone) with the DSpark heads (`DSparkHeads`). Same constructor and
    `forward` (hidden states ``[B, N, W, H]``, never logits)."""

    def __init__(self, config: DSparkConfig, parallel_config=None, tp_group=None, attention_backend: str = "auto"):
        _check_dspark_config(config, DSparkConfig, "DSparkBody")
        seed = self.heads_seed()
        DFlashBody.__init__(self, config, parallel_config=parallel_config, tp_group=tp_group,
                            attention_backend=attention_backend)
        self.build_dspark_heads(seed)


class KimiK3DSparkBody(DSparkHeads, KimiK3Body):
    """`KimiK3Body` (the Kimi K3 MLA backbone, docs/design.md §16) with the DSpark heads (`DSparkHeads`)."""

    def __init__(self, config: KimiK3DSparkConfig, parallel_config=None, tp_group=None,
                 attention_backend: str = "auto"):
        _check_dspark_config(config, KimiK3DSparkConfig, "KimiK3DSparkBody")
        seed = self.heads_seed()
        KimiK3Body.__init__(self, config, parallel_config=parallel_config, tp_group=tp_group,
                            attention_backend=attention_backend)
        self.build_dspark_heads(seed)


class DSparkWalk(NamedTuple):
    """One block's walk (`dspark_walk`): ``tokens [B, T]``, ``probs [B, T, V]`` (None: greedy), the corrected
    ``logits [B, T, V]`` fp32 and the ``confidence [B, T]`` fp32 logits (None without a confidence head)."""

    tokens: torch.Tensor
    probs: Optional[torch.Tensor]
    logits: torch.Tensor
    confidence: Optional[torch.Tensor]


def dspark_walk(body, hidden: torch.Tensor, anchor_ids: torch.Tensor, head, *, temperature: float = 0.0,
                generator: Optional[torch.Generator] = None, forced_tokens: Optional[torch.Tensor] = None
                ) -> DSparkWalk:
    """Left-to-right walk through one block at decoding: slot ``k``'s logits are the head's plus the Markov bias
    of the token picked for slot ``k - 1`` (the anchor for slot 0; the rnn state carried along), then its
    argmax (below `GREEDY_TEMPERATURE_EPS`) or a sample of ``softmax(logits / temperature)``; its confidence
    logit reads the same previous token.

    Args:
        body: a DSpark body (`DSparkHeads`); hidden: ``[B, T, H]`` the proposing slots' hidden states;
        anchor_ids: ``[B]`` the last committed token; head: the target's `OutputHead` (TP=1).
        forced_tokens: ``[B, T]`` feed these as the previous tokens instead of the picks (teacher forcing, for
            tests); the returned tokens are still the picks.

    Returns:
        a `DSparkWalk`.
    """
    if head.tp_group.size() != 1:
        raise ValueError("DSpark decoding runs at TP=1 (the walk picks over the whole vocabulary); gather the "
                         "draft onto one rank (load its HF export) to decode.")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0.")
    greedy = temperature < GREEDY_TEMPERATURE_EPS
    rows = body.markov_w2_rows(head)
    previous, state = anchor_ids, None
    tokens, probs, logits_out, confidence = [], [], [], []
    for k in range(hidden.shape[1]):
        logits = head.local_logits(hidden[:, k])
        if body.markov_head is not None:
            features, state = body.markov_head.step(previous, hidden[:, k], state)
            logits = logits + F.linear(features.to(rows.dtype), rows).float()
        if body.confidence_head is not None:
            confidence.append(body.confidence_logits(hidden[:, k], previous))
        logits_out.append(logits)
        token, q = draw_token(logits, 0.0 if greedy else temperature, generator)
        if q is not None:
            probs.append(q)
        tokens.append(token)
        previous = token if forced_tokens is None else forced_tokens[:, k]
    return DSparkWalk(torch.stack(tokens, dim=1), torch.stack(probs, dim=1) if probs else None,
                      torch.stack(logits_out, dim=1), torch.stack(confidence, dim=1) if confidence else None)


def confident_lengths(confidence: torch.Tensor, threshold: float) -> torch.Tensor:
    """``[B]`` slots proposed per row: those before the first slot whose cumulative confidence
    ``prod_{j <= k} sigmoid(confidence[:, j])`` (``confidence [B, T]`` logits) is below `threshold`. The product
    never grows, so it is the count of slots at or above the threshold."""
    survival = torch.sigmoid(confidence.float()).cumprod(dim=1)
    return (survival >= threshold).sum(dim=1)


# ================================================================================== the objective


def dspark_prev_tokens(input_ids: torch.Tensor, plan: DFlashBatchPlan) -> torch.Tensor:
    """``[B, N, W]``: slot ``k``'s previous token in training, the true ``x_{p+k}`` (the anchor for slot 0);
    positions past the sequence are clamped to its last token (those slots are never supervised)."""
    B, N, W, S = plan.batch_size, plan.num_blocks, plan.block_size, plan.seq_length
    positions = plan.anchor_positions.to(input_ids.device)[:, :, None] + torch.arange(W, device=input_ids.device)
    return torch.gather(input_ids.long(), 1, positions.clamp(max=S - 1).reshape(B, N * W)).view(B, N, W)


def dspark_variant_loss(body, hidden, plan, input_ids, head, *, decay_gamma, chunk_slots, prefix_lengths=None,
                        final_hidden=None, options=None, input_mask=None, weighting=None, **ctx):
    """The DSpark loss of one micro-batch (the registry's adapter wraps it into a `VariantLoss`): the body's
    features, ``W2``'s local rows and confidence logits into `objectives.dspark_loss.dspark_loss`, returning its
    `DSparkLossOutput`. ``input_mask [B, S]`` (the batch's loss mask) decides whether the last slot's label,
    past the block, is supervised; ``weighting`` is the run's `LossWeighting` (D-PACE or the decay). The kernel
    sums the gradients of the replicated hidden states and features over the TP group (each vocabulary shard
    contributes its part), so nothing here reduces them again."""
    if prefix_lengths is not None:
        raise ValueError("DSpark does not train with variable prefixes.")
    if final_hidden is None:
        raise ValueError("DSpark distils to the target: its loss needs the target's final hidden state.")
    options = options or DSPARK_OPTIONS.options_cls()
    prev_ids = dspark_prev_tokens(input_ids, plan)
    features = body.markov_features(hidden, prev_ids)
    out = dspark_loss(
        hidden, plan, input_ids, head, teacher_hidden=final_hidden, markov_features=features,
        markov_w2=body.markov_w2_rows(head), confidence_logits=body.confidence_logits(hidden, prev_ids),
        ce_weight=float(options.ce_loss_weight), l1_weight=float(options.l1_loss_weight),
        bce_weight=float(options.bce_loss_weight), decay_gamma=decay_gamma, chunk_slots=chunk_slots,
        input_mask=input_mask, weighting=weighting,
    )
    return out
