"""One full DFlash (or DSpark) training step: megatron-dflash against NeMo AutoModel 0.7.0's trainer.

Examples:
    python benchmarks/bench_step.py                                # S = 1024, 2048, 4096; anchors S/4; block 16
    python benchmarks/bench_step.py --seq 2048 --rounds 5 --steps 3
    python benchmarks/bench_step.py --profile 2048                 # our step's operator profile at S=2048
    python benchmarks/bench_step.py --layer                        # one draft layer, S=4096, 512 anchors
    python benchmarks/bench_step.py --variant dspark --seq 2048 --vocab 151936   # the DSpark step, block 7
    python benchmarks/bench_step.py --vocab 151936 --draft-vocab-size 32000 --seq 2048  # reduced draft vocabulary

Both sides run the same step on identical shapes, random weights and random tokens (batch 1, every token
supervised): the frozen target's forward with its layer taps, the draft's forward, the decay-weighted block
cross entropy over the target's frozen LM head, the backward, one AdamW step.

    ours  `HFTarget` (taps by forward hooks; the forward stops after the last tap, as training does when no
          loss reads the target's final hidden state) -> `embed_blocks` -> `DFlashBody` (attention "auto":
          the exact chunked kernel on the CPU) -> `dflash_loss` (the fused LM-head loss) -> backward -> AdamW.
    nemo  NeMo AutoModel's `HFDFlashTargetModel.generate_batch` (the whole causal LM, its logits included)
          -> `DFlashTrainerModule.forward` (its `Qwen3DFlashDraftModel` with SDPA and the dense block mask:
          its flex-attention path has no CPU backward; full-vocabulary logits, `DFlashDecayLoss`) ->
          backward -> AdamW.

Both targets are the same randomly initialised 4-layer Qwen3 (transformers, SDPA), tapped at layers 0 and 2;
both drafts have 2 layers of the target's width (``--draft-layers``).

``--variant dspark``: one full DSpark training step (defaults: block 7, 5 draft layers, decay 4, Markov rank 256
of the vanilla form, the confidence head reading ``W1[prev]``, loss weights CE 0.1, L1 0.9, BCE 1.0, as in the
published recipe), anchors S/4 (512 at S=2048), every token supervised:

    ours  `HFTarget` with the final hidden state (no early stop after the last tap: the L1 term distils to the
          target's distribution) -> `embed_blocks` -> `DSparkBody` -> the ``dspark`` variant's loss adapter
          (`dspark_variant_loss`: Markov features, confidence logits, `dspark_loss`, the fused chunked kernel
          over the target's frozen LM head, ``--loss-chunk`` slots per chunk) -> backward -> AdamW.
    nemo  NeMo AutoModel's `HFDSparkTargetModel.generate_batch` (the whole causal LM, its logits included;
          hooks capture the taps and the final norm's output) -> `DSparkTrainerModule.forward` (its
          `Qwen3DSparkModel` built as its recipe builds a Qwen3 draft, with its frozen copies of the target's
          embedding and LM head; its own anchor sampling; SDPA with the dense block mask instead of its recipe's
          flex attention, which has no CPU backward; the draft's ``[B, N, W, V]`` logits plus the Markov bias,
          the target's ``[B, N, W, V]`` logits at the aligned positions, `compute_dspark_loss`) -> backward ->
          AdamW over the trainable parameters.

``--target-cache``: our step reading the target's states from a cache (`training/target_cache.py`: a safetensors
shard written once, before the timed steps, by the same target) against our online step; the cached side holds
only the target's embedding and LM head (`target/frozen_heads.py`, read from the target's saved files), reads
the sample's states from the shard every step, and runs no target forward. Sides ``online`` and ``cached``; the
memory columns are the step's, over what was live once the models existed, so the target's weights are in
neither (their size is printed apart). Works with ``--variant dspark`` (the final hidden state is cached too).

The anchors differ in position (each side samples its own), not in number. Every (side, size) runs in its own fresh process, and the
rounds alternate which side goes first, so neither side profits from a warmer machine or allocator.

Reported per side and size: median wall time of a step, median process CPU time of a step (all threads;
steadier than wall time when other jobs share the machine), and the peak RSS increase of the process over
the steps (``ru_maxrss`` minus the RSS once models and inputs exist), and the live peak: the high-water mark of
the bytes torch allocates during one more (untimed, profiled) step beyond what was live before it
(`peak_memory.alloc_peak`; the tensors the step needs, without what the C allocator keeps after frees, the
CPU counterpart of ``torch.cuda.max_memory_allocated``). Ratios are nemo / ours.

GFLOP/s lines: each side's floating-point work counted by `torch.utils.flop_counter.FlopCounterMode` (every
matmul the step runs: target, draft forward and backward, LM head, attention including any recomputation; the
CPU flash-attention kernel of SDPA counted as the products it runs), divided by the step's CPU time per thread,
against the same rate of a 2048^3 `torch.mm` measured on this machine with the same number of threads (best
of several runs). The FLOP line is the ratio of the two sides' work: the CPU-time ratio the two would have at
the same GFLOP/s, i.e. what the algorithm saves, apart from how fast either side's kernels run.

``--layer``: one draft decoder layer forward+backward instead of the step (defaults S=4096, anchors S/8,
block 16, hidden 256, 4 heads, 2 KV heads), same random weights on both sides, random block and context
hidden states that require gradients, one random output gradient:

    ours  `DFlashBody(config).layers[0]` (a `DFlashDecoderLayer`, attention "auto": the chunked kernel on the
          CPU) with the body's RoPE tables and `BlockVisibility.from_plan` of a `build_dflash_batch_plan` plan.
    nemo  `Qwen3DFlashDecoderLayer` (``draft_qwen3.py``) with SDPA, its rotary embedding and the dense additive
          mask of ``create_dflash_sdpa_mask`` for the same anchors.

Inside the timed pass each side also builds what its attention needs from the plan (ours: RoPE tables and the
visibility; nemo: RoPE tables, position ids and the dense mask), as a training step builds them once for all
layers. Memory and time are that of the layer alone, with no optimizer.

NeMo AutoModel is imported with two of its package imports bypassed: ``nemo_automodel.components.datasets.llm``
(its ``__init__`` imports every dataset class) is entered without running its ``__init__``, and ``datasets``
is replaced by an empty module when not installed; the DFlash trainer uses neither.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_LAYER_IDS = [0, 2]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", choices=["dflash", "dspark"], default="dflash",
                        help="the step compared: DFlash (default) or DSpark (against NeMo's DSparkTrainerModule)")
    parser.add_argument("--layer", action="store_true", help="one draft layer forward+backward, not the step")
    parser.add_argument("--seq", type=int, nargs="+", default=None, help="default 1024 2048 4096 (--layer: 4096)")
    parser.add_argument("--anchor-ratio", type=int, default=None, help="anchors = seq / this (default 4, --layer: 8)")
    parser.add_argument("--block-size", type=int, default=None, help="default 16 (dspark: 7)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--target-layers", type=int, default=4)
    parser.add_argument("--draft-layers", type=int, default=None, help="default 2 (dspark: 5)")
    parser.add_argument("--decay-gamma", type=float, default=None, help="default 7 (dspark: 4)")
    parser.add_argument("--markov-rank", type=int, default=256, help="dspark: the Markov head's rank")
    parser.add_argument("--loss-chunk", type=int, default=1024, help="ours: predicted slots per loss chunk")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (one process per side per round)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per process (after one warm-up step)")
    parser.add_argument("--sides", nargs="+", default=None, choices=["ours", "nemo", "reduced", "online", "cached"],
                        help="default ours nemo (with --draft-vocab-size: ours reduced; with --target-cache: online "
                        "cached)")
    parser.add_argument("--draft-vocab-size", type=int, default=None, metavar="K",
                        help="side 'reduced': our step with a reduced draft vocabulary of K rows (docs/design.md §20)")
    parser.add_argument("--target-cache", action="store_true",
                        help="our step reading cached target states against our online step")
    parser.add_argument("--no-flops", action="store_true", help="skip the GFLOP/s line")
    parser.add_argument("--profile", type=int, default=None, metavar="S", help="print our step's operator profile")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-seq", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--count-flops", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.sides is None:
        args.sides = (["online", "cached"] if args.target_cache else
                      ["ours", "reduced"] if args.draft_vocab_size else ["ours", "nemo"])
    if args.target_cache and (args.layer or set(args.sides) - {"online", "cached"}):
        parser.error("--target-cache compares our online and cached steps (sides online, cached), not --layer.")
    if args.target_cache:
        args.no_flops = True
    if args.seq is None:
        args.seq = [4096] if args.layer else [1024, 2048, 4096]
    if args.anchor_ratio is None:
        args.anchor_ratio = 8 if args.layer else 4
    dspark = args.variant == "dspark"
    if dspark and args.layer:
        parser.error("--layer times a DFlash draft layer; DSpark's layers are DFlash's (run it without --variant).")
    for name, dflash_default, dspark_default in (("block_size", 16, 7), ("draft_layers", 2, 5),
                                                 ("decay_gamma", 7.0, 4.0)):
        if getattr(args, name) is None:
            setattr(args, name, dspark_default if dspark else dflash_default)
    if "reduced" in args.sides and not args.draft_vocab_size:
        parser.error("side 'reduced' needs --draft-vocab-size K")
    return args


# ---------------------------------------------------------------------------------------------------------
# The two sides (run inside a worker process)
# ---------------------------------------------------------------------------------------------------------


def _hf_target(args, seq: int):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.target_layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, max_position_embeddings=max(seq * 2, 4096), tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    model = Qwen3ForCausalLM(config).eval()
    model.requires_grad_(False)
    return model


def _inputs(args, seq: int):
    import torch

    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, args.vocab - 1, (1, seq), generator=gen)
    return input_ids, torch.ones(1, seq, dtype=torch.bool)


def _draft_fields(args) -> dict:
    """The draft's shape fields common to the DFlash and DSpark steps timed here (their configs add their own)."""
    return dict(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.draft_layers,
                num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                block_size=args.block_size, mask_token_id=args.vocab - 1, vocab_size=args.vocab,
                num_target_layers=args.target_layers, target_layer_ids=TARGET_LAYER_IDS)


