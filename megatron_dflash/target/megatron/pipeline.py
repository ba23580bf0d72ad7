"""Pipeline parallelism for the frozen target: run it stage by stage and route its taps to the draft's stage.

The target is a megatron-core ``GPTModel`` split over ``PP`` pipeline stages (`target.megatron.model.MegatronTarget`
wraps one stage). The draft body lives on **one** stage, chosen by the caller (`resolve_draft_stage`; default
the last, ``--dflash-pipeline-stage -1``). Because the target is frozen and forward-only, its pipeline is a plain
chain, with no backward pass and no 1F1B schedule:

1. stage ``s > 0`` receives the ``[S, B, H]`` activations of stage ``s - 1``; stage 0 embeds the tokens;
2. the stage runs its layers (`MegatronTarget.forward`, under ``no_grad``), capturing the taps of the layers
   it owns (global layer ids);
3. stage ``s < PP - 1`` sends its output activations to stage ``s + 1``;
4. a stage that owns tapped layers and is not the draft's stage sends them, concatenated in ascending layer
   id order (one ``[B, S, n_s * H]`` message per producing stage), to the draft's stage;
5. the draft's stage receives the taps of every producing stage (ascending stage order) and assembles the
   body's input ``[B, S, taps * H]`` in ``target_layer_ids`` order (`target.taps.concat_taps`). When the draft
   is on the last stage it also has ``final_hidden`` (the target's final normed hidden states, for
   distillation); elsewhere the last stage sends them on request (``need_final_hidden=True``).

Every message goes from a rank to the rank with the **same tensor-parallel rank** on the other stage, over
megatron's pipeline group, with ``torch.distributed.send``/``recv`` and shapes every rank knows in advance
(``B, S`` from the batch, ``H`` and the per-stage layer ranges from the target's config): no shape exchange.
Megatron's own ``P2PCommunicator`` and schedules are not used: they allocate their buffers with
``torch.cuda.current_device()`` and synchronise CUDA, and they are built around a training schedule with
backward passes the frozen target does not have. Every TP rank of a stage holds the full (replicated)
activations and taps, so each TP rank sends its own copy; the traffic per micro-batch is
``(PP - 1) * S * B * H`` activations plus ``S * B * H`` per tap produced off the draft's stage, per TP rank.
With sequence parallelism the activations stay sharded (``[S / TP, B, H]`` per TP rank, ``1 / TP`` of the
traffic) while the taps are gathered to the full sequence on their stage (`MegatronTarget`). The stages run
one after another (no overlap between micro-batches): the target is forward
only and usually far cheaper than the draft's forward and backward on the draft's stage.

The block embeddings need the target's **input embedding** (first stage) and the loss needs its **output
layer** (last stage). Both are frozen, so the draft's stage keeps frozen copies made once at setup by
`copy_frozen_target_heads`: TP rank ``r`` of the first (last) stage sends its vocabulary shard to TP rank
``r`` of the draft's stage, which wraps it in a megatron ``VocabParallelEmbedding`` (an `target.head.OutputHead`
over a weightless ``ColumnParallelLinear``). Memory: ``V_padded * H / TP`` parameters per copy and TP rank
(Qwen3-8B, bf16, TP 8: 152k x 4096 / 8 x 2 bytes = 156 MB). With tied embeddings the output layer *is* the
embedding, so at most one copy is made; a draft on the first (last) stage needs no embedding (head) copy.

Every function validates before its first collective: the parallel layout (megatron ``parallel_state``
initialised, no virtual pipeline, no custom pipeline layout, no context parallelism), the draft's stage, the
batch shapes; then one small all-reduce over the model-parallel group (TP x PP) makes every rank raise the
same error if any rank's inputs are bad or the ranks disagree (draft stage, batch shape, tapped layers),
instead of hanging in a send that is never received.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from ...common.parallel import ProcessGroups, agree_or_raise, current_process_groups, megatron_ready
from ..head import OutputHead
from ..masks import causal_mask
from ..taps import concat_taps
from .model import MegatronTarget, context_parallel_refusal

__all__ = [
    "DraftStagePlacement",
    "resolve_draft_stage",
    "stage_layer_ranges",
    "TargetOnDraftStage",
    "run_target_pipeline",
    "copy_frozen_target_heads",
]

_HASH_MOD = (1 << 61) - 1


# --------------------------------------------------------------------------------------------------
# Where the draft lives
# --------------------------------------------------------------------------------------------------


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class DraftStagePlacement:
    """The pipeline stage that holds the draft body (and its optimizer), out of ``pp_size`` stages.

    Attributes:
        draft_stage: 0-based stage index, ``0 <= draft_stage < pp_size``.
        pp_size: number of pipeline stages (megatron's pipeline-model-parallel world size).
    """

    draft_stage: int
    pp_size: int = 1

    def __post_init__(self) -> None:
        if not _is_int(self.pp_size) or self.pp_size < 1:
            raise ValueError(f"DraftStagePlacement: pp_size={self.pp_size!r} must be a positive integer.")
        if not _is_int(self.draft_stage) or not 0 <= self.draft_stage < self.pp_size:
            raise ValueError(
                f"DraftStagePlacement: draft_stage={self.draft_stage!r} must be a stage index in "
                f"0..{self.pp_size - 1}; use resolve_draft_stage() for -1 (the last stage)."
            )

    @property
    def is_last_stage(self) -> bool:
        """Whether the draft sits on the last stage (the target's output layer and final norm are there)."""
        return self.draft_stage == self.pp_size - 1

    @property
    def is_first_stage(self) -> bool:
        """Whether the draft sits on the first stage (the target's input embedding is there)."""
        return self.draft_stage == 0

    def holds_draft(self, pp_rank: Optional[int] = None) -> bool:
        """Whether stage ``pp_rank`` (default: this rank's, `common.parallel.current_process_groups()`) holds the draft."""
        if pp_rank is None:
            pp_rank = current_process_groups().pp_rank
        return pp_rank == self.draft_stage


def resolve_draft_stage(arg: Union[int, DraftStagePlacement], pp_size: int) -> DraftStagePlacement:
    """The draft's stage from ``--dflash-pipeline-stage``: ``0..pp_size-1``, or negative from the end (-1 = last).

    A pure function of its arguments: every rank that passes the same command line gets the same result, or
    the same ``ValueError`` (no collective is involved).
    """
    if not _is_int(pp_size) or pp_size < 1:
        raise ValueError(f"resolve_draft_stage: pp_size={pp_size!r} must be a positive integer.")
    if isinstance(arg, DraftStagePlacement):
        if arg.pp_size != pp_size:
            raise ValueError(
                f"resolve_draft_stage: the placement was made for {arg.pp_size} pipeline stage(s) but the "
                f"pipeline has {pp_size}."
            )
        return arg
    if not _is_int(arg):
        raise ValueError(f"--dflash-pipeline-stage={arg!r} must be an integer stage index (-1: the last stage).")
    if not -pp_size <= arg < pp_size:
        raise ValueError(
            f"--dflash-pipeline-stage={arg} is outside the {pp_size} pipeline stage(s): use -1 (the last "
            f"stage, default) or a stage index in 0..{pp_size - 1}."
        )
    return DraftStagePlacement(arg % pp_size, pp_size)


# --------------------------------------------------------------------------------------------------
# Layout helpers (local, no collective)
# --------------------------------------------------------------------------------------------------


def stage_layer_ranges(config, pp_size: int) -> list[range]:
    """Global decoder layers owned by each pipeline stage, computed from the target's ``TransformerConfig``.

    Uses megatron's own ``get_transformer_layer_offset`` for every stage (even and uneven splits,
    ``num_layers_in_first/last_pipeline_stage``, ``account_for_embedding/loss_in_pipeline_split``). Virtual
    (interleaved) pipelines and ``pipeline_model_parallel_layout`` are refused: their stages own several
    non-contiguous chunks.
    """
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    vp = getattr(config, "virtual_pipeline_model_parallel_size", None)
    if vp is not None and vp > 1:
        raise ValueError(
            f"virtual_pipeline_model_parallel_size={vp}: interleaved pipeline stages are not supported for the "
            "frozen target (it runs forward only; interleaving gains nothing); build it without a virtual pipeline."
        )
    if getattr(config, "pipeline_model_parallel_layout", None):
        raise ValueError(
            "pipeline_model_parallel_layout is not supported for the frozen target; split its layers with "
            "num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage or evenly."
        )
    if pp_size == 1:
        return [range(int(config.num_layers))]
    starts = [int(get_transformer_layer_offset(config, pp_rank=s)) for s in range(pp_size)]
    ends = starts[1:] + [int(config.num_layers)]
    return [range(a, b) for a, b in zip(starts, ends)]


def _device(target) -> torch.device:
    if isinstance(target, nn.Module):
        for p in target.parameters():
            return p.device
    return torch.device("cpu")


def _wire_dtype(config) -> torch.dtype:
    return getattr(config, "pipeline_dtype", None) or config.params_dtype


def _check_target(target) -> None:
    if not isinstance(target, MegatronTarget):
        raise ValueError(
            f"the pipeline needs a MegatronTarget (one stage of a megatron GPTModel), got {type(target).__name__}; "
            "an HFTarget runs in one process (PP=1) and needs no routing."
        )
    refusal = context_parallel_refusal(target.model.config)
    if refusal:
        raise ValueError(refusal)


@dataclass
class _Layout:
    stage: int
    pp_size: int
    tp_size: int
    placement: DraftStagePlacement
    ranges: list
    hidden: int
    groups: ProcessGroups

    def owned(self, stage: int, ids: Sequence[int]) -> list[int]:
        """The tapped layers of ``stage``, ascending: the order of its tap message."""
        return sorted(i for i in ids if i in self.ranges[stage])

    def send(self, tensor: torch.Tensor, stage: int) -> None:
        """Send ``tensor`` to the rank of pipeline stage ``stage`` with this rank's TP and DP coordinates."""
        dist.send(tensor.contiguous(), dst=self.groups.pp_peer(stage), group=self.groups.pp)

    def recv(self, shape, dtype, device, stage: int) -> torch.Tensor:
        """A ``shape`` tensor received from the rank of pipeline stage ``stage`` (see `send`)."""
        buffer = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(buffer, src=self.groups.pp_peer(stage), group=self.groups.pp)
        return buffer


def _job_groups(groups: Optional[ProcessGroups]) -> Optional[ProcessGroups]:
    """The process groups of a pipeline call: ``groups`` when handed down, else megatron's when initialised
    (`common.parallel.current_process_groups()`), else None (`_layout` then refuses)."""
    if groups is not None:
        return groups
    return current_process_groups() if megatron_ready() else None


def _layout(target: MegatronTarget, draft_stage, groups: Optional[ProcessGroups]) -> _Layout:
    """Everything both entry points need, checked locally (raises ValueError; no collective)."""
    _check_target(target)
    if groups is None:
        raise ValueError(
            "the target pipeline needs torch.distributed and megatron's parallel_state initialised "
            "(initialize_model_parallel with the pipeline size)."
        )
    config = target.model.config
    stage, pp, tp = groups.pp_rank, groups.pp_size, groups.tp_size
    if int(config.pipeline_model_parallel_size) != pp:
        raise ValueError(
            f"the target was built for pipeline_model_parallel_size={config.pipeline_model_parallel_size} but "
            f"parallel_state has {pp} stage(s)."
        )
    placement = resolve_draft_stage(draft_stage, pp)
    ranges = stage_layer_ranges(config, pp)
    if list(ranges[stage]) != list(target.layer_ids):
        raise ValueError(
            f"pipeline stage {stage} owns target layers {list(target.layer_ids)} but the config's split gives "
            f"{list(ranges[stage])}; build every stage with the same TransformerConfig."
        )
    if bool(target.pre_process) != (stage == 0) or bool(target.post_process) != (stage == pp - 1):
        raise ValueError(
            f"pipeline stage {stage} of {pp}: the target has pre_process={target.pre_process}, "
            f"post_process={target.post_process}; the first stage must embed and the last must hold the "
            "output layer (build with the defaults)."
        )
    return _Layout(stage, pp, tp, placement, ranges, int(config.hidden_size), groups)


def _ids_hash(ids: Sequence[int]) -> int:
    h = 0
    for i in ids:
        h = (h * 1_000_003 + int(i) + 1) % _HASH_MOD
    return h


def _agree(local_error: Optional[str], signature: Sequence[int], what: str, device,
           groups: Optional[ProcessGroups]) -> None:
    """Raise the same ValueError on every rank of the model-parallel group if any rank erred or disagrees
    (`common.parallel.agree_or_raise`: one all-reduce of ``[error flag, signature, -signature]``; only on failure are
    the messages gathered). Without process groups or on one rank, just the local error."""
    agree_or_raise(local_error, signature, (groups or ProcessGroups.single()).mp, device,
                   explain=lambda per_rank, mismatch: _explain_disagreement(what, per_rank, mismatch),
                   alone=lambda error: f"{what}: {error}")


def _explain_disagreement(what: str, gathered: list, mismatch: bool) -> str:
    """The message of `_agree` when some rank of the model-parallel group erred or the ranks disagree."""
    errors = [(r, err) for r, (err, _) in enumerate(gathered) if err is not None]
    if errors and len({err for _, err in errors}) == 1 and not mismatch:
        ranks = "every rank" if len(errors) == len(gathered) else "rank(s) " + ", ".join(str(r) for r, _ in errors)
        return f"{what}: {errors[0][1].rstrip('.')} (raised on {ranks} of the model-parallel group)."
    lines = [f"rank {r}: {err}" for r, err in errors]
    if mismatch:
        lines.append(
            "the ranks of the model-parallel group disagree on their arguments (signature: pipeline size, "
            "TP size, draft stage, then batch shape / vocabulary, hidden size, tapped layers): "
            + ", ".join(f"rank {r}: {s}" for r, (_, s) in enumerate(gathered))
            + "; every rank must pass the same --dflash-pipeline-stage and the same batch"
        )
    return f"{what}: " + "; ".join(lines) + "."


# --------------------------------------------------------------------------------------------------
# The target's forward through the pipeline
# --------------------------------------------------------------------------------------------------


@dataclass
class TargetOnDraftStage:
    """What the draft's stage gets from the target pipeline.

    Attributes:
        taps: ``[B, S, taps * H]``, the tapped layers' outputs concatenated in ``target_layer_ids`` order (the
            body's ``target_hidden``), in the pipeline dtype; no grad.
        final_hidden: ``[B, S, H]`` the target's final normed hidden states (what its output layer reads; the
            teacher of soft-target losses) when the draft is on the last stage or ``need_final_hidden=True``;
            else None.
    """

    taps: torch.Tensor
    final_hidden: Optional[torch.Tensor] = None


def _batch_tensors(batch: Mapping) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    if not isinstance(batch, Mapping) or "tokens" not in batch:
        keys = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
        raise ValueError(f"the batch must be a dict with 'tokens' [B, S] (and 'position_ids'), got {keys}.")
    tokens = batch["tokens"]
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        shape = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise ValueError(f"batch['tokens'] must be a [batch, seq_length] tensor, got {shape}.")
    positions = batch.get("position_ids")
    if positions is not None and (not isinstance(positions, torch.Tensor) or tuple(positions.shape) != tuple(tokens.shape)):
        shape = tuple(positions.shape) if isinstance(positions, torch.Tensor) else type(positions).__name__
        raise ValueError(f"batch['position_ids'] must have the shape of the tokens {tuple(tokens.shape)}, got {shape}.")
    return tokens, positions


def run_target_pipeline(
    target: MegatronTarget,
    batch: Mapping,
    *,
    draft_stage: Union[int, DraftStagePlacement] = -1,
    target_layer_ids: Optional[Sequence[int]] = None,
    attention_mask: Optional[torch.Tensor] = None,
    need_final_hidden: bool = False,
    verify: bool = True,
    groups: Optional[ProcessGroups] = None,
) -> Optional[TargetOnDraftStage]:
    """Run the frozen target through every pipeline stage and deliver its taps to the draft's stage.

    Called by **every** rank of the model-parallel group (all TP ranks of all stages) with the same batch,
    once per micro-batch. Forward only, under ``no_grad``.

    Args:
        target: this rank's stage of the target.
        batch: the batch dict of `data/batching.py`: ``tokens`` ``[B, S]`` (read on the first stage; its shape on every
            stage), ``position_ids`` ``[B, S]`` (optional, RoPE positions on every stage; default ``0..S-1``).
        draft_stage: a `DraftStagePlacement` or the ``--dflash-pipeline-stage`` value (-1: the last stage).
        target_layer_ids: the tapped layers in the body's order; default ``target.target_layer_ids`` (which
            must contain them: only those layers are hooked).
        attention_mask: for every stage's layers, as `MegatronTarget.forward` takes it: None (causal; an
            explicit causal mask is built for CPU tensors, where megatron cannot build one), a ``[B, S]``
            padding mask, or a bool ``[B or 1, 1, S, S]`` mask with True = masked (packed documents).
        need_final_hidden: also deliver the target's final normed hidden states when the draft is not on the
            last stage (one more ``[B, S, H]`` message from the last stage; soft-target losses need it).
        verify: run the agreement all-reduce (every rank raises the same error on bad or disagreeing inputs).
            Costs one tiny all-reduce and a host sync per call.
        groups: the job's process groups (`common.parallel.ProcessGroups`, handed down by the training loop);
            default `common.parallel.current_process_groups()`, megatron's, which must then be initialised.

    Returns:
        On the draft's stage a `TargetOnDraftStage`; None on every other stage.
    """
    what = "run_target_pipeline"
    device = _device(target)
    groups = _job_groups(groups)
    error, layout, ids, tokens, positions = None, None, [], None, None
    try:
        layout = _layout(target, draft_stage, groups)
        ids = _checked_layer_ids(target, target_layer_ids)
        tokens, positions = _batch_tensors(batch)
        _check_pipeline_inputs(target, layout, tokens, attention_mask)
    except ValueError as err:
        error = str(err)
    if verify:
        B, S = (tuple(tokens.shape) if tokens is not None else (-1, -1))
        signature = _layout_signature(layout) + [B, S, layout.hidden if layout else -1, int(bool(need_final_hidden)),
                                                 len(ids), _ids_hash(ids)]
        _agree(error, signature, what, device, groups)
    elif error is not None:
        raise ValueError(f"{what}: {error}")
    S = tokens.shape[1]
    if attention_mask is None and device.type != "cuda":
        attention_mask = causal_mask(S, device)
    with torch.no_grad():
        out = _run_this_stage(target, layout, tokens, positions, attention_mask, device)
        _send_to_draft_stage(layout, out, ids, need_final_hidden, _wire_dtype(target.model.config))
        if layout.stage != layout.placement.draft_stage:
            return None
        return _assemble_on_draft_stage(target, layout, out, ids, tuple(tokens.shape), need_final_hidden, device)


def _layout_signature(layout: Optional[_Layout]) -> list[int]:
    """Pipeline size, TP size and draft stage: the start of both entry points' agreement signature."""
    if layout is None:
        return [-1, -1, -1]
    return [layout.pp_size, layout.tp_size, layout.placement.draft_stage]


def _checked_layer_ids(target: MegatronTarget, target_layer_ids: Optional[Sequence[int]]) -> list[int]:
    """The tapped layers to deliver: ``target_layer_ids`` (default the target's), all hooked and distinct."""
    ids = list(target.target_layer_ids if target_layer_ids is None else target_layer_ids)
    unknown = [i for i in ids if i not in target.target_layer_ids]
    if not ids or len(set(ids)) != len(ids) or unknown:
        raise ValueError(
            f"target_layer_ids={ids} must be a non-empty list of distinct layers among the target's tapped "
            f"layers {target.target_layer_ids}" + (f" ({unknown} are not hooked)" if unknown else "") + "."
        )
    return ids


def _check_pipeline_inputs(target: MegatronTarget, layout: _Layout, tokens: torch.Tensor, attention_mask) -> None:
    """The sequence splits over TP under sequence parallelism; the mask is a tensor or None."""
    if target.sequence_parallel and tokens.shape[1] % layout.tp_size:
        raise ValueError(
            f"with sequence parallelism the sequence length ({tokens.shape[1]}) must be a multiple of "
            f"tensor_model_parallel_size={layout.tp_size}."
        )
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        raise ValueError(f"attention_mask must be a tensor or None, got {type(attention_mask).__name__}.")


def _run_this_stage(target: MegatronTarget, layout: _Layout, tokens: torch.Tensor, positions, attention_mask,
                    device):
    """Steps 1-3: this stage's layers on the tokens (first stage) or the previous stage's activations, which
    go on to the next stage. Returns the target's output on this stage (`MegatronTarget.forward`)."""
    stage, (B, S) = layout.stage, tokens.shape
    wire = _wire_dtype(target.model.config)
    if stage == 0:
        out = target(tokens.to(device), attention_mask=attention_mask, position_ids=positions)
    else:
        # Under sequence parallelism each TP rank passes its own [S / TP, B, H] shard along the chain.
        shard = S // layout.tp_size if target.sequence_parallel else S
        incoming = layout.recv((shard, B, layout.hidden), wire, device, stage - 1)
        out = target(None, attention_mask=attention_mask, position_ids=positions, input_tensor=incoming)
    if stage < layout.pp_size - 1:
        layout.send(out.output_tensor.to(wire), stage + 1)
    return out


def _send_to_draft_stage(layout: _Layout, out, ids: Sequence[int], need_final_hidden: bool, wire) -> None:
    """Step 4: off the draft's stage, send this stage's taps (and from the last stage the final hidden states,
    on request) to the draft's stage."""
    stage, d, last = layout.stage, layout.placement.draft_stage, layout.pp_size - 1
    mine = layout.owned(stage, ids)
    if stage != d and mine:
        layout.send(torch.cat([out.taps[i].to(wire) for i in mine], dim=-1), d)
    if stage == last and need_final_hidden and d != last:
        layout.send(out.final_hidden.to(wire), d)


def _assemble_on_draft_stage(target: MegatronTarget, layout: _Layout, out, ids: Sequence[int], shape,
                             need_final_hidden: bool, device) -> TargetOnDraftStage:
    """Step 5, on the draft's stage: its own taps and every producing stage's (ascending stage order), in
    ``ids`` order ``[B, S, taps * H]``; the final hidden states when on the last stage or requested."""
    B, S = shape
    H, d, last = layout.hidden, layout.placement.draft_stage, layout.pp_size - 1
    wire = _wire_dtype(target.model.config)
    taps = {i: out.taps[i].to(wire) for i in layout.owned(layout.stage, ids)}
    for s in range(layout.pp_size):
        theirs = layout.owned(s, ids)
        if s == d or not theirs:
            continue
        received = layout.recv((B, S, len(theirs) * H), wire, device, s)
        taps.update(zip(theirs, received.split(H, dim=-1)))
    final_hidden = None
    if d == last:
        final_hidden = out.final_hidden
    elif need_final_hidden:
        final_hidden = layout.recv((B, S, H), wire, device, last)
    return TargetOnDraftStage(taps=concat_taps(taps, ids), final_hidden=final_hidden)


# --------------------------------------------------------------------------------------------------
# Frozen copies of the target's embedding and output layer on the draft's stage
# --------------------------------------------------------------------------------------------------


def _copy_config(target: MegatronTarget, tp_size: int):
    """A megatron ``ModelParallelConfig`` that builds the copies without initialising (or touching CUDA)."""
    from megatron.core.model_parallel_config import ModelParallelConfig

    config = target.model.config
    return ModelParallelConfig(
        tensor_model_parallel_size=tp_size,
        params_dtype=config.params_dtype,
        use_cpu_initialization=True,
        perform_initialization=False,
        deterministic_mode=getattr(config, "deterministic_mode", False),
        gradient_accumulation_fusion=False,
    )


def _frozen(weight: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(weight, requires_grad=False)


def copy_frozen_target_heads(
    target: MegatronTarget,
    draft_stage: Union[int, DraftStagePlacement] = -1,
    *,
    verify: bool = True,
    groups: Optional[ProcessGroups] = None,
) -> tuple[Optional[nn.Module], Optional[OutputHead]]:
    """Give the draft's stage the target's input embedding and output layer; call once at setup, on every rank.

    Returns ``(embedding, head)`` on the draft's stage and ``(None, None)`` elsewhere:

    * ``embedding``: the target's own ``VocabParallelEmbedding`` when the draft is on the first stage, else a
      frozen ``VocabParallelEmbedding`` holding a copy of this TP rank's vocabulary shard, sent by the same TP
      rank of the first stage. Use it as ``embed_blocks(..., embedding)``.
    * ``head``: the target's own `OutputHead` when the draft is on the last stage, else an `OutputHead` over a
      weightless ``ColumnParallelLinear`` with ``weight=`` the output-layer shard sent by the same TP rank of
      the last stage (tied embeddings: the embedding shard, no second copy), and the last stage's output
      multiplier and soft cap.

    Nothing returned requires grad or belongs to the draft body: keep the copies out of the optimizer and the
    draft's checkpoints (they are rebuilt from the target at every start). Memory: ``V_padded * H / TP``
    parameters per copy and TP rank. ``groups``: as for `run_target_pipeline`.
    """
    what = "copy_frozen_target_heads"
    device = _device(target)
    groups = _job_groups(groups)
    error, layout = None, None
    model = getattr(target, "model", None)
    vocab = int(getattr(model, "vocab_size", -1))
    tied = bool(getattr(model, "share_embeddings_and_output_weights", False))
    try:
        layout = _layout(target, draft_stage, groups)
        _check_heads_to_copy(target, layout, vocab)
    except ValueError as err:
        error = str(err)
    if verify:
        signature = _layout_signature(layout) + [vocab, layout.hidden if layout else -1, int(tied)]
        _agree(error, signature, what, device, groups)
    elif error is not None:
        raise ValueError(f"{what}: {error}")
    embedding = _copy_embedding(target, layout, vocab, device)
    head = _copy_output_head(target, layout, vocab, tied, embedding, device)
    return embedding, head


def _check_heads_to_copy(target: MegatronTarget, layout: _Layout, vocab: int) -> None:
    """The vocabulary splits over TP; the first stage has the embedding and the last the output head."""
    if vocab % layout.tp_size:
        raise ValueError(f"the padded vocabulary {vocab} is not divisible by TP={layout.tp_size}.")
    if layout.stage == 0 and target.embedding is None:
        raise ValueError("the first stage has no input embedding.")
    if layout.stage == layout.pp_size - 1 and target.output_head is None:
        raise ValueError("the last stage has no output head.")


def _copy_embedding(target: MegatronTarget, layout: _Layout, vocab: int, device) -> Optional[nn.Module]:
    """The input embedding on the draft's stage (first stage -> draft's stage); None elsewhere."""
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

    stage, d = layout.stage, layout.placement.draft_stage
    if d == 0:
        return target.embedding if stage == d else None
    if stage == 0:
        layout.send(target.embedding.weight.detach(), d)
    if stage != d:
        return None
    weight = layout.recv((vocab // layout.tp_size, layout.hidden), target.model.config.params_dtype, device, 0)
    embedding = VocabParallelEmbedding(
        vocab, layout.hidden, init_method=nn.init.zeros_, config=_copy_config(target, layout.tp_size),
        tp_group=layout.groups.tp,
    )
    embedding.weight = _frozen(weight)
    embedding.eval()
    return embedding


def _copy_output_head(target: MegatronTarget, layout: _Layout, vocab: int, tied: bool,
                      embedding: Optional[nn.Module], device) -> Optional[OutputHead]:
    """The output layer on the draft's stage (last stage -> draft's stage: its output multiplier and soft cap,
    then its weight shard unless tied to the embedding); None elsewhere."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    stage, d, last = layout.stage, layout.placement.draft_stage, layout.pp_size - 1
    if d == last:
        return target.output_head if stage == d else None
    if stage == last:
        source = target.output_head
        cap = source.final_logit_softcapping
        meta = torch.tensor([float(source.output_multiplier), float("nan") if cap is None else float(cap)],
                            dtype=torch.float64, device=device)
        layout.send(meta, d)
        if not tied:
            weight = source.weight if source.weight is not None else source.layer.weight
            layout.send(weight.detach(), d)
    if stage != d:
        return None
    meta = layout.recv((2,), torch.float64, device, last).tolist()
    shard = (vocab // layout.tp_size, layout.hidden)
    weight = embedding.weight if tied else _frozen(
        layout.recv(shard, target.model.config.params_dtype, device, last))
    layer = ColumnParallelLinear(
        layout.hidden, vocab, config=_copy_config(target, layout.tp_size), init_method=nn.init.zeros_,
        bias=False, gather_output=False, skip_weight_param_allocation=True, tp_group=layout.groups.tp,
    )
    layer.eval()
    return OutputHead(
        layer=layer,
        vocab_size=target.vocab_size,
        tp_group=layout.groups.tp,
        output_multiplier=meta[0],
        final_logit_softcapping=None if meta[1] != meta[1] else meta[1],
        weight=weight,
    )
