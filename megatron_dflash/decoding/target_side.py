"""The target's side of speculative decoding: prefill, verify a block, commit the accepted slots.

`decoding.generate.spec_generate` runs one verifier per call, chosen by the target's family
(`target.families.target_keeps_kv_cache`, docs/design.md §17 Target families), never by its class
(`target_side`):

* `CachedTarget` keeps a HF KV cache and rolls it back (Qwen3, Llama, ... and any transformers causal LM
  no family registers). The cache stays rectangular: rejected slots become masked holes, cropped or
  compacted away (`_compact_target_cache`);
* `RecomputedTarget` serves targets whose model code keeps no cache (Kimi K3 on NeMo AutoModel's code) or
  whose recurrent layers cannot drop rejected tokens (Qwen3.5's linear attention): each verify forward
  recomputes the target over the committed tokens plus the block, which costs quadratically in the
  generated length, and the block's taps come from that forward.

Both answer `prefill(prompts, lengths)`, `verify(block, committed)`, `commit(accepted)`,
`select_rows(index)` and `close()`.

Shapes: B batch (rows still decoding), W verify block size (the widest: the anchor and every proposal),
H hidden, V vocabulary, L cache length, S longest prompt, Hkv KV heads, D head_dim.
"""

from __future__ import annotations

import inspect
from typing import Optional, Union

import torch
from torch import nn

from ..target.families import resolve_text_config, target_keeps_kv_cache
from ..target.taps import HFTarget, taps_from_hidden_states

__all__ = ["CachedTarget", "RecomputedTarget", "target_side", "device_of"]


def target_side(target: nn.Module, target_layer_ids, pad_id: int, block_size: int
                ) -> Union["CachedTarget", "RecomputedTarget"]:
    """The verifier of `target`: `CachedTarget` when its family keeps a KV cache, else `RecomputedTarget`."""
    kind = CachedTarget if target_keeps_kv_cache(target.config) else RecomputedTarget
    return kind(target, target_layer_ids, pad_id, block_size)


def device_of(module: nn.Module) -> torch.device:
    """The device of a module (HF models say it; others: their first parameter's)."""
    device = getattr(module, "device", None)
    if isinstance(device, torch.device):
        return device
    return next(module.parameters()).device


def _cache_argument(target: nn.Module) -> str:
    """transformers >= 5 calls the cache argument `cache`, older versions `past_key_values`."""
    params = inspect.signature(target.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _make_target_cache(target: nn.Module):
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=target.config)
    except TypeError:  # older transformers: no config argument
        cache = DynamicCache()
    layers = getattr(cache, "layers", None) or []
    if any(getattr(layer, "is_sliding", False) for layer in layers) or _target_has_sliding_window(
            resolve_text_config(target.config)):
        raise ValueError(
            "spec_generate does not support targets with sliding-window layers (layer_types other than "
            "full_attention and linear_attention): it keeps the target's KV cache rectangular, rejected slots "
            "as masked holes, which would shrink a window counted in cache slots. Use a target whose layers are "
            "full attention (or linear attention: such targets are recomputed every cycle)."
        )
    return cache