def build_reduced(args, seq: int):
    """Our step with a reduced draft vocabulary: the draft's own frozen head over ``--draft-vocab-size`` rows of
    the target's (ids 0..K-1; every slot is computed whatever its label), the loss over those K columns."""
    return build_ours(args, seq, draft_vocab_size=args.draft_vocab_size)


def build_ours(args, seq: int, draft_vocab_size=None):
    import torch

    sys.path.insert(0, str(ROOT))
    from megatron_dflash.draft.body import DFlashBody
    from megatron_dflash.draft.config import DFlashConfig
    from megatron_dflash.objectives.dflash_loss import dflash_loss, embed_blocks
    from megatron_dflash.plan.batch_plan import build_dflash_batch_plan
    from megatron_dflash.target.taps import HFTarget

    torch.manual_seed(0)
    model = _hf_target(args, seq)
    config = DFlashConfig(**_draft_fields(args), draft_vocab_size=draft_vocab_size)
    target = HFTarget.from_config(model, config)
    body = DFlashBody(config).train()
    head = target.output_head
    if draft_vocab_size:
        from megatron_dflash.draft.draft_vocab import DraftVocabulary
        from megatron_dflash.target.head import OutputHead
        from megatron_dflash.training.draft_vocab import install_draft_vocab

        install_draft_vocab(body, DraftVocabulary(torch.arange(draft_vocab_size), args.vocab), head, trainable=False)
        head = OutputHead.of_draft(body, head)
    optimizer = torch.optim.AdamW([p for p in body.parameters() if p.requires_grad], lr=1e-4)
    input_ids, mask = _inputs(args, seq)
    anchors = seq // args.anchor_ratio

    def step(index: int):
        plan = build_dflash_batch_plan(mask, torch.tensor([0]), anchors_per_sample=anchors,
                                       block_size=args.block_size, optimizer_step=index, seed=0)
        out = target(input_ids, need_final_hidden=False)
        blocks = embed_blocks(input_ids, plan, target.embedding, mask_token_id=config.mask_token_id)
        hidden = body(out.taps, blocks, plan)
        loss = dflash_loss(hidden, plan, input_ids, head, decay_gamma=args.decay_gamma)
        (loss.loss_sum / loss.weight_sum.clamp(min=1e-12)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _import_nemo():
    """NeMo AutoModel's DFlash pieces without the dataset imports its package ``__init__`` pulls in."""
    import importlib.util
    import types

    if importlib.util.find_spec("datasets") is None:
        stub = types.ModuleType("datasets")
        stub.Dataset = type("Dataset", (), {})
        stub.DatasetDict = type("DatasetDict", (), {})
        sys.modules["datasets"] = stub
    import nemo_automodel.components.datasets as nemo_datasets

    llm = types.ModuleType("nemo_automodel.components.datasets.llm")
    llm.__path__ = [os.path.join(os.path.dirname(nemo_datasets.__file__), "llm")]
    sys.modules.setdefault(llm.__name__, llm)
    from nemo_automodel.components.speculative.dflash.core import DFlashTrainerModule
    from nemo_automodel.components.speculative.dflash.draft_qwen3 import (
        Qwen3DFlashDraftModel,
        build_qwen3_dflash_draft_config,
    )
    from nemo_automodel.components.speculative.dflash.target import HFDFlashTargetModel

    return DFlashTrainerModule, Qwen3DFlashDraftModel, build_qwen3_dflash_draft_config, HFDFlashTargetModel


def build_nemo(args, seq: int):
    import torch

    DFlashTrainerModule, Qwen3DFlashDraftModel, build_draft_config, HFDFlashTargetModel = _import_nemo()
    torch.manual_seed(0)
    model = _hf_target(args, seq)
    target = HFDFlashTargetModel(model, TARGET_LAYER_IDS)
    draft_config = build_draft_config(
        model.config, num_draft_layers=args.draft_layers, num_target_layers=args.target_layers,
        block_size=args.block_size, dflash_config={"mask_token_id": args.vocab - 1, "target_layer_ids": TARGET_LAYER_IDS},
        attention_backend="sdpa",
    )
    draft = Qwen3DFlashDraftModel(draft_config).train()
    trainer = DFlashTrainerModule(
        draft, model.lm_head, model.model.embed_tokens, mask_token_id=args.vocab - 1, block_size=args.block_size,
        attention_backend="sdpa", num_anchors=seq // args.anchor_ratio, loss_decay_gamma=args.decay_gamma,
    )
    optimizer = torch.optim.AdamW(draft.parameters(), lr=1e-4)
    input_ids, mask = _inputs(args, seq)

    def step(index: int):
        batch = target.generate_batch(input_ids, attention_mask=mask.long(), loss_mask=mask.long())
        metrics = trainer(input_ids, batch.hidden_states, batch.loss_mask)
        metrics.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def build_ours_dspark(args, seq: int):
    """Our DSpark step, as `training.step` runs it: the target's forward to its final hidden state, the blocks,
    `DSparkBody`, the variant's loss adapter (`objectives.dspark_loss`, fused), backward, AdamW."""
    import torch

    sys.path.insert(0, str(ROOT))
    from megatron_dflash.objectives.dflash_loss import embed_blocks
    from megatron_dflash.plan.batch_plan import build_dflash_batch_plan
    from megatron_dflash.target.taps import HFTarget
    from megatron_dflash.variants.dspark import DSparkBody, DSparkConfig
    from megatron_dflash.variants.registry import get_variant

    torch.manual_seed(0)
    model = _hf_target(args, seq)
    config = DSparkConfig(**_draft_fields(args), markov_rank=args.markov_rank, markov_head_type="vanilla",
                          enable_confidence_head=True, confidence_head_with_markov=args.markov_rank > 0)
    target = HFTarget.from_config(model, config)
    body = DSparkBody(config).train()
    variant = get_variant("dspark")
    optimizer = torch.optim.AdamW(body.parameters(), lr=1e-4)
    input_ids, mask = _inputs(args, seq)
    anchors = seq // args.anchor_ratio

    def step(index: int):
        plan = build_dflash_batch_plan(mask, torch.tensor([0]), anchors_per_sample=anchors,
                                       block_size=args.block_size, optimizer_step=index, seed=0)
        out = target(input_ids, need_final_hidden=True)
        with torch.no_grad():
            blocks = embed_blocks(input_ids, plan, target.embedding, mask_token_id=config.mask_token_id)
        hidden = body(out.taps, blocks, plan)
        loss = variant.loss(body, hidden, plan, input_ids, target.output_head, decay_gamma=args.decay_gamma,
                            chunk_slots=args.loss_chunk, final_hidden=out.final_hidden, input_mask=mask)
        (loss.loss_sum / loss.weight_sum.clamp(min=1e-12)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def build_nemo_dspark(args, seq: int):
    """NeMo AutoModel's DSpark step as its recipe (``train_dspark.py``) builds it for a Qwen3 target: the draft
    config from the target's, the draft's frozen copies of the target's embedding and LM head, the target
    wrapper's hooks, `DSparkTrainerModule` (its recipe's loss weights), backward, AdamW."""
    import torch
    from transformers import Qwen3Config

    _import_nemo()
    from nemo_automodel.components.speculative.dspark.core import DSparkTrainerModule
    from nemo_automodel.components.speculative.dspark.draft_qwen3 import Qwen3DSparkModel
    from nemo_automodel.components.speculative.dspark.target import HFDSparkTargetModel

    torch.manual_seed(0)
    model = _hf_target(args, seq)
    target = HFDSparkTargetModel(model, TARGET_LAYER_IDS)
    values = model.config.to_dict()
    values.update(
        architectures=["Qwen3DSparkModel"], num_hidden_layers=args.draft_layers, max_window_layers=args.draft_layers,
        layer_types=["full_attention"] * args.draft_layers, num_target_layers=args.target_layers,
        target_layer_ids=TARGET_LAYER_IDS, block_size=args.block_size, num_anchors=seq // args.anchor_ratio,
        mask_token_id=args.vocab - 1, markov_rank=args.markov_rank, markov_head_type="vanilla",
        enable_confidence_head=True, confidence_head_with_markov=args.markov_rank > 0, tie_word_embeddings=False,
    )
    draft_config = Qwen3Config.from_dict(values)
    draft_config._attn_implementation = "sdpa"  # its flex-attention path has no CPU backward
    draft = Qwen3DSparkModel(draft_config).train()
    draft.initialize_embeddings_and_head(embed_tokens=target.get_input_embeddings(),
                                         lm_head=target.get_output_embeddings(), freeze=True)
    trainer = DSparkTrainerModule(draft, loss_decay_gamma=args.decay_gamma, ce_loss_alpha=0.1, l1_loss_alpha=0.9,
                                  confidence_head_alpha=1.0)
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-4)
    input_ids, mask = _inputs(args, seq)

    def step(index: int):
        batch = target.generate_batch(input_ids, attention_mask=mask.long(), loss_mask=mask.long())
        metrics = trainer(batch.input_ids, batch.target_hidden_states, batch.loss_mask,
                          target_last_hidden_states=batch.target_last_hidden_states)
        metrics.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _draft_config(args):
    sys.path.insert(0, str(ROOT))
    from megatron_dflash.draft.config import DFlashConfig

    # rope_theta of the transformers Qwen3Config both targets are built from (NeMo's draft inherits it).
    return DFlashConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=1, rope_theta=10_000.0,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
        block_size=args.block_size, mask_token_id=args.vocab - 1, vocab_size=args.vocab,
        num_target_layers=args.target_layers, target_layer_ids=TARGET_LAYER_IDS,
    )


