"""Resolve a validated command line into a `Job`: target, tokenizer, draft config, data, evaluation.

Everything here reads files only (the target's `config.json`, the tokenizer, a drafter to start
from, the evaluation prompts) and never communicates, so it runs on every rank before
`torch.distributed` is initialised and a bad launch fails everywhere with the same message.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from ..common.safetensors_files import TargetWeightsError, refuse_pickled_weights
from ..data.chat import load_chat_template
from ..data.prompts import PromptError, read_data_prompts, read_prompt_file, tokenize_prompt, unknown_token_warning
from ..draft.config import DFlashConfig
from ..embedded_job.synthetic_corpus import conversations
from ..embedded_job.tiny_target import (
    SHIPPED_TARGET_DIR,
    TinyTargetRecipe,
    default_cache_dir,
    embedded_target_dir,
    matches_recipe,
)
from ..objectives.dflash_loss import LossWeighting
from ..target.families import TargetFamily, TargetFamilyError, resolve_target_family, resolve_text_config
from ..variants.registry import Variant, variant_for_draft_family
from .arguments import (
    DRAFT_CONFIG_FLAGS,
    EMBEDDED_SYNTHETIC_HELDOUT_SEED,
    ArgumentError,
    chat_template_kwargs,
    draft_config_overrides,
    resolve_decay_gamma,
    run_variant,
    validate_args,
    world_size_from_env,
)
from .outputs import check_outputs
from .rundir import resolve_run_dir

__all__ = ["Job", "prepare_job", "draft_config_from_target", "load_eval_prompts", "resolve_target_dir",
           "choose_mask_token"]

DEFAULT_SYNTHETIC_EVAL_PROMPTS = 24


@dataclass
class Job:
    """Everything the training loop needs, resolved identically on every rank."""

    args: argparse.Namespace
    world_size: int
    target_dir: str
    tokenizer_dir: str
    tokenizer: Any
    target_config: dict  # the target's config.json as written (a multimodal wrapper keeps its text_config inside)
    draft_config: DFlashConfig
    variant: Variant
    variant_options: Any  # the run's record of `variant.options.options_cls`, handed to its loss adapter
    export_dir: str
    decay_gamma: Optional[float]
    loss_weighting: LossWeighting = field(default_factory=LossWeighting)  # decay or D-PACE (docs/design.md §6)
    eval_prompts: Optional[list] = None  # token-id lists
    eval_skip_reason: Optional[str] = None
    stop_token_ids: list = field(default_factory=list)
    pad_token_id: int = 0
    init_from: Optional[str] = None
    run_dir: str = "runs"
    embedded_target: bool = False  # the tiny target of the default job (no --target)
    target_family: Optional[TargetFamily] = None  # how the target is loaded and which drafts it can have

    @property
    def target_text_config(self) -> dict:
        """The target's decoder-stack config (`families.resolve_text_config`)."""
        return resolve_text_config(self.target_config)

    @property
    def tp(self) -> int:
        return self.args.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.args.pipeline_model_parallel_size

    @property
    def dp(self) -> int:
        return self.args.data_parallel_size


# ------------------------------------------------------------------------------------------ target


def _local_rank_zero(env) -> bool:
    return str(env.get("LOCAL_RANK", "0")) == "0"


def resolve_target_dir(args, env=None, log=print, wait_s: float = 3600.0) -> str:
    """`--target`, or the embedded tiny target (shipped with the package; else built once and cached).

    When it must be built, with several ranks on a node, local rank 0 builds the tiny target while
    the others wait for the cache entry to appear (file polling, no collective).
    """
    if args.target is not None:
        return args.target
    env = os.environ if env is None else env
    if _local_rank_zero(env) or matches_recipe(SHIPPED_TARGET_DIR):
        return embedded_target_dir(log=log)
    recipe = TinyTargetRecipe()
    final = os.path.join(default_cache_dir(), f"tiny-qwen3-target-{recipe.key()}")
    deadline = time.monotonic() + wait_s
    while not os.path.isfile(os.path.join(final, "recipe.json")):
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for local rank 0 to build the tiny target in {final}.")
        time.sleep(2.0)
    return final


def _load_tokenizer(directory: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory)
    except Exception as err:  # noqa: BLE001 - report any loader failure as a launch error
        raise ArgumentError(
            f"cannot load a tokenizer from {directory} ({type(err).__name__}: {err}); pass --tokenizer DIR."
        ) from None