def _target_has_sliding_window(config) -> bool:
    layer_types = getattr(config, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        return True
    if getattr(config, "sliding_window", None) is None:
        return False
    # Qwen-style configs switch the window on with `use_sliding_window`; Mistral-style ones use
    # it whenever it is set.
    return bool(getattr(config, "use_sliding_window", True))


def _cache_layers_with_tensors(cache) -> Optional[list]:
    """The cache's layers if each exposes `keys`/`values` `[B, Hkv, L, D]` tensors, else None."""
    layers = getattr(cache, "layers", None)
    if not layers:
        return None
    for layer in layers:
        if not isinstance(getattr(layer, "keys", None), torch.Tensor) or not isinstance(
            getattr(layer, "values", None), torch.Tensor
        ):
            return None
    return list(layers)


def _compact_target_cache(cache, valid: torch.Tensor) -> Optional[torch.Tensor]:
    """Move each row's valid slots to the front and drop the rest; returns the new `valid`.

    The order of committed slots does not matter to attention (positions live in the RoPE'd
    keys), only that they all precede the slots a forward appends. None if the cache layout is
    unknown (then nothing changes).
    """
    layers = _cache_layers_with_tensors(cache)
    if layers is None:
        return None
    counts = valid.sum(dim=1)
    keep = int(counts.max())
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices[:, :keep]  # [B, keep]
    for layer in layers:
        index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
        layer.keys = layer.keys.gather(2, index)
        layer.values = layer.values.gather(2, index.expand(-1, layer.values.shape[1], -1, layer.values.shape[-1]))
    return torch.arange(keep, device=valid.device)[None, :] < counts[:, None]


class CachedTarget:
    """The target with a HF KV cache (Qwen3, Llama, ...): a verify forward runs over the block's
    slots only (at most `W`, `block_size`: the widest verify block), attending to the cache.

    The cache stays rectangular: every verify appends the block's slots to every row, rejected slots become
    holes that a 2-D attention mask (`valid [B, L]`) hides, and every row gets explicit position
    ids. Tail holes common to all rows are cropped each cycle; the cache is compacted when holes
    dominate. Prompts are left-padded, so each row's last prompt token is the last column.
    """

    def __init__(self, target: nn.Module, target_layer_ids, pad_id: int, block_size: int):
        self.target = target
        self.target_layer_ids = list(target_layer_ids)
        self.pad_id = pad_id
        self.W = block_size
        self.width = block_size  # slots of the block verified last (a block may be narrower than W)
        self.cache_arg = _cache_argument(target)
        self.cache = _make_target_cache(target)
        self.valid: Optional[torch.Tensor] = None  # [B, L] which cache slots hold committed tokens

    def _taps(self, hidden_states) -> torch.Tensor:
        return taps_from_hidden_states(hidden_states, self.target_layer_ids)

    def prefill(self, prompts: list, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(logits [B, V] fp32 after each row's last prompt token, taps [B, S, taps*H] at index = position)`;
        a short row's entries past its length are scratch."""
        device = lengths.device
        B, S = len(prompts), int(lengths.max())
        offsets = S - lengths  # [B] left padding per row
        ids = torch.full((B, S), self.pad_id, dtype=torch.int64)
        for b, prompt in enumerate(prompts):
            ids[b, S - len(prompt) :] = torch.tensor(prompt, dtype=torch.int64)
        ids = ids.to(device)
        columns = torch.arange(S, device=device)[None, :]
        self.valid = columns >= offsets[:, None]
        positions = (columns - offsets[:, None]).clamp_min(0)
        out = self.target(
            input_ids=ids,
            attention_mask=self.valid.to(torch.int64),
            position_ids=positions,
            use_cache=True,
            output_hidden_states=True,
            logits_to_keep=1,
            **{self.cache_arg: self.cache},
        )
        taps = self._taps(out.hidden_states)  # [B, S, taps*H]
        # Position t of row b sits in column t + offset (the left padding undone; the clamped tail of
        # a short row is scratch past its committed length).
        gather = (columns + offsets[:, None]).clamp(max=S - 1)
        return out.logits[:, -1].float(), taps.gather(1, gather[:, :, None].expand(-1, -1, taps.shape[-1]))

    def verify(self, block: torch.Tensor, committed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(logits [B, W, V] fp32, taps [B, W, taps*H])` of `block [B, W]` at positions `committed + j`."""
        B, W = block.shape
        self.width = W
        attn_mask = torch.cat([self.valid, torch.ones(B, W, dtype=torch.bool, device=block.device)], dim=1)
        out = self.target(
            input_ids=block,
            attention_mask=attn_mask.to(torch.int64),
            position_ids=committed[:, None] + torch.arange(W, device=block.device),
            use_cache=True,
            output_hidden_states=True,
            **{self.cache_arg: self.cache},
        )
        return out.logits.float(), self._taps(out.hidden_states)

    def commit(self, accepted: torch.Tensor) -> None:
        """Slots `0..accepted` of the last verified block stay; the rest become holes."""
        new_slots = torch.arange(self.width, device=accepted.device)[None, :] <= accepted[:, None]  # [B, width]
        valid = torch.cat([self.valid, new_slots], dim=1)
        # Keep the cache small: crop common tail holes, compact when holes dominate.
        used = valid.any(dim=0).nonzero()
        new_length = int(used.max()) + 1 if used.numel() else 0
        if new_length < valid.shape[1]:
            self.cache.crop(new_length - valid.shape[1])
            valid = valid[:, :new_length]
        # Compaction copies the whole cache, so only when holes are a good part of it; every
        # later forward then attends over fewer slots.
        longest = int(valid.sum(dim=1).max())
        if valid.shape[1] - longest > max(longest // 2, 2 * self.W):
            compacted = _compact_target_cache(self.cache, valid)
            if compacted is not None:
                valid = compacted
        self.valid = valid

    def select_rows(self, index: torch.Tensor) -> None:
        self.cache.batch_select_indices(index)
        self.valid = self.valid[index]

    def close(self) -> None:
        """Nothing to release: the cache is this call's own."""


class RecomputedTarget:
    """A target without a usable KV cache (`target.families.target_keeps_kv_cache` is False: Kimi K3 on NeMo
    AutoModel's model code, targets with linear-attention layers): every verify forward runs the
    target over each row's committed tokens plus the block, from the first token.

    Why: losslessness needs the target's logits for the block given exactly the committed tokens,
    and a target whose model code keeps no cache, or whose recurrent state cannot drop rejected
    tokens, can only give them by recomputing. Cost: a cycle processes all `L` committed tokens
    instead of `W`, so the target's work over a generation grows quadratically with its length
    (and attention inside each forward with `L^2`), where the cached path's grows linearly. Use it
    to measure acceptance and check losslessness, not to serve.

    Rows are right-padded, so no attention mask and no position ids are needed: a causal target's
    real tokens never see the padding after them, and each row's tokens sit at their positions.
    `tokens [B, L]` is indexed by position like the draft's cache: a verify writes the block at
    `committed + j`; slots past a row's committed length are scratch, overwritten when committed.
    The taps come from `HFTarget` (the forward hooks training reads them with; it freezes the model,
    as `spec_generate` expects of a target), the logits from the target's LM head
    (`get_output_embeddings()`) at the block's positions only.
    """

    def __init__(self, target: nn.Module, target_layer_ids, pad_id: int, block_size: int):
        self.tapped = HFTarget(target, target_layer_ids)
        self.pad_id = pad_id
        self.W = block_size
        self.tokens: Optional[torch.Tensor] = None  # [B, L] token at each position (scratch past committed)

    def _logits(self, final_hidden: torch.Tensor) -> torch.Tensor:
        return self.tapped.output_head.local_logits(final_hidden)

    def prefill(self, prompts: list, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """See `CachedTarget.prefill`."""
        device = lengths.device
        B, S = len(prompts), int(lengths.max())
        tokens = torch.full((B, S), self.pad_id, dtype=torch.int64)
        for b, prompt in enumerate(prompts):
            tokens[b, : len(prompt)] = torch.tensor(prompt, dtype=torch.int64)
        self.tokens = tokens.to(device)
        out = self.tapped(self.tokens)
        last = out.final_hidden[torch.arange(B, device=device), lengths - 1]  # [B, H]
        return self._logits(last), out.taps

    def verify(self, block: torch.Tensor, committed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """See `CachedTarget.verify`."""
        B, W = block.shape
        end = int(committed.max()) + W
        if end > self.tokens.shape[1]:  # grow by doubling, as the draft's cache does
            grown = self.tokens.new_full((B, max(end, 2 * self.tokens.shape[1])), self.pad_id)
            grown[:, : self.tokens.shape[1]] = self.tokens
            self.tokens = grown
        index = committed[:, None] + torch.arange(W, device=block.device)  # [B, W] positions of the block
        self.tokens.scatter_(1, index, block)
        out = self.tapped(self.tokens[:, :end])
        final = out.final_hidden.gather(1, index[:, :, None].expand(-1, -1, out.final_hidden.shape[-1]))
        taps = out.taps.gather(1, index[:, :, None].expand(-1, -1, out.taps.shape[-1]))
        return self._logits(final), taps

    def commit(self, accepted: torch.Tensor) -> None:
        """Nothing to do: the accepted slots already sit at their positions, the rest is scratch."""

    def select_rows(self, index: torch.Tensor) -> None:
        self.tokens = self.tokens[index]

    def close(self) -> None:
        """Detach the tap hooks from the caller's model."""
        self.tapped.remove_hooks()
