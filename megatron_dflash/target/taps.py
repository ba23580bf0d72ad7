"""The frozen target's taps and the single-process HF target (docs/design.md §2 Conventions, §9 The training step).

The tap of target layer ``i`` (0-based) is the **output of decoder layer i**, i.e. HF
``hidden_states[i + 1]`` (docs/design.md §2 Conventions). It is captured here, in exactly one way: a forward
hook on decoder layer ``i`` that keeps that layer's output (`FrozenTarget`, the base of both targets). Nothing
else in the package adds or subtracts the offset; `hf_hidden_state_index` states it for code that reads HF
``output_hidden_states`` (decoding).

* `HFTarget` wraps a causal LM in a single process (transformers' Qwen3, Qwen3-MoE, Qwen3.5, Qwen3-VL, Llama;
  NeMo AutoModel's Kimi K3, see `kimi_k3`; `families` says how each is loaded):
  ``forward(input_ids [B, S]) -> TargetOutput(taps [B, S, taps * H], final_hidden [B, S, H], logits)``,
  taps concatenated in ``target_layer_ids`` order.
* `target.megatron.model.MegatronTarget` (one pipeline stage of a megatron-core ``GPTModel``) captures the taps
  of the layers its stage owns, keyed by global layer id; `concat_taps` turns a complete set into the
  ``[B, S, taps * H]`` context input of the body.

Both are frozen: parameters never require gradients, the module stays in eval mode whatever its parent
does, and forwards run under ``torch.no_grad()`` (not inference mode: the taps feed the draft's autograd
graph). Both expose ``embedding`` (the target's input embedding module) and ``output_head`` (an
`target.head.OutputHead` over the target's output layer, with the draft's output multiplier and soft cap).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch
from torch import nn

from ..draft.config import DFlashConfig, check_target_layer_ids
from .families import resolve_text_config
from .head import OutputHead

__all__ = [
    "TargetOutput",
    "FrozenTarget",
    "HFTarget",
    "hf_hidden_state_index",
    "taps_from_hidden_states",
    "concat_taps",
]

# --------------------------------------------------------------------------------------------------
# Tap conventions
# --------------------------------------------------------------------------------------------------


def hf_hidden_state_index(layer_id: int) -> int:
    """Index into HF ``output_hidden_states`` of the tap of decoder layer ``layer_id``: ``layer_id + 1``.

    ``hidden_states[0]`` is the embedding output and ``hidden_states[-1]`` the final-norm output, so the
    output of layer ``i < N - 1`` is ``hidden_states[i + 1]``. (The last layer is never tapped.)
    """
    return int(layer_id) + 1


def taps_from_hidden_states(hidden_states: Sequence[torch.Tensor], target_layer_ids: Sequence[int]) -> torch.Tensor:
    """``[B, S, taps * H]`` from HF ``output_hidden_states`` (the reference the hooks must equal)."""
    return torch.cat([hidden_states[hf_hidden_state_index(i)] for i in target_layer_ids], dim=-1)


def concat_taps(taps: Mapping[int, torch.Tensor], target_layer_ids: Sequence[int]) -> torch.Tensor:
    """``[B, S, taps * H]``: the per-layer taps of `MegatronTarget` concatenated in ``target_layer_ids`` order.

    Raises:
        ValueError: if a tapped layer is missing (under pipeline parallelism, route the taps of the other
            stages here first).
    """
    missing = [i for i in target_layer_ids if i not in taps]
    if missing:
        raise ValueError(
            f"concat_taps: taps of target layers {missing} are missing (have {sorted(taps)}); under pipeline "
            "parallelism they live on the stage that owns the layer and must be sent to the draft's stage."
        )
    return torch.cat([taps[i] for i in target_layer_ids], dim=-1)


def _layer_output(output: Any) -> torch.Tensor:
    """The hidden states a decoder layer returned (HF: tensor or tuple; megatron: ``(hidden, context)``)."""
    return output[0] if isinstance(output, (tuple, list)) else output


def _decoder_layers(decoder: Any) -> Optional[list]:
    """The decoder layers in order: a ``ModuleList``, or a ``ModuleDict`` keyed ``"0".."N-1"`` (Kimi K3)."""
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return list(layers)
    if isinstance(layers, nn.ModuleDict) and set(layers.keys()) == {str(i) for i in range(len(layers))}:
        return [layers[str(i)] for i in range(len(layers))]
    return None


def _is_transformers_model(module: Any) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(module, PreTrainedModel)


@dataclass
class TargetOutput:
    """What a single-process target gives the draft.

    Attributes:
        taps: ``[B, S, taps * H]``, the outputs of the tapped layers concatenated in ``target_layer_ids``
            order (layer ``i`` = HF ``hidden_states[i + 1]``).
        final_hidden: ``[B, S, H]``, after the final norm: what the LM head reads (for distillation).
        logits: ``[B, S, V]`` fp32 from `output_head` (multiplier and soft cap applied), only when asked.
    """

    taps: torch.Tensor
    final_hidden: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None


class _TapsCaptured(Exception):
    """Raised by the hook of the last tapped layer to end a forward whose later layers nobody reads."""


class FrozenTarget(nn.Module):
    """Shared freezing: no parameter requires grad, eval mode always, hooks store only while capturing.

    Subclasses run their model through `_capture`. A forward that needs only the taps
    (``need_final_hidden=False``) stops after the last tapped layer: that layer's hook raises `_TapsCaptured`
    once the tap is stored, so the layers after it and the final norm never run. The tapped layer is never
    the last one (`check_target_layer_ids`), so this always saves at least one decoder layer.
    """

    _captured: Optional[dict] = None
    _stop_after: Optional[int] = None

    def _freeze(self, model: nn.Module) -> None:
        model.requires_grad_(False)
        model.eval()

    def train(self, mode: bool = True):  # noqa: D102 - the target never trains (no dropout, ever)
        super().train(False)
        return self

    def _full_sequence(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[S, B, H]`` from this rank's sequence shard under sequence parallelism (identity otherwise)."""
        return hidden

    def _hook(self, layer_id: int, transpose: bool):
        def hook(module, args, output):
            if self._captured is None:
                return
            hidden = self._full_sequence(_layer_output(output).detach())
            if transpose:  # megatron [S, B, H] -> [B, S, H]
                hidden = hidden.transpose(0, 1)
            # Always a (contiguous) copy, also where the transpose is a no-op (B = 1): nothing the model
            # does after this layer (megatron adds residuals in place in eval mode) may change the tap.
            self._captured[layer_id] = hidden.clone(memory_format=torch.contiguous_format)
            if layer_id == self._stop_after:
                raise _TapsCaptured

        return hook

    def _capture(self, run, stop_after: Optional[int]) -> tuple[dict, Any]:
        """Run ``run()`` with the tap hooks armed; returns (layer id -> tap, its output). With ``stop_after``
        a layer id, the forward ends at that layer's hook and the output is None."""
        captured = self._captured = {}
        self._stop_after = stop_after
        try:
            return captured, run()
        except _TapsCaptured:
            return captured, None
        finally:
            self._captured = None
            self._stop_after = None