def _token_ids(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


# ------------------------------------------------------------------------------------------ draft config


def draft_config_from_target(
    target_config: dict,
    *,
    config_cls=DFlashConfig,
    num_layers: int,
    block_size: int,
    mask_token_id: int,
    target_layer_ids: Optional[list[int]],
    **overrides: Any,
) -> DFlashConfig:
    """The draft config for a target ``config.json`` dict, derived by its family (`target.families.resolve_target_family`)
    from its text config; ``config_cls`` is the config class of the variant that trains the family's draft family
    (`variants.registry.variant_for_draft_family`)."""
    family = resolve_target_family(target_config)
    return family.draft_config(target_config, config_cls=config_cls, num_layers=num_layers,
                               block_size=block_size, mask_token_id=mask_token_id,
                               target_layer_ids=target_layer_ids, **overrides)


def _config_from_init(args, variant: Variant, options, target_config: dict) -> DFlashConfig:
    """The config of `--dflash-init-from`, checked against the target and the explicit flags."""
    directory = args.dflash_init_from
    try:
        config = variant.config_from_pretrained(directory)
    except (ValueError, FileNotFoundError) as err:
        raise ArgumentError(f"--dflash-init-from={directory}: {err}") from None
    mismatches = []
    text = resolve_text_config(target_config)
    for name, value in (("num_target_layers", text["num_hidden_layers"]),
                        ("hidden_size", text["hidden_size"]),
                        ("vocab_size", text["vocab_size"])):
        if getattr(config, name) != int(value):
            mismatches.append(f"{name}={getattr(config, name)} but the target's is {value}")
    explicit = [("--dflash-block-size", args.dflash_block_size, config.block_size),
                ("--dflash-num-layers", args.dflash_num_layers, config.num_hidden_layers),
                ("--dflash-target-layer-ids", args.dflash_target_layer_ids_list, config.target_layer_ids),
                ("--dflash-mask-token-id", args.dflash_mask_token_id, config.mask_token_id)]
    given = draft_config_overrides(args, config.num_hidden_layers)  # only the flags set explicitly
    explicit += [("--" + flag.replace("_", "-"), given[field], getattr(config, field))
                 for flag, field in DRAFT_CONFIG_FLAGS.items() if field in given]
    own = variant.options.config_overrides(options)  # the variant's own architecture flags given
    explicit += [(flag.name, own[flag.config_field], getattr(config, flag.config_field))
                 for flag in variant.options.flags if flag.config_field in own]
    for flag, given, have in explicit:
        if given is not None and given != have:
            mismatches.append(f"{flag}={given} but the drafter has {have}")
    if mismatches:
        raise ArgumentError(
            f"--dflash-init-from={directory} does not fit this run: " + "; ".join(mismatches)
            + ". Drop the conflicting flags (the drafter's config is used) or start from scratch."
        )
    return config  # the drafter's own MASK token (it was trained with it), whatever the tokenizer says


def choose_mask_token(explicit: Optional[int], tokenizer, embedding_rows: int, tokenizer_dir: str) -> tuple[int, str]:
    """The MASK token id of a new draft and why it was chosen (docs/design.md §2, the MASK row), never a resize:

    1. `--dflash-mask-token-id`, when given;
    2. the tokenizer's own mask token;
    3. else the first row of the target's embedding past every id of the tokenizer, when the embedding has
       such rows (no text ever maps to it): the rule behind the published drafters' MASK (z-lab's Qwen3
       drafters use 151669, the first row past Qwen3's 151,669 tokens in its 151,936-row embedding) and
       SpecForge's fallback;
    4. else refused: every row is a token the data may hold, and a pad / EOS fallback would give the MASK
       slots the embedding of a real token (pad is often EOS).
    Raises `ArgumentError`."""
    if explicit is not None:
        return int(explicit), "given by --dflash-mask-token-id"
    mask = getattr(tokenizer, "mask_token_id", None)
    if mask is not None:
        return int(mask), f"the tokenizer's mask token {tokenizer.mask_token!r}"
    used = max(tokenizer.get_vocab().values(), default=-1) + 1
    if used < embedding_rows:
        return used, (f"the tokenizer has no mask token: the first row of the target's {embedding_rows}-row embedding "
                      f"past the tokenizer's ids 0..{used - 1}, which no text maps to (the published drafters' rule)")
    raise ArgumentError(
        f"the tokenizer in {tokenizer_dir} has no mask token and its ids fill all {embedding_rows} rows of the "
        "target's embedding, so no row is free for MASK (a pad / EOS fallback would make MASK a real token): pass "
        "--dflash-mask-token-id ID, a reserved or unused token the data never contains."
    )


# ------------------------------------------------------------------------------------------ evaluation


def load_eval_prompts(path: str, tokenizer, limit: Optional[int] = None, log=None, *,
                      template_kwargs: Optional[dict] = None, from_data: bool = False) -> list[list[int]]:
    """Token ids of every prompt in a JSONL file, in the format of `megatron_dflash.data.prompts`
    (`input_ids`, `text` / `prompt` or `messages` lines; chats get the generation prompt), or with
    ``from_data`` of training data (`data.prompts.read_data_prompts`). ``template_kwargs`` go to the chat
    template. `log` (when given) receives a warning for each prompt that is mostly unknown tokens."""

    try:
        items = read_data_prompts(path, limit) if from_data else read_prompt_file(path, limit)
        prompts = [tokenize_prompt(item, tokenizer, template_kwargs) for item in items]
    except PromptError as err:
        raise ArgumentError(f"{'--valid-data' if from_data else '--dflash-eval-prompts'}: {err}") from None
    if log is not None:
        for item, ids in zip(items, prompts):
            warning = unknown_token_warning(ids, tokenizer, item.where)
            if warning:
                log(f"[eval] {warning}")
    return prompts


def synthetic_eval_prompts(tokenizer, count: int, seed: int = EMBEDDED_SYNTHETIC_HELDOUT_SEED,
                           template_kwargs: Optional[dict] = None) -> list[list[int]]:
    """The user turns of `count` held-out synthetic chats, rendered with the generation prompt (and
    ``template_kwargs``, the run's ``--chat-template-kwargs``, like the data)."""
    prompts = []
    for chat in conversations(seed, count):
        out = tokenizer.apply_chat_template(chat[:1], tokenize=True, add_generation_prompt=True, return_dict=True,
                                            **(template_kwargs or {}))
        prompts.append([int(t) for t in out["input_ids"]])
    return prompts


def _check_prompt_ids(prompts: list, vocab: int, source) -> None:
    for i, ids in enumerate(prompts):
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ArgumentError(
                f"--dflash-eval-prompts={source}: prompt {i + 1} has token id {bad[0]}, outside the target's "
                f"vocabulary [0, {vocab})."
            )


# ------------------------------------------------------------------------------------------ the job


def prepare_job(
    args: argparse.Namespace,
    world_size: Optional[int] = None,
    env=None,
    *,
    cuda: Optional[bool] = None,
    log=print,
) -> Job:
    """Validate `args` and resolve every file they name. Raises `ArgumentError` (same on every rank)."""
    env = os.environ if env is None else env
    world_size = world_size_from_env(env) if world_size is None else world_size
    validate_args(args, world_size, env, cuda=cuda)
    target_dir = resolve_target_dir(args, env, log=log)
    with open(os.path.join(target_dir, "config.json")) as f:
        target_config = json.load(f)
    text_config = resolve_text_config(target_config)
    family, variant = _family_and_variant(args, target_dir, target_config)
    options = variant.options.build(vars(args))  # the run's settings of its variant, built once
    _check_target_config(args, target_dir, target_config)
    tokenizer_dir = args.tokenizer or target_dir
    tokenizer = _checked_tokenizer(tokenizer_dir, int(text_config["vocab_size"]))
    if args.chat_template is not None:  # the data and the evaluation prompts render with it
        try:
            tokenizer.chat_template = load_chat_template(args.chat_template)
        except (OSError, ValueError) as err:
            raise ArgumentError(f"--chat-template {args.chat_template}: {err}") from None
    config = _draft_config(args, family, variant, options, target_config, tokenizer, tokenizer_dir, log)
    _check_sequence_length(args, config)
    _check_decode_settings(variant, options, config)
    run_dir, export_dir = _resolve_outputs(args, env)
    eval_prompts, skip = _evaluation_prompts(args, tokenizer, target_dir, export_dir, int(text_config["vocab_size"]),
                                             log)
    stop = _token_ids(getattr(tokenizer, "eos_token_id", None)) or _token_ids(text_config.get("eos_token_id"))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stop[0] if stop else 0)
    return Job(
        args=args,
        world_size=world_size,
        target_dir=target_dir,
        tokenizer_dir=tokenizer_dir,
        tokenizer=tokenizer,
        target_config=target_config,
        draft_config=config,
        variant=variant,
        variant_options=options,
        export_dir=export_dir,
        decay_gamma=resolve_decay_gamma(args, config.block_size),
        loss_weighting=LossWeighting(args.dflash_loss_weighting, float(args.dflash_dpace_alpha),
                                     args.dflash_dpace_normalization),
        eval_prompts=eval_prompts,
        eval_skip_reason=skip,
        stop_token_ids=stop,
        pad_token_id=int(pad),
        init_from=args.dflash_init_from,
        run_dir=run_dir,
        embedded_target=args.target is None,
        target_family=family,
    )