def _layer_inputs(args, seq: int):
    """The plan (its anchors serve both sides) and random ``hidden [1, N, W, H]``, ``context [1, S, H]``,
    ``grad_out [1, N, W, H]``."""
    import torch

    sys.path.insert(0, str(ROOT))
    from megatron_dflash.plan.batch_plan import build_dflash_batch_plan

    _, mask = _inputs(args, seq)
    plan = build_dflash_batch_plan(mask, torch.tensor([0]), anchors_per_sample=seq // args.anchor_ratio,
                                   block_size=args.block_size, optimizer_step=0, seed=0)
    gen = torch.Generator().manual_seed(2)
    N, W, H = plan.anchor_positions.shape[1], args.block_size, args.hidden
    hidden = torch.randn(1, N, W, H, generator=gen).requires_grad_()
    context = torch.randn(1, seq, H, generator=gen).requires_grad_()
    grad_out = torch.randn(1, N, W, H, generator=gen)
    return plan, hidden, context, grad_out


def _copy_layer_weights(theirs, ours) -> None:
    """NeMo's layer gets our layer's (random) weights: the parameter names are the same."""
    import torch

    with torch.no_grad():
        for name, param in theirs.named_parameters():
            param.copy_(ours.get_parameter(name))


def build_ours_layer(args, seq: int):
    import torch

    sys.path.insert(0, str(ROOT))
    from megatron_dflash.draft.attention import BlockVisibility
    from megatron_dflash.draft.body import DFlashBody

    torch.manual_seed(0)
    body = DFlashBody(_draft_config(args)).train()
    layer = body.layers[0]
    plan, hidden, context, grad_out = _layer_inputs(args, seq)

    def step(index: int):
        rope = body.rope(plan, hidden.device)
        visibility = BlockVisibility.from_plan(plan)
        layer(hidden, context, rope, visibility).backward(grad_out)
        layer.zero_grad(set_to_none=True)
        hidden.grad = context.grad = None

    return step


