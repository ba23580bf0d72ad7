"""The draft's decode path as it was before the draft forward took a KV cache: an oracle for decoding.

`decoding.generate.spec_generate` used to run the draft through a copy of the decoder layer written for
decoding (`draft_block_hidden` with its own linear, MLP, attention and in-block-convolution
helpers, and a `DraftKVCache` that projected the context itself). Decoding now calls the same
`DFlashBody.forward` as training, with a KV cache. This module keeps the old copy, verbatim, so the
tests can check that decoding is bit for bit what it was:

* `draft_block_hidden` / `DraftKVCache`: the old per-step draft path;
* `_decode`: the old decoding loop around it (the verify, sampling and target-cache helpers it
  calls are the product's, unchanged); `reference_decode()` makes `spec_generate` run it.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from megatron_dflash.decoding import generate
from megatron_dflash.draft.attention import BlockVisibility, block_attention
from megatron_dflash.draft.body import DFlashBody
from megatron_dflash.decoding.generate import _propose, _Rows
from megatron_dflash.decoding.sampling import greedy_verify, rejection_verify, sample, sampling_probs
from megatron_dflash.decoding.target_side import _cache_argument, _compact_target_cache, _make_target_cache
from megatron_dflash.objectives.dflash_loss import OutputHead
from megatron_dflash.draft.rope import apply_rope, rope_cos_sin, rope_inv_freq
from megatron_dflash.target.taps import taps_from_hidden_states


def _rope(config, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin `[*positions.shape, D]` of the draft's RoPE (same as `DFlashBody.rope`)."""
    inv_freq, scale = rope_inv_freq(
        config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings, positions.device
    )
    return rope_cos_sin(positions, inv_freq, scale)


def _check_draft(draft: nn.Module) -> None:
    if not isinstance(draft, DFlashBody):
        raise ValueError(f"draft must be a DFlashBody (or DFlash2Body), got {type(draft).__name__}.")
    if draft.tp_group.size() != 1:
        raise ValueError(
            f"spec_generate runs the draft at tensor-parallel size 1, but it was built with TP="
            f"{draft.tp_group.size()}; load it with checkpoint.load_hf_checkpoint(directory) in a plain process."
        )


class DraftKVCache:
    """The draft's KV cache of committed context, one entry per position.

    Per layer, `keys`/`values` `[B, capacity, Hkv, D]`: entry `t` of a row holds its layer's
    `k_norm`+RoPE'd `k_proj` and its `v_proj` of the context feature of position `t`. Entries
    at or past a row's committed length are scratch (masked by the block visibility and
    overwritten later), which lets every row write a rectangular `[B, W]` slab per cycle.
    """

    def __init__(self, draft: DFlashBody, batch_size: int, capacity: int, device=None, dtype=None):
        _check_draft(draft)
        attn = draft.layers[0].self_attn
        device = device if device is not None else draft.fc.weight.device
        dtype = dtype if dtype is not None else draft.fc.weight.dtype
        shape = (batch_size, capacity, attn.num_kv_heads, attn.head_dim)
        self.draft = draft
        self.capacity = capacity
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in draft.layers]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in draft.layers]

    @property
    def batch_size(self) -> int:
        return self.keys[0].shape[0]

    def write(self, taps: torch.Tensor, start: torch.Tensor) -> None:
        """Write the context of positions `start[b] + j`, `j < S`, from `taps [B, S, taps*H]`.

        `start [B]` int64. Positions must stay below `capacity`.
        """
        draft = self.draft
        B, S, _ = taps.shape
        positions = start[:, None] + torch.arange(S, device=start.device)  # [B, S]
        needed = int(positions.max()) + 1
        if needed > self.capacity:
            self.grow(max(needed, 2 * self.capacity))
        context = draft.hidden_norm(draft.fc(taps.to(draft.fc.weight.dtype)))  # [B, S, H]
        cos, sin = _rope(draft.config, positions)
        index = positions[:, :, None, None]
        for i, layer in enumerate(draft.layers):
            attn = layer.self_attn
            k = _linear(attn.k_proj, context).view(B, S, attn.num_kv_heads, attn.head_dim)
            k = apply_rope(attn.k_norm(k), cos, sin)
            v = _linear(attn.v_proj, context).view(B, S, attn.num_kv_heads, attn.head_dim)
            expand = index.expand(-1, -1, attn.num_kv_heads, attn.head_dim)
            self.keys[i].scatter_(1, expand, k.to(self.keys[i].dtype))
            self.values[i].scatter_(1, expand, v.to(self.values[i].dtype))

    def grow(self, capacity: int) -> None:
        """Room for positions `< capacity` (the entries so far are kept). `write` grows the cache by
        doubling, so its size follows what is generated, not what `max_new_tokens` allows."""
        if capacity <= self.capacity:
            return
        def grown(t: torch.Tensor) -> torch.Tensor:
            out = t.new_zeros((t.shape[0], capacity) + tuple(t.shape[2:]))
            out[:, : self.capacity] = t
            return out

        self.keys = [grown(k) for k in self.keys]
        self.values = [grown(v) for v in self.values]
        self.capacity = capacity

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (int64 indices) of the batch."""
        self.keys = [k.index_select(0, rows) for k in self.keys]
        self.values = [v.index_select(0, rows) for v in self.values]


def _linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A TP=1 megatron Column/RowParallelLinear (or nn.Linear) applied as a plain linear map.

    At TP=1 their weights are the full `[out, in]` matrices; decoding needs nothing of
    megatron's machinery around them.
    """
    return F.linear(x, layer.weight, getattr(layer, "bias", None))