def _family_and_variant(args, target_dir: str, target_config: dict) -> tuple[TargetFamily, Variant]:
    """The target's family and the variant that trains the requested objective on the family's draft family
    (`variants.registry.variant_for_draft_family`); a run the family cannot do is refused."""
    try:
        family = resolve_target_family(target_config)
        try:
            variant = variant_for_draft_family(run_variant(args), family.draft_family)
        except ValueError as err:
            raise TargetFamilyError(f"--dflash-variant {args.dflash_variant}: {err} Train one of those for this "
                                    "target.") from None
        family.check_run(target_backend=args.target_backend, attention_backend=args.dflash_attention_backend,
                         pack_sequences=args.pack_sequences, text_config=resolve_text_config(target_config))
    except TargetFamilyError as err:
        raise ArgumentError(f"--target={target_dir}: {err}") from None
    return family, variant


def _check_target_config(args, target_dir: str, target_config: dict) -> None:
    """A decoder LLM config whose weights are no pickles; with the megatron backend, its sizes against the parallel
    layout."""
    text_config = resolve_text_config(target_config)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        if key not in text_config:
            raise ArgumentError(f"--target={target_dir}: config.json has no {key!r}; not a decoder LLM config.")
    try:
        refuse_pickled_weights(target_dir)
    except TargetWeightsError as err:
        raise ArgumentError(f"--target={target_dir}: {err}") from None
    if args.target_backend != "megatron":
        return
    # here: only the megatron backend needs the target model's module (megatron-core's GPT layers)
    from ..target.megatron.config import hf_target_spec, megatron_target_config

    try:
        # The target's sizes against the layout (heads, MLP columns and experts per rank), before any rank
        # builds anything.
        megatron_target_config(
            target_config,
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            expert_model_parallel_size=args.expert_model_parallel_size,
            expert_tensor_parallel_size=args.expert_tensor_parallel_size,
            sequence_parallel=args.sequence_parallel,
            use_cpu_initialization=True,
        )
        if args.pack_sequences and hf_target_spec(target_config).mla:
            raise ValueError(
                "--pack-sequences gives each document its own positions, but a multi-latent-attention target "
                "(megatron-core's MLASelfAttention) runs RoPE at positions 0..S-1 only; drop --pack-sequences."
            )
    except ValueError as err:
        raise ArgumentError(f"--target-backend megatron: {err}") from None