def build_nemo_layer(args, seq: int):
    import torch
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    _import_nemo()
    sys.path.insert(0, str(ROOT))
    from nemo_automodel.components.attention.dflash_mask import create_dflash_sdpa_mask
    from nemo_automodel.components.speculative.dflash.draft_qwen3 import (
        Qwen3DFlashDecoderLayer,
        build_qwen3_dflash_draft_config,
    )

    torch.manual_seed(0)
    draft_config = build_qwen3_dflash_draft_config(
        _hf_target(args, seq).config, num_draft_layers=1, num_target_layers=args.target_layers,
        block_size=args.block_size, dflash_config={"mask_token_id": args.vocab - 1, "target_layer_ids": TARGET_LAYER_IDS},
        attention_backend="sdpa",
    )
    layer = Qwen3DFlashDecoderLayer(draft_config, 0).train()
    rotary = Qwen3RotaryEmbedding(draft_config)
    from megatron_dflash.draft.body import DFlashBody

    _copy_layer_weights(layer, DFlashBody(_draft_config(args)).layers[0])
    plan, hidden, context, grad_out = _layer_inputs(args, seq)
    B, N, W, H = hidden.shape
    anchors, valid = plan.anchor_positions, plan.block_valid

    def step(index: int):
        positions = torch.cat([torch.arange(seq).view(1, -1),
                               (anchors.view(B, N, 1) + torch.arange(W)).view(B, N * W)], dim=1)
        position_embeddings = rotary(hidden, positions)
        mask = create_dflash_sdpa_mask(anchors, valid, seq, W, hidden.device, hidden.dtype)
        out = layer(target_hidden=context, hidden_states=hidden.view(B, N * W, H), attention_mask=mask,
                    position_embeddings=position_embeddings)
        out.backward(grad_out.view(B, N * W, H))
        layer.zero_grad(set_to_none=True)
        hidden.grad = context.grad = None

    return step