def _mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """SwiGLU of a `DFlashMLP`: `down(silu(gate(x)) * up(x))`."""
    return _linear(mlp.down_proj, F.silu(_linear(mlp.gate_proj, x)) * _linear(mlp.up_proj, x))


def _block_attention_step(attn, x, keys, values, cos, sin, visibility, backend):
    """One layer's attention for `x [B, 1, W, H]` over cached context + own block."""
    B, N, W, _ = x.shape
    D = attn.head_dim
    q = _linear(attn.q_proj, x).view(B, N, W, attn.num_heads, D)
    q = apply_rope(attn.q_norm(q), cos, sin)
    k = _linear(attn.k_proj, x).view(B, N, W, attn.num_kv_heads, D)
    k = apply_rope(attn.k_norm(k), cos, sin)
    v = _linear(attn.v_proj, x).view(B, N, W, attn.num_kv_heads, D)
    out = block_attention(q, keys, values, k, v, visibility, scale=D**-0.5, backend=backend)
    return _linear(attn.o_proj, out.reshape(B, N, W, attn.num_heads * D))


def _around(conv, sublayer, x):
    if conv is None:
        return sublayer(x)
    x, coefficients = conv.prepare(x)
    return conv.finish(sublayer(x), coefficients)


def draft_block_hidden(
    draft: DFlashBody,
    cache: DraftKVCache,
    block_embeddings: torch.Tensor,
    anchors: torch.Tensor,
    *,
    attention_backend: str = "chunked",
) -> torch.Tensor:
    """Draft hidden states of one block per row, from the cached context.

    Args:
        draft: the draft body (TP=1); its layers' submodules are used directly.
        cache: the committed context (`DraftKVCache`); a row sees its positions `< anchors[b]`.
        block_embeddings: `[B, W, H]` embedded `[anchor token, MASK, ...]`.
        anchors: `[B]` int64, position of slot 0 = the row's committed length.
        attention_backend: `block_attention` backend ("chunked" is exact and shape-agnostic).
    Returns:
        `[B, W, H]` after the final norm, equal to `DFlashBody.forward` for a block at `anchors`.
    """
    config = draft.config
    B, W, _ = block_embeddings.shape
    anchors = anchors.to(torch.int64)
    positions = anchors[:, None] + torch.arange(W, device=anchors.device)  # [B, W]
    cos, sin = _rope(config, positions[:, None, :])  # [B, 1, W, D]
    # Only the longest committed prefix of the batch can be visible.
    length = max(int(anchors.max()), 1)
    hidden = block_embeddings.to(draft.fc.weight.dtype)[:, None]  # [B, 1, W, H]
    for i, layer in enumerate(draft.layers):
        causal, window = config.layer_attention(i)
        visibility = BlockVisibility(
            anchor_positions=anchors[:, None],
            context_start=torch.zeros_like(anchors)[:, None],
            block_valid=torch.ones(B, 1, dtype=torch.bool, device=anchors.device),
            causal=causal,
            sliding_window=window,
        )
        keys, values = cache.keys[i][:, :length], cache.values[i][:, :length]
        attention = lambda x, layer=layer, keys=keys, values=values, visibility=visibility: _block_attention_step(  # noqa: E731
            layer.self_attn, x, keys, values, cos, sin, visibility, attention_backend
        )
        hidden = hidden + _around(layer.attention_conv, attention, layer.input_layernorm(hidden))
        mlp = lambda x, layer=layer: _mlp(layer.mlp, x)  # noqa: E731
        hidden = hidden + _around(layer.mlp_conv, mlp, layer.post_attention_layernorm(hidden))
    return draft.norm(hidden)[:, 0]