# --------------------------------------------------------------------------------------------------
# HF target (single process)
# --------------------------------------------------------------------------------------------------


class HFTarget(FrozenTarget):
    """A frozen causal LM (Qwen3, Llama, multimodal wrappers' text decoder, Kimi K3) that returns DFlash taps.

    Args:
        model: a causal LM whose decoder (``model.get_decoder()``, else ``model.model``) has ``.layers`` (a
            ``ModuleList``, or a ``ModuleDict`` keyed by layer index) and returns the final-norm hidden states
            (``.last_hidden_state`` or a tensor); sizes are read from its text config (`resolve_text_config`).
        target_layer_ids: 0-based decoder layers to tap; the last layer and duplicates are refused.
        output_multiplier, final_logit_softcapping: the output transform of `output_head` (the draft's
            ``dflash_config``); see `from_config`.
    """

    def __init__(
        self,
        model: nn.Module,
        target_layer_ids: Sequence[int],
        *,
        output_multiplier: float = 1.0,
        final_logit_softcapping: Optional[float] = None,
    ):
        super().__init__()
        self._freeze(model)
        self.model = model
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
        layers = _decoder_layers(decoder)
        if layers is None:
            raise ValueError(
                f"HFTarget: {type(model).__name__} has no decoder layer list (expected model.get_decoder().layers or "
                "model.model.layers, as in Qwen3/Llama/Kimi K3 causal LMs)."
            )
        self._decoder = decoder
        # transformers decoders take (and must be told) use_cache / return_dict; other decoders (NeMo AutoModel's
        # Kimi K3) take neither and return the final hidden states as a tensor.
        self._decoder_kwargs = {"use_cache": False, "return_dict": True} if _is_transformers_model(decoder) else {}
        self.num_layers = len(layers)
        ids = list(target_layer_ids)
        check_target_layer_ids(ids, self.num_layers)
        self.target_layer_ids = ids
        self._handles = [layers[i].register_forward_hook(self._hook(i, transpose=False)) for i in self.target_layer_ids]
        lm_head = model.get_output_embeddings()
        self.output_head = OutputHead(
            layer=lm_head,
            vocab_size=lm_head.out_features,
            output_multiplier=output_multiplier,
            final_logit_softcapping=final_logit_softcapping,
        )

    @classmethod
    def from_config(cls, model: nn.Module, config: DFlashConfig) -> "HFTarget":
        """The target of the draft ``config``: its tapped layers and output transform; sizes must agree."""
        hf = resolve_text_config(model.config)  # the text decoder's config of a multimodal wrapper
        mismatches = []
        num_layers = getattr(hf, "num_hidden_layers", None)
        if num_layers != config.num_target_layers:
            mismatches.append(f"num_target_layers={config.num_target_layers} but the target has {num_layers} layers")
        if getattr(hf, "hidden_size", None) != config.hidden_size:
            mismatches.append(f"hidden_size={config.hidden_size} but the target's is {getattr(hf, 'hidden_size', None)}")
        if getattr(hf, "vocab_size", None) != config.vocab_size:
            mismatches.append(f"vocab_size={config.vocab_size} but the target's is {getattr(hf, 'vocab_size', None)}")
        if mismatches:
            raise ValueError("HFTarget.from_config: the draft config does not match the target: " + "; ".join(mismatches) + ".")
        return cls(
            model,
            config.target_layer_ids,
            output_multiplier=config.output_multiplier,
            final_logit_softcapping=config.final_logit_softcapping,
        )

    @property
    def embedding(self) -> nn.Module:
        """The target's input embedding module (``model.get_input_embeddings()``)."""
        return self.model.get_input_embeddings()

    def remove_hooks(self) -> None:
        """Take the tap hooks off the model's layers (for a caller that borrowed the model); this
        `HFTarget` is not to be called afterwards."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        *,
        return_logits: bool = False,
        need_final_hidden: bool = True,
    ) -> TargetOutput:
        """Run the target on ``input_ids [B, S]``; ``attention_mask``/``position_ids`` go to HF unchanged.

        ``need_final_hidden=False``: the forward stops after the last tapped layer (``final_hidden`` is None),
        what training needs when no loss reads the target's own prediction.
        """
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise ValueError(f"HFTarget: input_ids must be a [batch, seq_length] tensor, got {shape}.")
        if return_logits and not need_final_hidden:
            raise ValueError("HFTarget: return_logits=True needs the final hidden states (need_final_hidden=True).")
        captured, out = self._capture(
            lambda: self._decoder(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **self._decoder_kwargs
            ),
            stop_after=None if need_final_hidden else max(self.target_layer_ids),
        )
        taps = torch.cat([captured[i] for i in self.target_layer_ids], dim=-1)
        if out is None:
            return TargetOutput(taps=taps)
        final_hidden = out if isinstance(out, torch.Tensor) else out.last_hidden_state
        logits = self.output_head.local_logits(final_hidden) if return_logits else None
        return TargetOutput(taps=taps, final_hidden=final_hidden, logits=logits)