def build_cached(args, seq: int):
    """Our step (DFlash or DSpark) with the target's states read from a cache: the states of the one sample written
    once by the same target (untimed), the target saved and only its embedding and LM head read back."""
    import tempfile

    import torch

    sys.path.insert(0, str(ROOT))
    from megatron_dflash.draft.config import DFlashConfig
    from megatron_dflash.objectives.dflash_loss import dflash_loss, embed_blocks
    from megatron_dflash.plan.batch_plan import build_dflash_batch_plan
    from megatron_dflash.target.frozen_heads import load_frozen_heads
    from megatron_dflash.target.state_cache import (CACHE_FORMAT_VERSION, CacheManifest, StateCacheReader,
                                                    publish_manifest, write_index, write_shard)
    from megatron_dflash.target.taps import HFTarget
    from megatron_dflash.variants.dspark import DSparkBody, DSparkConfig
    from megatron_dflash.variants.registry import get_variant

    dspark = args.variant == "dspark"
    fields = _draft_fields(args)
    if dspark:
        config = DSparkConfig(**fields, markov_rank=args.markov_rank, markov_head_type="vanilla",
                              enable_confidence_head=True, confidence_head_with_markov=args.markov_rank > 0)
    else:
        config = DFlashConfig(**fields)
    input_ids, mask = _inputs(args, seq)
    directory = tempfile.mkdtemp(prefix="bench-cache-")
    manifest = CacheManifest(CACHE_FORMAT_VERSION, "bench", tuple(TARGET_LAYER_IDS), args.hidden, dspark, "float32",
                             seq, False, "bench", 1, {"train": 1, "valid": 0})
    cache = os.path.join(directory, "cache")

    def write_cache():  # in a child process, as the cache tool writes it: this process never holds the target
        torch.manual_seed(0)
        model = _hf_target(args, seq)
        model.save_pretrained(os.path.join(directory, "target"))
        out = HFTarget.from_config(model, config)(input_ids, need_final_hidden=dspark)
        publish_manifest(cache, manifest)
        write_shard(cache, "train", 0, {0: (input_ids[0], out.taps[0], out.final_hidden[0] if dspark else None)})
        write_index(cache, manifest)

    import multiprocessing

    writer = multiprocessing.get_context("fork").Process(target=write_cache)
    writer.start()
    writer.join()
    assert writer.exitcode == 0, "the cache writer failed"
    heads = load_frozen_heads(os.path.join(directory, "target"), config, torch.float32, None, tied=False,
                              vocab_parallel=False)
    reader = StateCacheReader(cache, manifest)
    body = (DSparkBody(config) if dspark else __import__("megatron_dflash.draft.body", fromlist=["DFlashBody"])
            .DFlashBody(config)).train()
    optimizer = torch.optim.AdamW(body.parameters(), lr=1e-4)
    anchors = seq // args.anchor_ratio

    def step(index: int):
        plan = build_dflash_batch_plan(mask, torch.tensor([0]), anchors_per_sample=anchors,
                                       block_size=args.block_size, optimizer_step=index, seed=0)
        _, taps, final = reader.sample(0)
        with torch.no_grad():
            blocks = embed_blocks(input_ids, plan, heads.embedding, mask_token_id=config.mask_token_id)
        hidden = body(taps[None], blocks, plan)
        if dspark:
            loss = get_variant("dspark").loss(body, hidden, plan, input_ids, heads.head, decay_gamma=args.decay_gamma,
                                              chunk_slots=args.loss_chunk, final_hidden=final[None], input_mask=mask)
        else:
            loss = dflash_loss(hidden, plan, input_ids, heads.head, decay_gamma=args.decay_gamma)
        (loss.loss_sum / loss.weight_sum.clamp(min=1e-12)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step.weights = (heads.loaded_bytes, heads.skipped_bytes)
    return step


def _builders(args) -> dict:
    if args.target_cache:
        return {"online": build_ours_dspark if args.variant == "dspark" else build_ours, "cached": build_cached}
    if args.layer:
        return {"ours": build_ours_layer, "nemo": build_nemo_layer}
    if args.variant == "dspark":
        return {"ours": build_ours_dspark, "nemo": build_nemo_dspark}
    return {"ours": build_ours, "nemo": build_nemo, "reduced": build_reduced}


def worker(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    seq = args.worker_seq
    step = _builders(args)[args.worker](args, seq)
    import psutil

    rss_before = psutil.Process().memory_info().rss
    step(0)  # warm-up
    walls, cpus = [], []
    for index in range(1, args.steps + 1):
        wall, cpu = time.perf_counter(), time.process_time()
        step(index)
        cpus.append(time.process_time() - cpu)
        walls.append(time.perf_counter() - wall)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    result = {"wall": statistics.median(walls), "cpu": statistics.median(cpus), "rss": peak - rss_before}
    if hasattr(step, "weights"):  # the cached side: the target's weights held and left on disk
        result["held"], result["skipped"] = step.weights
    from peak_memory import alloc_peak  # after the RSS reading: the profiler has its own memory

    result["live"] = alloc_peak(lambda: step(args.steps + 1))
    if args.count_flops:
        with _flop_counter() as counter:
            step(args.steps + 1)
        result["flops"] = counter.get_total_flops()
    return result


def _flop_counter():
    """`FlopCounterMode` that also counts the CPU flash-attention kernel SDPA runs on the CPU (NeMo's draft and
    the targets): its forward as the two score / value products, its backward as 2.5 forwards (recomputed
    scores, dV, dP, dQ, dK), the same products our chunked kernel runs and the counter sees as matmuls."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

    def forward(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
        return sdpa_flop_count(query_shape, key_shape, value_shape)

    def backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
        return 5 * sdpa_flop_count(query_shape, key_shape, value_shape) // 2

    aten = torch.ops.aten
    mapping = {}
    for name, formula in (("_scaled_dot_product_flash_attention_for_cpu", forward),
                          ("_scaled_dot_product_flash_attention_for_cpu_backward", backward)):
        if hasattr(aten, name):
            mapping[getattr(aten, name)] = formula  # keyed by overload packet, as the counter looks ops up
    return FlopCounterMode(display=False, custom_mapping=mapping)


def profile_ours(args, seq: int) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(args.threads)
    step = _builders(args)["ours"](args, seq)
    step(0)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(1)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    print(prof.key_averages().table(sort_by="self_cpu_memory_usage", row_limit=15))


# ---------------------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------------------


def run_worker(args, side: str, seq: int, count_flops: bool = False) -> dict:
    command = [sys.executable, __file__, "--worker", side, "--worker-seq", str(seq)]
    for name in ("anchor_ratio", "block_size", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab",
                 "target_layers", "draft_layers", "decay_gamma", "threads", "steps", "variant", "markov_rank",
                 "loss_chunk"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if args.draft_vocab_size:
        command += ["--draft-vocab-size", str(args.draft_vocab_size)]
    if args.layer:
        command.append("--layer")
    if args.target_cache:
        command += ["--target-cache", "--sides", *args.sides]
    if count_flops:
        command.append("--count-flops")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONWARNINGS="ignore")
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{side} worker at S={seq} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(lines[-1])


def mm_peak(threads: int, size: int = 2048, repeats: int = 5) -> float:
    """Best GFLOP/s of a ``size^3`` fp32 `torch.mm`, per CPU-second per thread (as our step is rated)."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    out = torch.empty(size, size)
    torch.mm(a, b, out=out)
    best = 0.0
    for _ in range(repeats):
        cpu = time.process_time()
        for _ in range(3):
            torch.mm(a, b, out=out)
        seconds = (time.process_time() - cpu) / threads
        best = max(best, 3 * 2 * size**3 / seconds / 1e9)
    return best


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker is not None:
        print(json.dumps(worker(args)))
        return
    if args.profile is not None:
        profile_ours(args, args.profile)
        return
    what = "one draft layer forward+backward" if args.layer else f"{args.variant} draft {args.draft_layers} layers"
    if args.variant == "dspark":
        what += f", Markov rank {args.markov_rank} (vanilla), confidence head"
    print(f"# {what}: batch 1, anchors S/{args.anchor_ratio}, block {args.block_size}, hidden "
          f"{args.hidden}, target {args.target_layers} layers, vocab {args.vocab}, fp32, {args.threads} threads, "
          f"{args.rounds} alternating rounds x {args.steps} steps")
    print(f"{'S':>6} {'anchors':>7} {'side':>5} {'wall s':>8} {'cpu s':>8} {'peak RSS +MiB':>14} {'live peak +MiB':>14}",
          flush=True)
    for seq in args.seq:
        per_side = {side: [] for side in args.sides}
        for round_index in range(args.rounds):
            order = args.sides if round_index % 2 == 0 else list(reversed(args.sides))
            for side in order:
                r = run_worker(args, side, seq)
                per_side[side].append(r)
                print(f"# round {round_index} S={seq} {side}: wall {r['wall']:.3f} s, cpu {r['cpu']:.3f} s, "
                      f"RSS +{r['rss'] / 2**20:.0f} MiB, live +{r['live'] / 2**20:.0f} MiB", flush=True)
        sides = {side: {key: statistics.median(r[key] for r in runs) for key in ("wall", "cpu", "rss", "live")}
                 for side, runs in per_side.items()}
        for side, r in sides.items():
            print(f"{seq:>6} {seq // args.anchor_ratio:>7} {side:>5} {r['wall']:8.3f} {r['cpu']:8.3f} "
                  f"{r['rss'] / 2**20:14.0f} {r['live'] / 2**20:14.0f}")
        if "reduced" in sides and "ours" in sides:
            ours, reduced = sides["ours"], sides["reduced"]
            print(f"{seq:>6} {'':>7} {'ratio':>5} {ours['wall'] / reduced['wall']:7.2f}x "
                  f"{ours['cpu'] / reduced['cpu']:7.2f}x {ours['rss'] / max(reduced['rss'], 1):13.2f}x "
                  f"{ours['live'] / max(reduced['live'], 1):13.2f}x   (full vocabulary / K={args.draft_vocab_size})",
                  flush=True)
        if args.target_cache and len(sides) == 2:
            online, cached = sides["online"], sides["cached"]
            held = per_side["cached"][0]
            print(f"{seq:>6} {'':>7} {'ratio':>5} {online['wall'] / cached['wall']:7.2f}x "
                  f"{online['cpu'] / cached['cpu']:7.2f}x {online['rss'] / max(cached['rss'], 1):13.2f}x "
                  f"{online['live'] / max(cached['live'], 1):13.2f}x   (online / cached); target weights held by the "
                  f"cached side {held['held'] / 2**20:.1f} MiB, not loaded {held['skipped'] / 2**20:.1f} MiB", flush=True)
        elif "nemo" in sides and "ours" in sides:
            ours, nemo = sides["ours"], sides["nemo"]
            print(f"{seq:>6} {'':>7} {'ratio':>5} {nemo['wall'] / ours['wall']:7.2f}x {nemo['cpu'] / ours['cpu']:7.2f}x "
                  f"{nemo['rss'] / max(ours['rss'], 1):13.2f}x {nemo['live'] / max(ours['live'], 1):13.2f}x   "
                  "(nemo / ours)", flush=True)
    if not args.no_flops and "ours" in args.sides:
        peak = mm_peak(args.threads)
        for seq in args.seq:
            counted = {side: run_worker(args, side, seq, count_flops=True) for side in args.sides}
            for side, run in counted.items():
                rate = run["flops"] / (run["cpu"] / args.threads) / 1e9
                print(f"GFLOP/s S={seq}: {side} {run['flops'] / 1e9:.0f} GFLOP per step at {rate:.0f} GFLOP/s per "
                      f"CPU-second per thread; torch.mm 2048^3 peak {peak:.0f} -> {rate / peak:.0%} of peak")
            if "nemo" in counted and "ours" in counted:
                ratio = counted["nemo"]["flops"] / counted["ours"]["flops"]
                print(f"FLOP S={seq}: nemo / ours {ratio:.2f}x (the CPU-time ratio both sides would have at the same "
                      "GFLOP/s)")


if __name__ == "__main__":
    main()