def _decode(
    target, draft, prompts, rows: _Rows, stats, *, device, max_new_tokens, temperature, top_p, top_k,
    stop_set, generator, sampling, W, attention_backend, confidence_threshold=None,
) -> None:
    """Prefill + draft/verify cycles; fills `rows` (per original row) and `stats`. The old loop verifies blocks
    of `W` (slot 0 the anchor): it has no confidence threshold, and no variant whose every slot proposes."""
    assert confidence_threshold is None, "the old decode path has no confidence threshold"
    cfg = draft.config
    B = len(prompts)
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int64, device=device)
    S = int(lengths.max())
    cache_arg = _cache_argument(target)
    cache = _make_target_cache(target)
    embedding = target.get_input_embeddings()
    head_layer = target.get_output_embeddings()
    head = OutputHead.from_config(head_layer, cfg)
    selector = getattr(draft, "candidate_selector", None)
    # Variant hook: `propose_block(hidden [B, W, H], anchor_ids [B], head, embedding, temperature,
    # generator) -> (tokens [B, W-1], draft_probs [B, W-1, V] or None)`; see `_propose`.
    propose = getattr(draft, "propose_block", None)
    def taps_of(hidden_states) -> torch.Tensor:
        return taps_from_hidden_states(hidden_states, cfg.target_layer_ids)

    def target_dist(logits: torch.Tensor) -> torch.Tensor:
        return sampling_probs(logits, temperature, top_p, top_k)

    # ---- prefill: left-padded prompts, so every row's last prompt token is the last column ----
    offsets = S - lengths  # [B] left padding per row
    ids = torch.full((B, S), cfg.mask_token_id, dtype=torch.int64)
    for b, prompt in enumerate(prompts):
        ids[b, S - len(prompt) :] = torch.tensor(prompt, dtype=torch.int64)
    ids = ids.to(device)
    columns = torch.arange(S, device=device)[None, :]
    valid = columns >= offsets[:, None]  # [B, L] which target cache slots hold committed tokens
    positions = (columns - offsets[:, None]).clamp_min(0)
    out = target(
        input_ids=ids,
        attention_mask=valid.to(torch.int64),
        position_ids=positions,
        use_cache=True,
        output_hidden_states=True,
        logits_to_keep=1,
        **{cache_arg: cache},
    )
    stats["prefill"] += 1
    last_logits = out.logits[:, -1].float()
    first = sample(target_dist(last_logits), generator) if sampling else last_logits.argmax(dim=-1)

    # Draft context of the prompt, written at index = position (undo the left padding).
    # sized for the first cycles only; `write` grows it (doubling) as tokens are committed
    draft_cache = DraftKVCache(draft, B, S + W + min(max_new_tokens, 4 * W))
    taps = taps_of(out.hidden_states)  # [B, S, taps*H]
    gather = (columns + offsets[:, None]).clamp(max=S - 1)  # position t of row b sits in column t + offset
    taps = taps.gather(1, gather[:, :, None].expand(-1, -1, taps.shape[-1]))
    draft_cache.write(taps, torch.zeros(B, dtype=torch.int64, device=device))
    del out, taps

    committed = lengths.clone()  # [B] committed length = position of the next block's slot 0
    row_ids = list(range(B))  # original row of each batch row
    active = []
    for b in range(B):
        token = int(first[b])
        rows.generated[b].append(token)
        done = token in stop_set
        rows.stopped[b] = done
        active.append(not done and len(rows.generated[b]) < max_new_tokens)
    last = first
    scale = float(cfg.input_embedding_scale)
    mask_id = cfg.mask_token_id
    arange_w = torch.arange(W, device=device)

    while True:
        # ---- drop finished rows from every piece of state ----
        if not all(active):
            keep = [i for i, a in enumerate(active) if a]
            if not keep:
                break
            index = torch.tensor(keep, dtype=torch.int64, device=device)
            cache.batch_select_indices(index)
            draft_cache.select_rows(index)
            valid, committed, last = valid[index], committed[index], last[index]
            row_ids = [row_ids[i] for i in keep]
            active = [True] * len(keep)
        B = len(row_ids)

        # ---- draft ----
        block = torch.full((B, W), mask_id, dtype=torch.int64, device=device)
        block[:, 0] = last
        embedded = embedding(block)
        if isinstance(embedded, tuple):
            embedded = embedded[0]
        if scale != 1.0:
            embedded = embedded * scale
        hidden = draft_block_hidden(draft, draft_cache, embedded, committed, attention_backend=attention_backend)
        stats["draft"] += 1
        draft_probs = None
        if propose is not None:
            path, draft_probs, _ = _propose(
                propose, hidden, last, head, embedding, temperature if sampling else 0.0, generator
            )
            block[:, 1:] = path
        else:
            # The head's full width (columns past the draft's vocab_size are -inf), so draft and
            # target distributions share one index space.
            draft_logits = head.local_logits(hidden[:, 1:].to(head_layer.weight.dtype))  # [B, T, V]
            if selector is not None:
                path, candidates, candidate_probs = selector.walk(
                    hidden[:, 1:], draft_logits, last, temperature if sampling else 0.0, generator
                )
                block[:, 1:] = path
                if sampling:
                    draft_probs = torch.zeros_like(draft_logits)
                    if candidate_probs is None:  # the walk was greedy: a point-mass proposal
                        draft_probs.scatter_(-1, path[..., None], 1.0)
                    else:
                        draft_probs.scatter_(-1, candidates, candidate_probs.to(draft_probs.dtype))
            elif sampling:
                draft_probs = torch.softmax(draft_logits / temperature, dim=-1)
                block[:, 1:] = sample(draft_probs, generator)
            else:
                block[:, 1:] = draft_logits.argmax(dim=-1)

        # ---- verify: W new slots per row, holes stay masked ----
        attn_mask = torch.cat([valid, torch.ones(B, W, dtype=torch.bool, device=device)], dim=1)
        out = target(
            input_ids=block,
            attention_mask=attn_mask.to(torch.int64),
            position_ids=committed[:, None] + arange_w,
            use_cache=True,
            output_hidden_states=True,
            **{cache_arg: cache},
        )
        stats["target"] += 1
        target_logits = out.logits.float()  # [B, W, V]
        if sampling:
            accepted, bonus = rejection_verify(block[:, 1:], target_dist(target_logits), draft_probs, generator)
        else:
            accepted, bonus = greedy_verify(block[:, 1:], target_logits)

        # ---- commit: anchor + accepted become context; the bonus is the next anchor ----
        draft_cache.write(taps_of(out.hidden_states), committed)
        del out
        new_slots = arange_w[None, :] <= accepted[:, None]  # [B, W]
        valid = torch.cat([valid, new_slots], dim=1)
        committed = committed + accepted + 1
        last = bonus
        block_host, accepted_host, bonus_host = block.tolist(), accepted.tolist(), bonus.tolist()
        for i, row in enumerate(row_ids):
            a = accepted_host[i]
            produced = block_host[i][1 : 1 + a] + [bonus_host[i]]
            produced = produced[: max_new_tokens - len(rows.generated[row])]
            for j, token in enumerate(produced):
                if token in stop_set:
                    produced = produced[: j + 1]
                    rows.stopped[row] = True
                    break
            rows.generated[row].extend(produced)
            rows.acceptance[row].append(len(produced))
            active[i] = not rows.stopped[row] and len(rows.generated[row]) < max_new_tokens

        # ---- keep the target cache small: crop common tail holes, compact when holes dominate ----
        used = valid.any(dim=0).nonzero()
        new_length = int(used.max()) + 1 if used.numel() else 0
        if new_length < valid.shape[1]:
            cache.crop(new_length - valid.shape[1])
            valid = valid[:, :new_length]
        # Compaction copies the whole cache, so only when holes are a good part of it; every
        # later forward then attends over fewer slots.
        longest = int(valid.sum(dim=1).max())
        if valid.shape[1] - longest > max(longest // 2, 2 * W):
            compacted = _compact_target_cache(cache, valid)
            if compacted is not None:
                valid = compacted


@contextlib.contextmanager
def reference_decode():
    """Within the block, `decoding.generate.spec_generate` decodes with the old draft path of this module."""
    saved = generate._decode
    generate._decode = _decode
    try:
        yield
    finally:
        generate._decode = saved
