"""Will an exported draft load in vLLM and SGLang, and serve what it was trained as? (docs/design.md §19 Serving check)

A runtime reads a HF draft its own way: each looks for a field in its own places, numbers the target's
layers its own way and runs the in-block attention by its own rule, and a draft read differently from
how it was trained still loads and then accepts about one token per cycle. This module holds each
runtime's reading as data, one `RuntimeRules` per runtime:

* the architectures it registers and the model file each builds;
* where it reads `block_size`, `mask_token_id` and the tap list (first place present wins) and which
  target layer's output a stored id selects (`TapSource.tap_offset`);
* how it runs layer `i` in-block (causal or bidirectional), from the file;
* which of the head's output settings each model file applies;
* the checks that need more than a lookup (Domino's head, DFlash 2's fields, DSpark's Markov head,
  mixed layer types, a reduced draft vocabulary), per model file;
* its serve command, with its flags as its documentation gives them.

`check_serving(directory, target=...)` compares every runtime's reading with this package's reading of
the same file (`checkpoint.architectures.config_from_dict`: what the draft was trained with; taps are
target layer ids whose *output* is tapped, docs/design.md §2 Conventions) and returns per runtime:
loads / loads with a caveat / does not load, with the reasons. It reads `config.json` and the
safetensors headers (and, for a reduced vocabulary, the `d2t` tensor); it never builds a model.

Sources encoded (each rule's comment names its file):

* vLLM, vllm-project/vllm: `vllm/model_executor/models/registry.py` (`_SPECULATIVE_DECODING_MODELS`),
  `models/qwen3_dflash.py` (commit 036a00d), `models/qwen3_dflash2.py` (030da62),
  `models/qwen3_dspark.py` (0302ff4), `v1/worker/gpu/spec_decode/eagle/eagle3_utils.py`
  (`get_eagle3_aux_layers_from_config`); serve flags from the z-lab DFlash model cards and vLLM's
  speculative-decoding documentation.
* SGLang, sgl-project/sglang: `python/sglang/srt/models/dflash.py` (003b23d, `EntryClass =
  DFlashDraftModel`), `models/dspark.py` (01f4762, `EntryClass = [Qwen3DSparkModel]`),
  `speculative/dflash_utils.py` (00731f0, `parse_dflash_draft_config`), `speculative/domino_utils.py`
  (04d4c1a); flags `--speculative-algorithm DFLASH|DSPARK`, `--speculative-draft-model-path`,
  `--speculative-num-draft-tokens` (the block size) from the DFlash model cards.

Imports torch (through the variant modules' published names and the registry): command lines import it
after their arguments are checked.
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

from safetensors import SafetensorError, safe_open

from ..common.errors import CheckpointError
from ..common.safetensors_files import safetensors_files
from ..draft.config import default_target_layer_ids, resolve_text_config
from ..variants.domino import DOMINO_ARCHITECTURE, DOMINO_PROJECTOR_TYPE
from ..variants.dspark import DSPARK_SERVING_METHOD
from .architectures import read_hf_draft_config, read_json_object

__all__ = [
    "LOADS", "CAVEAT", "FAILS", "Finding", "RuntimeReport", "RuntimeRules", "TapSource", "RUNTIMES", "VLLM",
    "SGLANG", "DraftFile", "read_draft_file", "check_serving", "report_lines", "sglang_config", "exit_status",
]

LOADS, CAVEAT, FAILS = "loads", "loads with a caveat", "does not load"
_SEVERITY = {LOADS: 0, CAVEAT: 1, FAILS: 2}
# The settings of the target head's output transform (docs/design.md §2) and their neutral values.
HEAD_SETTINGS = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None}
Path = tuple[str, ...]


@dataclass(frozen=True)
class Finding:
    level: str  # CAVEAT or FAILS
    reason: str


@dataclass(frozen=True)
class TapSource:
    """One place a runtime reads the tap list from, and which target layer's output a stored id selects:
    the output of layer `id + tap_offset` (our convention, docs/design.md §2: id `i` taps layer `i`'s output)."""

    path: Path
    tap_offset: int


@dataclass(frozen=True)
class RuntimeRules:
    """How one runtime reads a draft directory (module docstring); every field is data a test can read."""

    name: str
    source: str
    models: Mapping[str, str]  # architectures[0] -> the model file it builds
    block_size: Sequence[Path]  # empty: the block comes from the serve command
    block_size_default: Optional[int]
    mask_token_id: Sequence[Path]
    mask_fallback: Optional[str]  # what it uses without a mask_token_id
    taps: Sequence[TapSource]
    tap_fallback: str  # what it uses without a tap list
    causal: Callable[[Mapping[str, Any], int], bool]  # layer i runs causal in-block
    applies: Mapping[str, Sequence[Path]]  # model file -> places of the head settings it applies
    checks: Mapping[str, Sequence[Callable[["DraftFile", "RuntimeRules", "CheckOptions"], list]]]
    command: Callable[["DraftFile", str, str, "CheckOptions"], str]
    tap_default: Optional[Callable[["DraftFile"], list]] = None  # its tap list when the file has none


@dataclass
class CheckOptions:
    vllm_v2_runner: bool = False  # vLLM started with VLLM_USE_V2_MODEL_RUNNER=1


@dataclass
class DraftFile:
    """A HF draft directory as the checks see it: the raw config, the tensor headers, and this package's
    reading of it (`trained`, None with `trained_error` when it does not read as a draft here)."""

    directory: str
    config: dict
    tensors: dict  # name -> (dtype, shape, file)
    trained: Any = None
    trained_error: Optional[str] = None
    file_error: Optional[str] = None  # a field of the wrong type or range, or contradicting the weights' shapes

    @property
    def architecture(self) -> Optional[str]:
        names = self.config.get("architectures") or []
        return names[0] if names else None

    def trained_directions(self) -> Optional[list[bool]]:
        """Causal in-block per layer, as trained (`layer_attention`, the one resolver of training and decoding)."""
        resolve = getattr(self.trained, "layer_attention", None)
        if resolve is None:
            return None
        return [bool(resolve(i)[0]) for i in range(self.trained.num_hidden_layers)]


@dataclass
class RuntimeReport:
    runtime: str
    source: str
    verdict: str
    findings: list = field(default_factory=list)
    command: Optional[str] = None

    def to_json(self) -> dict:
        return {"runtime": self.runtime, "source": self.source, "verdict": self.verdict, "command": self.command,
                "reasons": [{"level": f.level, "reason": f.reason} for f in self.findings]}


# ------------------------------------------------------------------------------------------ reading


def lookup(config: Mapping[str, Any], path: Path) -> Any:
    """The value at `path` in a config dict (None when a key is missing or a step is not a dict)."""
    value: Any = config
    for key in path:
        if not isinstance(value, Mapping):
            return None
        value = value.get(key)
    return value


def first_present(config: Mapping[str, Any], paths: Sequence[Path], truthy: bool = False) -> tuple:
    """(path, value) of the first place holding a value (a non-empty one with `truthy`), or (None, None)."""
    for path in paths:
        value = lookup(config, path)
        if value is not None and (value or not truthy):
            return path, value
    return None, None


def _dotted(path: Optional[Path]) -> str:
    return ".".join(path) if path else "-"


def _tensor_headers(directory: str) -> dict:
    """name -> (dtype, shape, file) of every tensor of the directory, from the headers only (`ValueError` naming
    a file that is no safetensors file)."""
    out = {}
    for path in safetensors_files(directory):
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    header = f.get_slice(name)
                    out[name] = (header.get_dtype(), list(header.get_shape()), path)
        except SafetensorError as err:
            raise ValueError(f"{path} is not a readable safetensors file ({err}).") from None
    return out


_INT_DTYPES = ("I64", "I32", "I16", "I8", "U8")


def read_int_tensor(draft: DraftFile, name: str) -> Optional[list[int]]:
    """The values of an integer tensor of the draft (flattened), or None when it is absent or not integer."""
    if name not in draft.tensors:
        return None
    dtype, _, path = draft.tensors[name]
    if dtype not in _INT_DTYPES:
        return None
    with safe_open(path, framework="pt") as f:
        return f.get_tensor(name).flatten().tolist()


def read_draft_file(directory: str) -> DraftFile:
    """The directory's config.json and tensor headers, and this package's reading of it."""
    config = read_json_object(os.path.join(directory, "config.json"))
    draft = DraftFile(directory=os.path.abspath(directory), config=config, tensors=_tensor_headers(directory))
    try:  # as every loader reads it: types, ranges and sizes against the weights first
        _, draft.trained = read_hf_draft_config(directory, {n: shape for n, (_, shape, _) in draft.tensors.items()})
    except CheckpointError as err:  # no runtime builds a draft from it; the rules below would misread it
        draft.file_error = str(err)
    except (ValueError, TypeError, KeyError) as err:
        draft.trained_error = str(err)
    return draft


# ------------------------------------------------------------------------------------------ the checks every runtime gets


def _read_taps(draft: DraftFile, rules: RuntimeRules) -> tuple[Optional[str], Optional[list[int]]]:
    """(where, target layers whose outputs the runtime taps), or (None, None) when it reads no tap list."""
    for source in rules.taps:
        ids = lookup(draft.config, source.path)
        if ids:  # vLLM treats an empty list as absent (eagle3_utils.get_eagle3_aux_layers_from_config)
            return _dotted(source.path), [int(i) + source.tap_offset for i in ids]
    return None, None


def _check_taps(draft: DraftFile, rules: RuntimeRules, _options) -> list:
    where, served = _read_taps(draft, rules)
    if served is None and rules.tap_default is not None:
        where, served = "none in the file: its default formula", rules.tap_default(draft)
    if served is None:
        return [Finding(FAILS, f"reads no tap list ({', '.join(_dotted(s.path) for s in rules.taps)}) and "
                               f"falls back to {rules.tap_fallback}")]
    trained = getattr(draft.trained, "target_layer_ids", None)
    if trained is not None and served != list(trained):
        shift = {s - t for s, t in zip(served, trained)} if len(served) == len(trained) else set()
        detail = f" (every tap shifted by {shift.pop():+d})" if len(shift) == 1 else ""
        return [Finding(FAILS, f"taps the outputs of target layers {served} (read from {where}); the draft was "
                               f"trained on {list(trained)}{detail}")]
    return []


def _check_block_size(draft: DraftFile, rules: RuntimeRules, _options) -> list:
    trained = getattr(draft.trained, "block_size", None)
    if not rules.block_size or trained is None:
        return []  # the block comes from the serve command, which carries the trained one
    path, value = first_present(draft.config, rules.block_size)
    served = int(value) if value is not None else rules.block_size_default
    if served != trained:
        where = _dotted(path) if path else f"absent, its default {rules.block_size_default}"
        return [Finding(FAILS, f"reads block_size {served} ({where}); the draft was trained with {trained}")]
    return []


def _check_mask(draft: DraftFile, rules: RuntimeRules, _options) -> list:
    path, value = first_present(draft.config, rules.mask_token_id)
    if value is None:
        return [Finding(FAILS, f"reads no mask_token_id ({', '.join(_dotted(p) for p in rules.mask_token_id)}) "
                               f"and falls back to {rules.mask_fallback}")]
    trained = getattr(draft.trained, "mask_token_id", None)
    if trained is not None and int(value) != int(trained):
        return [Finding(FAILS, f"reads mask_token_id {value} ({_dotted(path)}); the draft was trained with {trained}")]
    return []


def _check_directions(draft: DraftFile, rules: RuntimeRules, _options) -> list:
    trained = draft.trained_directions()
    if trained is None:
        return []
    served = [rules.causal(draft.config, i) for i in range(len(trained))]
    wrong = [i for i, (s, t) in enumerate(zip(served, trained)) if s != t]
    if not wrong:
        return []
    how = lambda causal: "causal" if causal else "bidirectional"  # noqa: E731
    return [Finding(FAILS, f"runs draft layer(s) {wrong} {how(served[wrong[0]])} in-block; the draft was trained "
                           f"{how(trained[wrong[0]])} there")]


def _check_head_settings(draft: DraftFile, rules: RuntimeRules, model: str) -> list:
    """A head setting the draft was trained with that the model file does not apply (or reads elsewhere)."""
    found = []
    for name, neutral in HEAD_SETTINGS.items():
        value = getattr(draft.trained, name, neutral)
        if value == neutral:
            continue
        if not any(lookup(draft.config, path) == value for path in rules.applies.get(model, ()) if path[-1] == name):
            found.append(Finding(CAVEAT, f"{model} ignores {name}={value} (trained with it): the drafted "
                                         "tokens come from other logits than training's, so fewer are accepted"))
    return found


_GENERIC_CHECKS = (_check_taps, _check_block_size, _check_mask, _check_directions)


# ------------------------------------------------------------------------------------------ per model file


def _projector(draft: DraftFile) -> Any:
    _, value = first_present(draft.config, (("dflash_config", "projector_type"), ("projector_type",)))
    return value


def _mixed_layer_types(config: Mapping[str, Any]) -> bool:
    types = lookup(config, ("layer_types",)) or []
    sliding = sum(t == "sliding_attention" for t in types)
    return 0 < sliding < len(types)


def _vllm_no_domino(draft, _rules, _options) -> list:
    # qwen3_dflash.py builds the plain DFlash body: no GRU correction head for prefix_gru.* / embed_proj.*.
    if _projector(draft) == DOMINO_PROJECTOR_TYPE:
        return [Finding(FAILS, "vLLM has no Domino correction head: qwen3_dflash.py builds the plain DFlash "
                               "body, so prefix_gru.* / embed_proj.* have nowhere to load (serve Domino with SGLang)")]
    return []


def _vllm_layer_types(draft, _rules, options: CheckOptions) -> list:
    # qwen3_dflash.py `_resolve_layer_attention`: mixed sliding/full layers need several KV-cache groups.
    if not _mixed_layer_types(draft.config):
        return []
    if options.vllm_v2_runner:
        return [Finding(CAVEAT, "mixed sliding/full layer_types: only vLLM's V2 model runner serves them "
                                "(VLLM_USE_V2_MODEL_RUNNER=1, set in the command below)")]
    return [Finding(FAILS, "mixed sliding/full layer_types: qwen3_dflash.py raises NotImplementedError under the V1 "
                           "model runner; serve with VLLM_USE_V2_MODEL_RUNNER=1 (check with --vllm-v2-runner)")]


def _vllm_reduced_vocab(draft, _rules, _options) -> list:
    """qwen3_dflash.py / qwen3_dspark.py: a draft vocabulary smaller than the target's needs the draft's own
    `lm_head.weight [draft_vocab_size, H]` and `d2t [draft_vocab_size]`, target id = draft id + d2t[id]."""
    vocab = draft.config.get("vocab_size")
    size = draft.config.get("draft_vocab_size")
    if size is None:
        return [Finding(FAILS, "ships d2t but no draft_vocab_size: vLLM builds no draft-to-target map")] \
            if "d2t" in draft.tensors else []
    if vocab is None or size >= vocab:
        return [Finding(FAILS, f"draft_vocab_size={size} is not below vocab_size={vocab}")] if size != vocab else []
    found = []
    head = draft.tensors.get("lm_head.weight")
    if head is None or head[1][0] != size:
        found.append(Finding(FAILS, f"draft_vocab_size={size} needs the draft's own lm_head.weight with {size} rows "
                                    f"(found {head[1] if head else 'none'}): the target's head cannot be shared"))
    found += _check_d2t(draft, size, vocab)
    return found


def _check_d2t(draft: DraftFile, size: int, vocab: int) -> list:
    offsets = read_int_tensor(draft, "d2t")
    if offsets is None:
        return [Finding(FAILS, f"draft_vocab_size={size} needs an integer d2t tensor (draft id -> target id offsets)")]
    if len(offsets) != size:
        return [Finding(FAILS, f"d2t has {len(offsets)} entries; draft_vocab_size is {size}")]
    targets = [i + d for i, d in enumerate(offsets)]
    outside = [t for t in targets if not 0 <= t < vocab]
    if outside:
        return [Finding(FAILS, f"d2t maps draft ids to target ids outside [0, {vocab}) (e.g. {outside[0]})")]
    if len(set(targets)) != len(targets):
        return [Finding(FAILS, "d2t maps two draft ids to the same target id")]
    mask = getattr(draft.trained, "mask_token_id", None)
    if mask is not None and mask not in set(targets):
        return [Finding(CAVEAT, f"the mask token {mask} is not in the draft vocabulary (d2t): it is embedded through "
                                "the target's table, but never proposed")]
    return []


_DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def _vllm_dflash2_fields(draft, _rules, _options) -> list:
    # qwen3_dflash2.py reads config.dflash_config[...] for each (a KeyError when one is missing).
    missing = [name for name in _DFLASH2_FIELDS if lookup(draft.config, ("dflash_config", name)) is None]
    return [Finding(FAILS, f"qwen3_dflash2.py reads dflash_config.{missing} (missing)")] if missing else []


def _vllm_dspark_head(draft, _rules, _options) -> list:
    # qwen3_dspark.py: `config.markov_rank` (top level) and only the vanilla head (markov_w1, markov_w2).
    found = []
    kind = first_present(draft.config, (("markov_head_type",), ("dflash_config", "markov_head_type")))[1]
    if kind not in (None, "vanilla"):
        found.append(Finding(FAILS, f"qwen3_dspark.py builds only the vanilla Markov head: the {kind} head's "
                                    "gate_proj / joint_proj have nowhere to load"))
    if not draft.config.get("markov_rank"):
        found.append(Finding(FAILS, "qwen3_dspark.py reads markov_rank at the top level (missing or 0)"))
    return found


def _sglang_domino(draft, _rules, _options) -> list:
    """dflash_utils.parse_dflash_draft_config: a Domino draft is a DFlashDraftModel with projector_type
    "domino", a bool shift_label, pure_draft_prefix_len 1, gru_hidden_dim and emb_dim (dflash_config first)."""
    if _projector(draft) != DOMINO_PROJECTOR_TYPE:
        return []
    get = lambda name: first_present(draft.config, (("dflash_config", name), (name,)))[1]  # noqa: E731
    found = []
    if not isinstance(get("shift_label"), bool):
        found.append(Finding(FAILS, f"Domino needs a bool dflash_config.shift_label (found {get('shift_label')!r})"))
    if get("pure_draft_prefix_len") != 1:
        found.append(Finding(FAILS, f"SGLang serves Domino only with pure_draft_prefix_len 1 (the draft has "
                                    f"{get('pure_draft_prefix_len')!r}: train with --dflash-domino-pure-draft-prefix-len 1)"))
    found += [Finding(FAILS, f"Domino needs dflash_config.{name}") for name in ("gru_hidden_dim", "emb_dim")
              if get(name) is None]
    return found


def _sglang_no_dflash2(draft, _rules, _options) -> list:
    # models/dflash.py (003b23d) builds no in-block convolution or candidate selector and skips unknown tensors.
    if any(lookup(draft.config, ("dflash_config", name)) for name in _DFLASH2_FIELDS):
        return [Finding(FAILS, "models/dflash.py builds no in-block convolutions or candidate selector (DFlash 2): "
                               "their tensors would be skipped and the plain backbone served")]
    return []


def _sglang_reduced_vocab(draft, _rules, _options) -> list:
    size, vocab = draft.config.get("draft_vocab_size"), draft.config.get("vocab_size")
    if size is not None and vocab is not None and size < vocab:
        return [Finding(CAVEAT, f"SGLang ignores draft_vocab_size={size} / d2t / lm_head: it drafts over the "
                                "target's whole vocabulary with the target's head")]
    return []


def _sglang_dspark(draft, _rules, _options) -> list:
    """models/dspark.py: build_markov_head (markov_rank > 0, vanilla / gated / rnn, markov_w2 with vocab_size
    rows) and build_confidence_head (on unless enable_confidence_head says otherwise)."""
    found = []
    rank = draft.config.get("markov_rank") or 0
    if rank <= 0:
        found.append(Finding(FAILS, "models/dspark.py needs markov_rank > 0 at the top level"))
    w2 = draft.tensors.get("markov_head.markov_w2.weight")
    vocab = draft.config.get("vocab_size")
    if w2 is not None and w2[1][0] != vocab:
        found.append(Finding(FAILS, f"models/dspark.py builds markov_w2 with vocab_size={vocab} rows; the file has "
                                    f"{w2[1][0]} (a reduced draft vocabulary is not served there)"))
    has_head = any(name.startswith("confidence_head.") for name in draft.tensors)
    if draft.config.get("enable_confidence_head") is None and not has_head:
        found.append(Finding(FAILS, "no enable_confidence_head: models/dspark.py builds the confidence head and "
                                    "refuses a file without its weights"))
    return found


# ------------------------------------------------------------------------------------------ in-block direction


def vllm_causal(config: Mapping[str, Any], layer: int) -> bool:
    """qwen3_dflash.py `_dflash_layer_causal`: top-level `is_causal`, else `dflash_config.causal`, else the
    layer is causal iff it is a sliding-window layer."""
    if config.get("is_causal") is not None:
        return bool(config["is_causal"])
    override = lookup(config, ("dflash_config", "causal"))
    if override is not None:
        return bool(override)
    types = config.get("layer_types") or []
    return layer < len(types) and types[layer] == "sliding_attention"


def sglang_causal(config: Mapping[str, Any], layer: int) -> bool:
    """models/dflash.py (003b23d) `_get_dflash_layer_attention_params`: no `layer_types` or a full-attention
    layer runs bidirectionally (ENCODER_ONLY), a sliding layer causally (DECODER); `is_causal` and
    `dflash_config.causal` are not read."""
    text = resolve_text_config(config)
    types = text.get("layer_types", config.get("layer_types")) or []
    return layer < len(types) and types[layer] == "sliding_attention"


# ------------------------------------------------------------------------------------------ serve commands


def _block(draft: DraftFile, rules: RuntimeRules) -> int:
    trained = getattr(draft.trained, "block_size", None)
    if trained is not None:
        return int(trained)
    value = first_present(draft.config, rules.block_size or (("dflash_config", "block_size"), ("block_size",)))[1]
    return int(value if value is not None else 16)


def _vllm_command(draft: DraftFile, model: str, target: str, options: CheckOptions) -> str:
    """`vllm serve` with `--speculative-config` (vLLM's documentation, the z-lab DFlash model cards): method
    "dflash" (DFlash and DFlash 2, told apart by architecture) with block_size - 1 speculative tokens, or
    DSpark's method with block_size (every slot proposes); DFlash's non-causal layers need flash_attn."""
    block = _block(draft, VLLM)
    dspark = model == "qwen3_dspark"
    spec = {"method": DSPARK_SERVING_METHOD if dspark else "dflash", "model": draft.directory,
            "num_speculative_tokens": block if dspark else block - 1}
    env = "VLLM_USE_V2_MODEL_RUNNER=1 " if options.vllm_v2_runner and _mixed_layer_types(draft.config) else ""
    return (f"{env}vllm serve {target} --speculative-config {shlex.quote(json.dumps(spec))} "
            "--attention-backend flash_attn")


def _sglang_command(draft: DraftFile, model: str, target: str, _options) -> str:
    """`python -m sglang.launch_server` with `--speculative-algorithm DFLASH` (`--speculative-num-draft-tokens`
    sets the block) or `DSPARK`; Domino's runtime wants bf16 weights (domino_utils.validate_domino_runtime)."""
    draft_path = shlex.quote(draft.directory)
    if model == "models/dspark.py":
        flags = f"--speculative-algorithm DSPARK --speculative-draft-model-path {draft_path}"
    else:
        flags = (f"--speculative-algorithm DFLASH --speculative-draft-model-path {draft_path} "
                 f"--speculative-num-draft-tokens {_block(draft, SGLANG)}")
    dtype = " --dtype bfloat16" if _projector(draft) == DOMINO_PROJECTOR_TYPE else ""
    return f"python -m sglang.launch_server --model-path {target} {flags}{dtype}"


# ------------------------------------------------------------------------------------------ the two runtimes

_VLLM_MASK = (("dflash_config", "mask_token_id"), ("eagle_config", "mask_token_id"), ("mask_token_id",))
_DFLASH2_APPLIES = tuple(("dflash_config", name) for name in HEAD_SETTINGS)

VLLM = RuntimeRules(
    name="vLLM",
    source="vllm-project/vllm: models/registry.py, qwen3_dflash.py @036a00d, qwen3_dflash2.py @030da62, "
           "qwen3_dspark.py @0302ff4, spec_decode/eagle/eagle3_utils.py",
    # registry.py _SPECULATIVE_DECODING_MODELS
    models={"DFlashDraftModel": "qwen3_dflash", "DFlash2DraftModel": "qwen3_dflash2",
            "Qwen3DSparkModel": "qwen3_dspark"},
    block_size=(),  # the proposer drafts num_speculative_tokens (+1 query slot), from the serve command
    block_size_default=None,
    # qwen3_dflash.py: drafter_config = eagle_config updated by dflash_config, then the top level
    mask_token_id=_VLLM_MASK,
    mask_fallback="None: the masked slots get no MASK embedding",
    # eagle3_utils.get_eagle3_aux_layers_from_config: `eagle_aux_hidden_state_layer_ids` are hidden-state
    # indices (index k = the output of layer k - 1); DFlash ids get + 1 to become one, so they tap layer id.
    taps=(TapSource(("eagle_aux_hidden_state_layer_ids",), -1), TapSource(("dflash_config", "target_layer_ids"), 0),
          TapSource(("dspark_target_layer_ids",), 0), TapSource(("target_layer_ids",), 0)),
    tap_fallback="the target model's own default aux layers",
    causal=vllm_causal,
    # qwen3_dflash.py / qwen3_dspark.py apply none of the head settings; qwen3_dflash2.py reads all three
    # from dflash_config.
    applies={"qwen3_dflash": (), "qwen3_dflash2": _DFLASH2_APPLIES, "qwen3_dspark": ()},
    checks={"qwen3_dflash": (_vllm_no_domino, _vllm_layer_types, _vllm_reduced_vocab),
            "qwen3_dflash2": (_vllm_dflash2_fields, _vllm_layer_types, _vllm_reduced_vocab),
            "qwen3_dspark": (_vllm_dspark_head, _vllm_layer_types, _vllm_reduced_vocab)},
    command=_vllm_command,
)


def _sglang_default_taps(draft: DraftFile) -> list[int]:
    """DFlashDraftConfig.resolve_target_layer_ids without a tap list: DFlash's formula over num_target_layers
    (dflash_config first, then the top level, else the draft's depth) and the draft's depth."""
    layers = int(draft.config.get("num_hidden_layers") or 1)
    target = first_present(draft.config, (("dflash_config", "num_target_layers"), ("num_target_layers",)))[1]
    return default_target_layer_ids(int(target or layers), layers)


SGLANG = RuntimeRules(
    name="SGLang",
    source="sgl-project/sglang: models/dflash.py @003b23d, models/dspark.py @01f4762, "
           "speculative/dflash_utils.py @00731f0, speculative/domino_utils.py @04d4c1a",
    models={"DFlashDraftModel": "models/dflash.py", "Qwen3DSparkModel": "models/dspark.py"},  # their EntryClass
    # dflash_utils.parse_dflash_draft_config: every field from dflash_config first, then the top level
    block_size=(("dflash_config", "block_size"), ("block_size",)),
    block_size_default=16,
    mask_token_id=(("dflash_config", "mask_token_id"), ("mask_token_id",)),
    mask_fallback="the token string '<|MASK|>' (dflash_config.mask_token)",
    # SGLang captures "before layer i + 1": a stored id i taps layer i's output
    taps=(TapSource(("dflash_config", "target_layer_ids"), 0), TapSource(("target_layer_ids",), 0)),
    tap_fallback="DFlash's default formula",
    causal=sglang_causal,
    # parse_dflash_draft_config reads output_multiplier / final_logit_softcapping from dflash_config only, and no
    # input_embedding_scale
    applies={"models/dflash.py": (("dflash_config", "output_multiplier"),
                                  ("dflash_config", "final_logit_softcapping")),
             "models/dspark.py": (("dflash_config", "output_multiplier"),
                                  ("dflash_config", "final_logit_softcapping"))},
    checks={"models/dflash.py": (_sglang_domino, _sglang_no_dflash2, _sglang_reduced_vocab),
            "models/dspark.py": (_sglang_dspark,)},
    command=_sglang_command,
    tap_default=_sglang_default_taps,
)

RUNTIMES = (VLLM, SGLANG)


# ------------------------------------------------------------------------------------------ the target


def _tokenizer_ids(target_dir: str) -> Optional[set]:
    """Every token id of the target's `tokenizer.json` (model vocabulary and added tokens), None without one."""
    path = os.path.join(target_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    data = read_json_object(path)
    vocab = (data.get("model") or {}).get("vocab") or {}
    ids = set(vocab.values()) if isinstance(vocab, Mapping) else set(range(len(vocab)))  # Unigram: a list
    return ids | {int(t["id"]) for t in data.get("added_tokens") or []}


def target_findings(draft: DraftFile, target_dir: Optional[str]) -> list:
    """What breaks under every runtime: the MASK token outside the target's vocabulary, and a draft made for
    another target (vocabulary, hidden size, depth). Without a target, the MASK token against the draft's
    record of the target vocabulary."""
    config = draft.config
    mask = first_present(config, (("dflash_config", "mask_token_id"), ("mask_token_id",)))[1]
    if target_dir is None:
        vocab = config.get("vocab_size")
        if mask is not None and vocab is not None and not 0 <= int(mask) < int(vocab):
            return [Finding(FAILS, f"mask_token_id {mask} is not a row of the target's embedding (vocab_size {vocab})")]
        return []
    text = resolve_text_config(read_json_object(os.path.join(target_dir, "config.json")))
    found = []
    for name, draft_value, target_value in (
        ("vocab_size", config.get("vocab_size"), text.get("vocab_size")),
        ("hidden_size", config.get("target_hidden_size") or config.get("hidden_size"), text.get("hidden_size")),
        ("num_target_layers / num_hidden_layers",
         first_present(config, (("dflash_config", "num_target_layers"), ("num_target_layers",)))[1],
         text.get("num_hidden_layers")),
    ):
        if draft_value is not None and target_value is not None and int(draft_value) != int(target_value):
            found.append(Finding(FAILS, f"target {name}: the draft has {draft_value}, {target_dir} has {target_value}"))
    if mask is not None and text.get("vocab_size") is not None and not 0 <= int(mask) < int(text["vocab_size"]):
        found.append(Finding(FAILS, f"mask_token_id {mask} is not a row of the target's embedding "
                                    f"(vocab_size {text['vocab_size']})"))
    ids = _tokenizer_ids(target_dir)
    if mask is not None and ids is not None and int(mask) not in ids:
        found.append(Finding(FAILS, f"mask_token_id {mask} is no token of the target's tokenizer.json"))
    return found


# ------------------------------------------------------------------------------------------ the check


def check_runtime(draft: DraftFile, rules: RuntimeRules, options: CheckOptions, shared: list,
                  target: str) -> RuntimeReport:
    """One runtime's verdict on a draft: its registry, its readings against the trained ones, its model file's
    checks, and the `shared` findings (the target's, this package's own reading)."""
    report = RuntimeReport(runtime=rules.name, source=rules.source, verdict=LOADS)
    model = rules.models.get(draft.architecture)
    if model is None:
        hint = (" (write the SGLang label with `convert_checkpoint.py to-hf --export-for sglang`)"
                if draft.architecture == DOMINO_ARCHITECTURE and rules is SGLANG else "")
        report.findings.append(Finding(FAILS, f"registers no {draft.architecture!r} architecture (it registers "
                                              f"{', '.join(sorted(rules.models))}){hint}"))
    else:
        for check in (*_GENERIC_CHECKS, *rules.checks.get(model, ())):
            report.findings += check(draft, rules, options)
        report.findings += _check_head_settings(draft, rules, model)
    report.findings += shared
    report.verdict = max((f.level for f in report.findings), key=_SEVERITY.__getitem__, default=LOADS)
    if report.verdict != FAILS:
        report.command = rules.command(draft, model, target, options)
    return report


def check_serving(directory: str, target: Optional[str] = None, *, vllm_v2_runner: bool = False,
                  runtimes: Sequence[RuntimeRules] = RUNTIMES) -> list[RuntimeReport]:
    """Per runtime: whether the HF draft in `directory` loads (`LOADS`, `CAVEAT`, `FAILS`), why, and its serve
    command (for a draft that loads). `target`: the target's HF directory (config.json, tokenizer.json)."""
    draft = read_draft_file(directory)
    if draft.file_error is not None:  # malformed, or its config contradicts its weights: no runtime loads it
        return [RuntimeReport(runtime=rules.name, source=rules.source, verdict=FAILS,
                              findings=[Finding(FAILS, draft.file_error)]) for rules in runtimes]
    shared = target_findings(draft, target)
    if draft.trained_error is not None:
        shared.append(Finding(FAILS, f"this package does not read it as a draft, so what it was trained with is "
                                     f"unknown: {draft.trained_error}"))
    shown_target = shlex.quote(os.path.abspath(target)) if target else "<target>"
    options = CheckOptions(vllm_v2_runner=vllm_v2_runner)
    return [check_runtime(draft, rules, options, shared, shown_target) for rules in runtimes]


def exit_status(reports: Sequence[RuntimeReport]) -> int:
    """0 when every runtime loads the draft (caveats included), 1 when one does not."""
    return 1 if any(r.verdict == FAILS for r in reports) else 0


def report_lines(directory: str, reports: Sequence[RuntimeReport]) -> list[str]:
    """The console report: per runtime its verdict and reasons, then the serve commands."""
    lines = [f"serving check of {directory}"]
    for report in reports:
        lines.append(f"{report.runtime}: {report.verdict}")
        lines.append(f"  (as read by {report.source})")
        lines += [f"  - {'caveat' if f.level == CAVEAT else 'does not load'}: {f.reason}" for f in report.findings]
    lines.append("serve commands:")
    for report in reports:
        lines.append(f"  # {report.runtime}")
        lines.append(f"  {report.command}" if report.command else f"  (not served by {report.runtime}: see above)")
    return lines


# ------------------------------------------------------------------------------------------ the SGLang label


def sglang_config(config: Mapping[str, Any]) -> tuple[dict, Optional[str]]:
    """`config.json` as SGLang reads it, and what changed (None: nothing).

    Only Domino's label differs: SGLang registers no `DominoDraftModel` and serves Domino as a
    `DFlashDraftModel` with `dflash_config.projector_type: "domino"` (dflash_utils.parse_dflash_draft_config),
    which this package reads as Domino too. SGLang serves it only with `pure_draft_prefix_len` 1: a draft
    trained otherwise is refused (ValueError), relabelling cannot change what it was trained with.
    """
    out = json.loads(json.dumps(dict(config)))
    if (out.get("architectures") or [None])[0] != DOMINO_ARCHITECTURE:
        return out, None
    prefix = lookup(out, ("dflash_config", "pure_draft_prefix_len"))
    if prefix != 1:
        raise ValueError(f"SGLang serves Domino only with pure_draft_prefix_len 1; this draft was trained with "
                         f"{prefix!r} (train with --dflash-domino-pure-draft-prefix-len 1).")
    out["architectures"] = ["DFlashDraftModel"]
    out.setdefault("dflash_config", {})["projector_type"] = DOMINO_PROJECTOR_TYPE
    return out, f"architectures {DOMINO_ARCHITECTURE} -> DFlashDraftModel (dflash_config.projector_type " \
                f"{DOMINO_PROJECTOR_TYPE!r}), SGLang's Domino label"
