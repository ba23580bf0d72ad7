"""`DraftKVCache`: each draft layer's keys and values of the committed context, for decoding.

Training runs the draft over a whole sequence at once: every layer projects the context feature of
all `S` positions. Decoding commits a few tokens per cycle, and projecting the whole context again
every cycle would cost `O(S)` per layer and cycle. The cache keeps what each layer's `k_proj` /
`v_proj` (k_norm and RoPE applied) made of the context so far, and
`DFlashBody.forward(new_context, blocks, plan, kv_cache=cache)` projects only the new context,
writes it into the cache and lets the blocks attend over the cache (docs/design.md §3 Block attention).

Entries are indexed by position: entry `t` of a row holds position `t`. A forward writes the new
context at the positions the plan gives (`plan.context_position_ids`), so rows of a batch advance by
different amounts without moving anything, and a block at anchor `a` sees the entries `< a` (the
plan's visibility rule, with sequence indices read as positions). Entries at or past a row's
committed length are scratch: a decoder may write a rectangular slab per cycle (all its verified
slots) and commit only the accepted prefix; the scratch is invisible to every later block and is
overwritten when those positions are committed.

Shapes: B batch (rows still decoding), L capacity (positions held), Hkv the rank-local KV heads,
D head_dim.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

__all__ = ["DraftKVCache"]


class DraftKVCache:
    """Per layer `keys[i]` / `values[i]` `[B, L, Hkv, D]` in the draft's parameter dtype.

    The layout is the one `draft.attention.block_attention` reads context keys in (`[B, S, Hkv, D]`), so a
    forward hands it a slice of the cache without copying. The cache starts at `capacity` positions
    and doubles whenever a forward writes past its end, so its size follows what was generated, not
    what a token budget would allow.

    A forward with the cache goes through three steps, which `DFlashBody.forward` takes in order:
    `prepare(plan)` once (grow, fix where this forward writes and how far its blocks can see), then
    `update(layer, keys, values)` in each layer's attention (write the new context, read the visible
    part).

    Args:
        draft: the `DFlashBody` whose layers the cache serves (its layer count, rank-local KV heads,
            head_dim, parameter device and dtype).
        batch_size: B.
        capacity: positions held at first (grown on demand).
        device, dtype: override the draft's parameter device / dtype.
    """

    def __init__(self, draft: nn.Module, batch_size: int, capacity: int, device=None, dtype=None):
        attention = draft.layers[0].self_attn
        weight = draft.fc.weight
        shape = (batch_size, max(int(capacity), 1), attention.num_kv_heads, attention.head_dim)
        device = device if device is not None else weight.device
        dtype = dtype if dtype is not None else weight.dtype
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in draft.layers]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in draft.layers]
        # Set by `prepare` for the forward in progress.
        self._index: Optional[torch.Tensor] = None  # [B, S, Hkv, D] int64 scatter index of the new context
        self._visible = 0  # entries the blocks of this forward may see, from the start

    @property
    def batch_size(self) -> int:
        return self.keys[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1]

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    def prepare(self, plan) -> None:
        """Get ready for one forward of `plan` (a `DFlashBatchPlan` read with positions as sequence indices).

        The new context row `j` of batch row `b` goes to entry `plan.context_position_ids[b, j]`; the
        blocks see entries below their `plan.anchor_positions`, so every layer reads only the entries
        below the largest anchor. One host sync (both bounds at once).
        """
        positions = plan.context_position_ids  # [B, S]
        B, S = positions.shape
        if B != self.batch_size:
            raise ValueError(f"the plan has {B} rows but the KV cache {self.batch_size}; select_rows first.")
        if S:
            needed, longest = torch.stack([positions.max() + 1, plan.anchor_positions.max()]).tolist()
        else:
            needed, longest = 0, int(plan.anchor_positions.max())
        if needed > self.capacity:
            self.grow(max(needed, 2 * self.capacity))
        Hkv, D = self.keys[0].shape[2:]
        self._index = positions[:, :, None, None].expand(-1, -1, Hkv, D)
        self._visible = min(max(longest, 1), self.capacity)

    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write layer `layer`'s keys/values of the new context (`[B, S, Hkv, D]`, at the positions
        `prepare` was given) and return the layer's visible keys/values `[B, L', Hkv, D]`."""
        if self._index is None:
            raise RuntimeError("DraftKVCache.update before prepare: DFlashBody.forward prepares the cache.")
        cached_keys, cached_values = self.keys[layer], self.values[layer]
        cached_keys.scatter_(1, self._index, keys.to(cached_keys.dtype))
        cached_values.scatter_(1, self._index, values.to(cached_values.dtype))
        return cached_keys[:, : self._visible], cached_values[:, : self._visible]

    def grow(self, capacity: int) -> None:
        """Room for positions `< capacity`; the entries so far are kept."""
        if capacity <= self.capacity:
            return

        def grown(t: torch.Tensor) -> torch.Tensor:
            out = t.new_zeros((t.shape[0], capacity) + tuple(t.shape[2:]))
            out[:, : t.shape[1]] = t
            return out

        self.keys = [grown(k) for k in self.keys]
        self.values = [grown(v) for v in self.values]

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (int64 indices) of the batch, in that order."""
        self.keys = [k.index_select(0, rows) for k in self.keys]
        self.values = [v.index_select(0, rows) for v in self.values]
        self._index = None