def _checked_tokenizer(tokenizer_dir: str, vocab: int):
    """The tokenizer, refused when its ids reach past the target's vocabulary."""
    tokenizer = _load_tokenizer(tokenizer_dir)
    if len(tokenizer) > vocab:
        raise ArgumentError(
            f"the tokenizer in {tokenizer_dir} has {len(tokenizer)} tokens but the target's vocabulary has {vocab} "
            "rows: its ids past the vocabulary would index outside the target's embedding. Use the target's "
            "tokenizer (--tokenizer)."
        )
    return tokenizer


def _mask_token(args, target_config: dict, tokenizer, tokenizer_dir: str, log) -> int:
    """`choose_mask_token` for this run, said in the log (the draft config records it)."""
    rows = int(resolve_text_config(target_config)["vocab_size"])
    mask, why = choose_mask_token(args.dflash_mask_token_id, tokenizer, rows, tokenizer_dir)
    log(f"[draft] MASK token id {mask}: {why}")
    return mask


def _draft_config(args, family: TargetFamily, variant: Variant, options, target_config: dict, tokenizer,
                  tokenizer_dir: str, log=print) -> DFlashConfig:
    """The draft config: `--dflash-init-from`'s, or derived by the family from the target and the flags."""
    try:
        if args.dflash_init_from is not None:
            config = _config_from_init(args, variant, options, target_config)
        else:
            config = family.draft_config(
                target_config,
                config_cls=variant.config_cls,
                num_layers=args.dflash_num_layers,
                block_size=args.dflash_block_size,
                mask_token_id=_mask_token(args, target_config, tokenizer, tokenizer_dir, log),
                target_layer_ids=args.dflash_target_layer_ids_list,
                **draft_config_overrides(args, args.dflash_num_layers),
                **variant.config_overrides(options),
            )
        config.validate_tensor_parallel(args.tensor_model_parallel_size)
    except ValueError as err:
        if isinstance(err, ArgumentError):
            raise
        raise ArgumentError(f"draft configuration: {err}") from None
    return config


def _check_decode_settings(variant: Variant, options, config: DFlashConfig) -> None:
    """The run's decoding settings (`VariantOptions.decode`) that its drafter cannot use, refused before training
    rather than at its first decode evaluation: a confidence threshold without a confidence head."""
    threshold = variant.options.decode_kwargs(options).get("confidence_threshold")
    if threshold is not None and not getattr(config, "enable_confidence_head", False):
        raise ArgumentError(
            f"--dflash-confidence-threshold={threshold} stops blocks on the confidence head's predictions, but this "
            "draft has no confidence head; drop the threshold or train the head (--dflash-confidence-head)."
        )


def _check_sequence_length(args, config: DFlashConfig) -> None:
    """Anchors per row (the recipe's default capped by what a row can anchor) and the row length."""
    if "dflash_anchors_per_sample" in args.dflash_defaulted:
        # The recipe's 512 blocks per row, but never more than a row can anchor.
        args.dflash_anchors_per_sample = max(1, min(args.dflash_anchors_per_sample,
                                                    args.seq_length - config.block_size + 1))
    if args.dflash_anchors_per_sample > args.seq_length:
        raise ArgumentError(
            f"--dflash-anchors-per-sample={args.dflash_anchors_per_sample} exceeds --seq-length={args.seq_length}."
        )
    if args.seq_length < config.block_size + 1:
        raise ArgumentError(
            f"--seq-length={args.seq_length} is too short for block size {config.block_size}: a block needs "
            "context before its anchor and block_size - 1 tokens after it."
        )
    if args.seq_length > config.max_position_embeddings:
        raise ArgumentError(
            f"--seq-length={args.seq_length} exceeds the target's max_position_embeddings="
            f"{config.max_position_embeddings}."
        )


def _resolve_outputs(args, env) -> tuple[str, str]:
    """`(run_dir, export_dir)`; the embedded job keeps a checkpoint by default (sets `args.save`)."""

    run_dir = resolve_run_dir(args, env)
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise ArgumentError(f"--run-dir={run_dir} exists and is not a directory.")
    if args.dflash_export is not None:
        export_dir = args.dflash_export
    elif args.save is not None:
        export_dir = os.path.join(args.save, "hf")
    else:
        export_dir = os.path.join(run_dir, "hf")
    if args.save is None and args.target is None:
        args.save = os.path.join(run_dir, "checkpoints")
    check_outputs(args, export_dir)
    return run_dir, export_dir


def _evaluation_prompts(args, tokenizer, target_dir: str, export_dir: str, vocab: int,
                        log) -> tuple[Optional[list], Optional[str]]:
    """`(prompts, skip_reason)` of the acceptance evaluation: a prompt file, N synthetic chats, the held-out
    chats' prompts, or none (and why)."""
    eval_prompts = None
    skip = None
    source = args.dflash_eval_prompts
    if source is None and args.data_format == "synthetic":
        source = str(DEFAULT_SYNTHETIC_EVAL_PROMPTS)
    if source is None and args.data_format == "chat" and args.valid_data:
        # the prompts of the first held-out chats (everything before their last assistant turn)
        eval_prompts = load_eval_prompts(args.valid_data, tokenizer, limit=DEFAULT_SYNTHETIC_EVAL_PROMPTS,
                                         template_kwargs=chat_template_kwargs(args), from_data=True)
    elif source is None:
        skip = "no --dflash-eval-prompts given (nor chat --valid-data to take prompts from)"
    elif source.strip().lstrip("-").isdigit():
        n = int(source)
        if n == 0:
            skip = "--dflash-eval-prompts 0"
        else:
            eval_prompts = synthetic_eval_prompts(tokenizer, n, template_kwargs=chat_template_kwargs(args))
    else:
        eval_prompts = load_eval_prompts(source, tokenizer, log=log, template_kwargs=chat_template_kwargs(args))
    if eval_prompts is not None and args.target_backend != "hf":
        skip = ("the target runs as a megatron model (--target-backend megatron); measure acceptance with "
                f"tools/evaluate_acceptance.py --target {target_dir} --draft {export_dir}")
        eval_prompts = None
    if eval_prompts is not None:
        _check_prompt_ids(eval_prompts, vocab, source)
    return eval_prompts, skip
