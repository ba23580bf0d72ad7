"""Will an exported draft load in vLLM and SGLang, and serve what it was trained as? (docs/design.md §19 Serving check)

A runtime reads a HF draft its own way: each looks for a field in its own places, numbers the target's
layers its own way and runs the in-block attention by its own rule, and a draft read differently from
how it was trained still loads and then accepts about one token per cycle. This module holds each
runtime's reading as data, one `RuntimeRules` per runtime and release (`RELEASES`):

* the architectures it registers and the model file each builds;
* where it reads `block_size`, `mask_token_id` and the tap list (first place present wins) and which
  target layer's output a stored id selects (`TapSource.tap_offset`);
* how it runs layer `i` in-block (causal or bidirectional), from the file;
* which of the head's output settings each model file applies;
* the checks that need more than a lookup (Domino's head, DFlash 2's fields, DSpark's Markov and
  confidence heads, sliding layers, a reduced draft vocabulary), per model file;
* its serve command, with its flags as its documentation gives them.

`check_serving(directory, target=..., versions=...)` compares every runtime's reading with this
package's reading of the same file (`checkpoint.architectures.config_from_dict`: what the draft was
trained with; taps are target layer ids whose *output* is tapped, docs/design.md §2 Conventions) and
returns per runtime: loads / loads with a caveat / does not load, with the runtime's own reason (the
line of its code that fails or misreads the file). It reads `config.json` and the safetensors headers
(and, for a reduced vocabulary, the `d2t` / `t2d` tensors); it never builds a model.

Releases encoded (each rule's text names its file and line; the table is in docs/design.md §19 Serving check):

* vLLM 0.34.0 (the default) and the commit-pinned rules it replaces, "036a00d" (`qwen3_dflash.py`
  @036a00d, `qwen3_dflash2.py` @030da62, `qwen3_dspark.py` @0302ff4, which still had the V1 model runner);
* SGLang 0.5.23 (the default) and "003b23d" (`models/dflash.py` @003b23d, `models/dspark.py` @01f4762,
  `speculative/dflash_utils.py` @00731f0, `speculative/domino_utils.py` @04d4c1a).

A previous release is one `dataclasses.replace` of the current rules: only the fields that differ.

Imports torch (through the variant modules' published names and the registry): command lines import it
after their arguments are checked.
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Optional, Sequence

from safetensors import SafetensorError, safe_open

from ..common.errors import CheckpointError
from ..common.safetensors_files import safetensors_files
from ..draft.config import default_target_layer_ids, resolve_text_config
from ..draft.draft_vocab import check_vocab_tensors
from ..variants.domino import DOMINO_ARCHITECTURE, DOMINO_PROJECTOR_TYPE
from ..variants.dspark import DSPARK_SERVING_METHOD
from .architectures import read_hf_draft_config, read_json_object

__all__ = [
    "LOADS", "CAVEAT", "FAILS", "Finding", "RuntimeReport", "RuntimeRules", "TapSource", "RUNTIMES", "RELEASES",
    "VLLM", "SGLANG", "VLLM_036A00D", "SGLANG_003B23D", "DraftFile", "read_draft_file", "check_serving",
    "runtime_rules", "report_lines", "sglang_config", "exit_status",
]

LOADS, CAVEAT, FAILS = "loads", "loads with a caveat", "does not load"
_SEVERITY = {LOADS: 0, CAVEAT: 1, FAILS: 2}
# The settings of the target head's output transform (docs/design.md §2) and their neutral values.
HEAD_SETTINGS = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None}
Path = tuple[str, ...]
_BLOCK_PATHS: tuple[Path, ...] = (("dflash_config", "block_size"), ("block_size",))


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
    """How one release of a runtime reads a draft directory (module docstring); every field is data a test can
    read. Reasons name the runtime's file and line, so a "does not load" says what in its code fails."""

    name: str
    version: str  # the release these rules encode, printed with each verdict
    source: str
    registry: str  # where its architecture registry is, for a name it does not register
    models: Mapping[str, str]  # architectures[0] -> the model file (class) it builds
    foreign: Mapping[str, str]  # names it registers for another model family -> what it builds for them
    block_source: str  # where it takes the block from, for a file that does not say it (or says it twice)
    block_level: str  # FAILS: it reads a block from the file and serves it; CAVEAT: the serve command says it
    block_size_default: Mapping[str, int]  # model file -> the block it uses when the file has none
    mask_token_id: Sequence[Path]
    mask_rule: str  # where its code reads it (file:line)
    mask_fallback: str  # what it uses without a mask_token_id
    taps: Sequence[TapSource]
    taps_rule: str  # where its code reads them (file:line)
    tap_fallback: str  # what it uses without a tap list
    causal: Callable[[Mapping[str, Any], int], bool]  # layer i runs causal in-block
    causal_rule: str  # that rule in words, with its file:line
    applies: Mapping[str, Sequence[Path]]  # model file -> places of the head settings it applies
    checks: Mapping[str, Sequence[Callable[["DraftFile", "RuntimeRules", "CheckOptions"], list]]]
    command: Callable[["DraftFile", str, str, "CheckOptions"], str]
    tap_default: Optional[Callable[["DraftFile"], list]] = None  # its tap list when the file has none

    @property
    def label(self) -> str:
        return f"{self.name} {self.version}"


@dataclass
class CheckOptions:
    vllm_v2_runner: bool = False  # vLLM 036a00d started with VLLM_USE_V2_MODEL_RUNNER=1 (0.34.0 has no other)


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
    version: str
    source: str
    verdict: str
    findings: list = field(default_factory=list)
    command: Optional[str] = None

    def to_json(self) -> dict:
        return {"runtime": self.runtime, "version": self.version, "source": self.source, "verdict": self.verdict,
                "command": self.command,
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


def read_tensor(draft: DraftFile, name: str):
    """The tensor ``name`` of the draft as stored (any dtype, any shape), or None when the draft has none."""
    if name not in draft.tensors:
        return None
    with safe_open(draft.tensors[name][2], framework="pt") as f:
        return f.get_tensor(name)


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


# ------------------------------------------------------------------------------------ the checks every runtime gets


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
        return [Finding(FAILS, f"taps the outputs of target layers {served} (read from {where}, {rules.taps_rule}); "
                               f"the draft was trained on {list(trained)}{detail}")]
    return []


def file_block_size(config: Mapping[str, Any]) -> tuple[Optional[int], Optional[str]]:
    """(the block size the file records, None) or (None, what is wrong): absent at both places, or
    `dflash_config.block_size` and the top-level `block_size` disagreeing (readers differ in which they take)."""
    nested, top = lookup(config, _BLOCK_PATHS[0]), lookup(config, _BLOCK_PATHS[1])
    if nested is None and top is None:
        return None, "config.json has no block_size (neither dflash_config.block_size nor the top level)"
    if nested is not None and top is not None and nested != top:
        return None, (f"dflash_config.block_size {nested} and the top-level block_size {top} differ (readers differ "
                      "in which one they take, so which one the draft was trained with is not clear)")
    return int(nested if nested is not None else top), None


def _check_block_size(draft: DraftFile, rules: RuntimeRules, _options, model: str = "") -> list:
    problem = file_block_size(draft.config)[1]
    if problem is None:
        return []
    absent = all(lookup(draft.config, p) is None for p in _BLOCK_PATHS)
    fallback = rules.block_size_default.get(model) if absent else None
    served = f" (here: {fallback})" if fallback is not None else ""
    fix = ("write one block size at both places (convert_checkpoint.py to-hf does) or give the trained one in the "
           "serve command")
    return [Finding(rules.block_level, f"{problem}: {rules.block_source}{served}; {fix}")]


def _check_mask(draft: DraftFile, rules: RuntimeRules, _options) -> list:
    path, value = first_present(draft.config, rules.mask_token_id)
    if value is None:
        return [Finding(FAILS, f"reads no mask_token_id ({', '.join(_dotted(p) for p in rules.mask_token_id)}) "
                               f"and falls back to {rules.mask_fallback}")]
    trained = getattr(draft.trained, "mask_token_id", None)
    if trained is not None and int(value) != int(trained):
        return [Finding(FAILS, f"reads mask_token_id {value} ({_dotted(path)}, {rules.mask_rule}); the draft was "
                               f"trained with {trained}")]
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
    return [Finding(FAILS, f"runs draft layer(s) {wrong} {how(served[wrong[0]])} in-block ({rules.causal_rule}); "
                           f"the draft was trained {how(trained[wrong[0]])} there")]


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


_GENERIC_CHECKS = (_check_taps, _check_mask, _check_directions)


# ------------------------------------------------------------------------------------------ per model file


def _projector(draft: DraftFile) -> Any:
    _, value = first_present(draft.config, (("dflash_config", "projector_type"), ("projector_type",)))
    return value


def _layer_types(config: Mapping[str, Any]) -> list:
    types = lookup(config, ("layer_types",))
    return list(types) if isinstance(types, (list, tuple)) else []


def _mixed_layer_types(config: Mapping[str, Any]) -> bool:
    types = _layer_types(config)
    sliding = sum(t == "sliding_attention" for t in types)
    return 0 < sliding < len(types)


_VLLM_LOADER = ("its AutoWeightsLoader raises on a tensor it has no parameter for "
                "(model_executor/models/utils.py:452-459)")


def _vllm_no_domino(draft, _rules, _options) -> list:
    domino_tensors = any(n.startswith(("prefix_gru.", "embed_proj.")) for n in draft.tensors)
    if _projector(draft) == DOMINO_PROJECTOR_TYPE or domino_tensors:
        return [Finding(FAILS, "vLLM has no Domino correction head: qwen3_dflash.py builds the plain DFlash body "
                               f"and {_VLLM_LOADER}: prefix_gru.* / embed_proj.* (serve Domino with SGLang)")]
    return []


def _vllm_no_dflash2_under_dflash(draft, _rules, _options) -> list:
    selector = sorted(n for n in draft.tensors if n.startswith("candidate_selector."))
    if selector or any(lookup(draft.config, ("dflash_config", n)) for n in _DFLASH2_FIELDS):
        return [Finding(FAILS, "labelled DFlashDraftModel, it is built by qwen3_dflash.py, which has no in-block "
                               f"convolutions or candidate selector (DFlash 2), and {_VLLM_LOADER}"
                               f"{': ' + selector[0] if selector else ''}; label it DFlash2DraftModel")]
    return []


def _vllm_layer_types_v1(draft, _rules, options: CheckOptions) -> list:
    # qwen3_dflash.py @036a00d `_resolve_layer_attention`: mixed sliding/full layers need several KV-cache groups.
    if not _mixed_layer_types(draft.config):
        return []
    if options.vllm_v2_runner:
        return [Finding(CAVEAT, "mixed sliding/full layer_types: only vLLM's V2 model runner serves them "
                                "(VLLM_USE_V2_MODEL_RUNNER=1, set in the command below)")]
    return [Finding(FAILS, "mixed sliding/full layer_types: qwen3_dflash.py raises NotImplementedError under the V1 "
                           "model runner; serve with VLLM_USE_V2_MODEL_RUNNER=1 (check with --vllm-v2-runner)")]


def _sliding_layers(config: Mapping[str, Any]) -> list[int]:
    """vLLM 0.34.0 qwen3_dflash.py:137-187 `_resolve_layer_attention`: the sliding layers (`dflash_config.use_swa`
    makes every layer sliding unless `layer_types` names some)."""
    types = _layer_types(config)
    if lookup(config, ("dflash_config", "use_swa")) and "sliding_attention" not in types:
        return list(range(int(config.get("num_hidden_layers") or 0)))
    return [i for i, t in enumerate(types) if t == "sliding_attention"]


def _vllm_sliding_window(draft, _rules, _options) -> list:
    # vLLM 0.34.0 has only the V2 model runner (platforms/interface.py:1481-1490): mixed layer types load, and
    # each sliding layer takes dflash_config.swa_window_size, else the top-level sliding_window.
    layers = _sliding_layers(draft.config)
    window = first_present(draft.config, (("dflash_config", "swa_window_size"), ("sliding_window",)))[1]
    if layers and window is None:
        return [Finding(FAILS, f"sliding layer(s) {layers} have no window: qwen3_dflash.py:176-185 raises ValueError "
                               "(it reads dflash_config.swa_window_size, else the top-level sliding_window)")]
    return []


def _sglang_sliding_window(draft, _rules, _options) -> list:
    types = _layer_types(draft.config)
    if "sliding_attention" in types and resolve_text_config(draft.config).get("sliding_window") is None:
        return [Finding(FAILS, "sliding_attention layers without sliding_window: speculative/dflash_utils.py:400-413 "
                               "raises ValueError (it reads the top-level sliding_window only)")]
    return []


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
    # The check this package's loader applies (draft.draft_vocab.check_vocab_tensors): a d2t / t2d it refuses is
    # not a draft vocabulary it could have trained, whatever vLLM's buffer copy would take.
    d2t = read_tensor(draft, "d2t")
    if d2t is None:
        return [Finding(FAILS, f"draft_vocab_size={size} needs an integer d2t tensor (draft id -> target id offsets)")]
    try:
        targets = check_vocab_tensors(d2t, read_tensor(draft, "t2d"), draft_vocab_size=size,
                                      target_vocab_size=vocab).ids.tolist()
    except CheckpointError as err:
        return [Finding(FAILS, f"{err} (this package's loader refuses it too)")]
    mask = getattr(draft.trained, "mask_token_id", None)
    if mask is not None and mask not in set(targets):
        return [Finding(CAVEAT, f"the mask token {mask} is not in the draft vocabulary (d2t): it is embedded through "
                                "the target's table, but never proposed")]
    return []


_DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def _vllm_dflash2_fields(draft, _rules, _options) -> list:
    missing = [name for name in _DFLASH2_FIELDS if lookup(draft.config, ("dflash_config", name)) is None]
    return [Finding(FAILS, f"qwen3_dflash2.py:254-255, 534-535 read dflash_config.{missing} (missing: a KeyError)")] \
        if missing else []


_MARKOV_EXTRA = {"gated": "markov_head.gate_proj.", "rnn": "markov_head.joint_proj."}  # beyond markov_w1 / markov_w2


def _markov_kind_of_tensors(draft: DraftFile) -> str:
    """The Markov head the file's tensors are of: "gated", "rnn" or "vanilla"."""
    for kind, prefix in _MARKOV_EXTRA.items():
        if any(name.startswith(prefix) for name in draft.tensors):
            return kind
    return "vanilla"


def _vllm_dspark_head(draft, _rules, _options) -> list:
    # qwen3_dspark.py: only the vanilla head (DSparkMarkovHead, markov_w1 / markov_w2), `config.markov_rank`.
    found = []
    kind = _markov_kind_of_tensors(draft)
    if kind == "vanilla":
        kind = first_present(draft.config, (("markov_head_type",), ("dflash_config", "markov_head_type")))[1] or kind
    if kind != "vanilla":
        found.append(Finding(FAILS, f"qwen3_dspark.py builds only the vanilla Markov head (DSparkMarkovHead, :49-94): "
                                    f"the {kind} head's {_MARKOV_EXTRA.get(kind, 'markov_head.')}* have no parameter, "
                                    f"and {_VLLM_LOADER}"))
    if not draft.config.get("markov_rank"):
        found.append(Finding(FAILS, "qwen3_dspark.py:210-213 reads config.markov_rank at the top level (missing or 0)"))
    return found


def _sglang_domino(draft, _rules, _options) -> list:
    """dflash_utils.parse_dflash_draft_config: a Domino draft is a DFlashDraftModel with projector_type
    "domino", a bool shift_label, pure_draft_prefix_len 1, gru_hidden_dim and emb_dim (dflash_config first)."""
    if _projector(draft) != DOMINO_PROJECTOR_TYPE:
        if any(name.startswith(("prefix_gru.", "embed_proj.")) for name in draft.tensors):
            return [Finding(FAILS, "the file has Domino's prefix_gru.* / embed_proj.* but no projector_type "
                                   "\"domino\": models/dflash.py:923-929 raises ValueError")]
        return []
    get = lambda name: first_present(draft.config, (("dflash_config", name), (name,)))[1]  # noqa: E731
    found = []
    if not isinstance(get("shift_label"), bool):
        found.append(Finding(FAILS, f"Domino needs a bool dflash_config.shift_label (found {get('shift_label')!r}): "
                                    "speculative/dflash_utils.py:774-778 raises ValueError"))
    if get("pure_draft_prefix_len") != 1:
        found.append(Finding(FAILS, f"SGLang serves Domino only with pure_draft_prefix_len 1 (the draft has "
                                    f"{get('pure_draft_prefix_len')!r}: speculative/dflash_utils.py:779-783 raises; "
                                    "train with --dflash-domino-pure-draft-prefix-len 1)"))
    found += [Finding(FAILS, f"Domino needs dflash_config.{name} (speculative/dflash_utils.py:784-787 raises)")
              for name in ("gru_hidden_dim", "emb_dim") if get(name) is None]
    return found


def _sglang_no_dflash2(draft, _rules, _options) -> list:
    # models/dflash.py (003b23d) builds no in-block convolution or candidate selector and skips unknown tensors.
    if any(lookup(draft.config, ("dflash_config", name)) for name in _DFLASH2_FIELDS):
        return [Finding(FAILS, "models/dflash.py builds no in-block convolutions or candidate selector (DFlash 2): "
                               "their tensors would be skipped and the plain backbone served")]
    return []


def _sglang_dflash2_under_dflash(draft, _rules, _options) -> list:
    # 0.5.23: DFlashDraftModel builds the convolutions (models/dflash.py:718-727) but only DFlash2DraftModel
    # (:1264-1283) has the candidate selector; load_weights skips a tensor it has no parameter for (:942-946).
    selector = any(name.startswith("candidate_selector.") for name in draft.tensors)
    if selector or lookup(draft.config, ("dflash_config", "selector_rank")):
        return [Finding(FAILS, "labelled DFlashDraftModel, models/dflash.py builds no candidate selector (only "
                               "DFlash2DraftModel, :1264-1283, does) and load_weights skips candidate_selector.* "
                               "(:942-946): the plain backbone is served; label it DFlash2DraftModel")]
    return []


def _sglang_dflash2_fields(draft, _rules, _options) -> list:
    get = lambda name: lookup(draft.config, ("dflash_config", name))  # noqa: E731
    found = []
    if not get("selector_rank"):
        found.append(Finding(FAILS, "models/dflash.py:1270-1273 raises ValueError without dflash_config.selector_rank"))
    if bool(get("conv_kernel_size")) != bool(get("conv_group_size")) or bool(get("selector_rank")) != bool(
            get("selector_top_k")):
        found.append(Finding(FAILS, "speculative/dflash_utils.py:630-650 needs conv_kernel_size with conv_group_size "
                                    "and selector_rank with selector_top_k (dflash_config): a ValueError"))
    return found


def _sglang_reduced_vocab(draft, _rules, _options) -> list:
    size, vocab = draft.config.get("draft_vocab_size"), draft.config.get("vocab_size")
    if size is not None and vocab is not None and size < vocab:
        return [Finding(CAVEAT, f"SGLang ignores draft_vocab_size={size} / d2t / lm_head: it drafts over the "
                                "target's whole vocabulary with the target's head")]
    return []


def _sglang_dspark_003b23d(draft, _rules, _options) -> list:
    """models/dspark.py @01f4762: build_markov_head (markov_rank > 0, vanilla / gated / rnn, markov_w2 with
    vocab_size rows) and build_confidence_head (on unless enable_confidence_head says otherwise)."""
    found = _sglang_markov_w2(draft)
    if (draft.config.get("markov_rank") or 0) <= 0:
        found.append(Finding(FAILS, "models/dspark.py needs markov_rank > 0 at the top level"))
    has_head = any(name.startswith("confidence_head.") for name in draft.tensors)
    if draft.config.get("enable_confidence_head") is None and not has_head:
        found.append(Finding(FAILS, "no enable_confidence_head: models/dspark.py builds the confidence head and "
                                    "refuses a file without its weights"))
    return found


def _sglang_markov_w2(draft: DraftFile) -> list:
    w2 = draft.tensors.get("markov_head.markov_w2.weight")
    vocab = draft.config.get("vocab_size")
    if w2 is not None and w2[1][0] != vocab:
        return [Finding(FAILS, f"models/dspark.py:199 builds markov_w2 with vocab_size={vocab} rows; the file has "
                               f"{w2[1][0]} (a reduced draft vocabulary is not served there)")]
    return []


def _sglang_dspark(draft, _rules, _options) -> list:
    """0.5.23 models/dspark.py: `build_markov_head` (:385-405) reads `markov_rank` and `markov_head_type` from the
    top level only (default "vanilla"), while `parse_dspark_draft_config` (dspark_config.py:239-267) reads them
    from dflash_config first and refuses a Markov head without a type; `build_confidence_head` (:487-509) builds
    none under SGLANG_RAGGED_VERIFY_MODE=static (its default, environ.py:1572) and otherwise one whatever
    enable_confidence_head says."""
    config, found = draft.config, _sglang_markov_w2(draft)
    nested = lambda name: lookup(config, ("dflash_config", name))  # noqa: E731
    if (config.get("markov_rank") or 0) <= 0:
        where = (f" (dflash_config has {nested('markov_rank')}: write it at the top level)"
                 if nested("markov_rank") else "")
        found.append(Finding(FAILS, f"models/dspark.py:386-390 reads markov_rank at the top level: missing or 0 is a "
                                    f"ValueError{where}"))
    kind = first_present(config, (("dflash_config", "markov_head_type"), ("markov_head_type",)))[1]
    if kind is None and not any(str(k).startswith("dspark_") for k in config):
        found.append(Finding(FAILS, "no markov_head_type: speculative/dspark_components/dspark_config.py:263-267 "
                                    "raises ValueError for a Markov head without its type"))
    built, stored = str(config.get("markov_head_type") or "vanilla").lower(), _markov_kind_of_tensors(draft)
    if built != stored or (kind is not None and str(kind).lower() != built):
        found.append(Finding(FAILS, f"models/dspark.py:392 builds the {built} Markov head from the top-level "
                                    f"markov_head_type ({config.get('markov_head_type')!r}; dflash_config has "
                                    f"{nested('markov_head_type')!r}) for a file of the {stored} head: load_weights "
                                    "raises 'DSpark unexpected markov weight' (:653-658) or leaves weights unloaded; "
                                    "write markov_head_type at the top level"))
    if any(name.startswith("confidence_head.") for name in draft.tensors):
        found.append(Finding(CAVEAT, "the confidence head is not used: under SGLANG_RAGGED_VERIFY_MODE=static (the "
                                     "default, environ.py:1572) models/dspark.py:488-489 builds none and skips its "
                                     "weights; another mode builds and loads it"))
    else:
        found.append(Finding(CAVEAT, "no confidence head: only SGLANG_RAGGED_VERIFY_MODE=static (the default) serves "
                                     "it; another mode builds one whatever enable_confidence_head says and refuses the "
                                     "file (models/dspark.py:487-509, 684-696)"))
    return found


# ------------------------------------------------------------------------------------------ in-block direction


def vllm_causal(config: Mapping[str, Any], layer: int) -> bool:
    """qwen3_dflash.py `_dflash_layer_causal` (0.34.0: :86-97): top-level `is_causal`, else
    `dflash_config.causal`, else the layer is causal iff it is a sliding-window layer."""
    if config.get("is_causal") is not None:
        return bool(config["is_causal"])
    override = lookup(config, ("dflash_config", "causal"))
    if override is not None:
        return bool(override)
    types = _layer_types(config)
    return layer < len(types) and types[layer] == "sliding_attention"


def sglang_causal(config: Mapping[str, Any], layer: int) -> bool:
    """0.5.23 models/dflash.py:157-190: without `layer_types` every layer runs bidirectionally (ENCODER_ONLY);
    with them the (text config's) `is_causal` decides when present, else a sliding layer runs causally and a
    full-attention layer bidirectionally. `dflash_config.causal` is not read."""
    text = resolve_text_config(config)
    types = text.get("layer_types", config.get("layer_types"))
    if not isinstance(types, (list, tuple)):
        return False
    if text.get("is_causal") is not None:
        return bool(text["is_causal"])
    return layer < len(types) and types[layer] == "sliding_attention"


def sglang_causal_003b23d(config: Mapping[str, Any], layer: int) -> bool:
    """models/dflash.py @003b23d `_get_dflash_layer_attention_params`: no `layer_types` or a full-attention
    layer runs bidirectionally (ENCODER_ONLY), a sliding layer causally (DECODER); `is_causal` and
    `dflash_config.causal` are not read."""
    text = resolve_text_config(config)
    types = text.get("layer_types", config.get("layer_types")) or []
    return layer < len(types) and types[layer] == "sliding_attention"


# ------------------------------------------------------------------------------------------ serve commands


def _vllm_command(draft: DraftFile, model: str, target: str, _options) -> str:
    """`vllm serve` with `--speculative-config` (vLLM's documentation, the z-lab DFlash model cards): method
    "dflash" (DFlash and DFlash 2, told apart by architecture) with block_size - 1 speculative tokens, or
    DSpark's method with block_size (every slot proposes); DFlash's non-causal layers need flash_attn. A file
    that does not say its block (`file_block_size`) gets a placeholder vLLM refuses, never a guessed number."""
    block = file_block_size(draft.config)[0]
    dspark = model == "qwen3_dspark"
    tokens: Any = (block if dspark else block - 1) if block is not None else \
        ("BLOCK_SIZE" if dspark else "BLOCK_SIZE-1")
    spec = {"method": DSPARK_SERVING_METHOD if dspark else "dflash", "model": draft.directory,
            "num_speculative_tokens": tokens}
    return (f"vllm serve {target} --speculative-config {shlex.quote(json.dumps(spec))} "
            "--attention-backend flash_attn")


def _vllm_command_036a00d(draft: DraftFile, model: str, target: str, options: CheckOptions) -> str:
    env = "VLLM_USE_V2_MODEL_RUNNER=1 " if options.vllm_v2_runner and _mixed_layer_types(draft.config) else ""
    return env + _vllm_command(draft, model, target, options)


def _sglang_command(draft: DraftFile, model: str, target: str, _options) -> str:
    """`python -m sglang.launch_server` with `--speculative-algorithm DFLASH` (`--speculative-num-draft-tokens`
    sets the block) or `DSPARK` (its block from the file); Domino's runtime wants bf16 weights
    (domino_utils.validate_domino_runtime)."""
    draft_path = shlex.quote(draft.directory)
    if model == "models/dspark.py":
        flags = f"--speculative-algorithm DSPARK --speculative-draft-model-path {draft_path}"
    else:
        block = file_block_size(draft.config)[0]
        flags = (f"--speculative-algorithm DFLASH --speculative-draft-model-path {draft_path} "
                 f"--speculative-num-draft-tokens {block if block is not None else 'BLOCK_SIZE'}")
    dtype = " --dtype bfloat16" if _projector(draft) == DOMINO_PROJECTOR_TYPE else ""
    return f"python -m sglang.launch_server --model-path {target} {flags}{dtype}"


# ------------------------------------------------------------------------------------ the runtimes and their releases

_VLLM_MASK = (("dflash_config", "mask_token_id"), ("eagle_config", "mask_token_id"), ("mask_token_id",))
_DFLASH2_APPLIES = tuple(("dflash_config", name) for name in HEAD_SETTINGS)
# eagle3_utils.get_eagle3_aux_layers_from_config: `eagle_aux_hidden_state_layer_ids` are hidden-state indices
# (index k = the output of layer k - 1); DFlash ids get + 1 to become one, so they tap layer id.
_VLLM_TAPS_036A00D = (TapSource(("eagle_aux_hidden_state_layer_ids",), -1),
                      TapSource(("dflash_config", "target_layer_ids"), 0), TapSource(("dspark_target_layer_ids",), 0),
                      TapSource(("target_layer_ids",), 0))

VLLM = RuntimeRules(
    name="vLLM",
    version="0.34.0",
    source="vllm 0.34.0: model_executor/models/registry.py, qwen3_dflash.py, qwen3_dflash2.py, qwen3_dspark.py, "
           "v1/worker/gpu/spec_decode/eagle/eagle3_utils.py, dflash/config.py, dspark/config.py",
    registry="model_executor/models/registry.py:677-780 (_SPECULATIVE_DECODING_MODELS; method \"dflash\" looks up "
             "'DFlash' + a name that neither starts nor ends with DFlash, transformers_utils/configs/eagle.py:65-76)",
    models={"DFlashDraftModel": "qwen3_dflash", "DFlash2DraftModel": "qwen3_dflash2",
            "Qwen3DSparkModel": "qwen3_dspark"},
    foreign={"DSparkDraftModel": "DeepSeek-V4's DSpark drafter (vllm.models.deepseek_v4, registry.py:702)",
             "K3DSparkModel": "Kimi K3's DSpark MLA drafter (vllm.models.kimi_k3, registry.py:718-721)",
             "Gemma4DSparkModel": "Gemma 4's DSpark drafter (gemma4_dspark, registry.py:731)"},
    block_source="vLLM takes the block from the serve command (num_speculative_tokens + 1 slots, "
                 "v1/worker/gpu/spec_decode/dflash/config.py:53-56; DSpark's width defaults to the top-level "
                 "block_size, dspark/config.py:78-85), so the command below leaves it for you to fill in",
    block_level=CAVEAT,
    block_size_default={},
    # qwen3_dflash.py:475-498: drafter_config = eagle_config updated by dflash_config, then the top level
    mask_token_id=_VLLM_MASK,
    mask_rule="qwen3_dflash.py:475-498",
    mask_fallback="None (qwen3_dflash.py:496-498): the masked slots get no MASK embedding",
    # 0.34.0 adds dflash_config.layer_ids / eagle_config.layer_ids, hidden-state indices (eagle3_utils.py:131-137)
    taps=(*_VLLM_TAPS_036A00D, TapSource(("dflash_config", "layer_ids"), -1),
          TapSource(("eagle_config", "layer_ids"), -1)),
    taps_rule="v1/worker/gpu/spec_decode/eagle/eagle3_utils.py:103-140",
    tap_fallback="the target model's own default aux layers (eagle3_utils.py:24-29)",
    causal=vllm_causal,
    causal_rule="vLLM: top-level is_causal, else dflash_config.causal, else sliding layers causal, "
                "qwen3_dflash.py:86-97",
    # qwen3_dflash.py / qwen3_dspark.py apply none of the head settings; qwen3_dflash2.py:526-558 reads all three
    # from dflash_config.
    applies={"qwen3_dflash": (), "qwen3_dflash2": _DFLASH2_APPLIES, "qwen3_dspark": ()},
    checks={"qwen3_dflash": (_vllm_no_domino, _vllm_no_dflash2_under_dflash, _vllm_sliding_window, _vllm_reduced_vocab),
            "qwen3_dflash2": (_vllm_dflash2_fields, _vllm_sliding_window, _vllm_reduced_vocab),
            "qwen3_dspark": (_vllm_dspark_head, _vllm_sliding_window, _vllm_reduced_vocab)},
    command=_vllm_command,
)

# The commit-pinned rules 0.34.0 replaces: the V1 model runner (mixed layer types need VLLM_USE_V2_MODEL_RUNNER=1)
# and no `layer_ids` tap fallback.
VLLM_036A00D = replace(
    VLLM,
    version="036a00d",
    source="vllm-project/vllm: models/registry.py, qwen3_dflash.py @036a00d, qwen3_dflash2.py @030da62, "
           "qwen3_dspark.py @0302ff4, spec_decode/eagle/eagle3_utils.py",
    registry="models/registry.py (_SPECULATIVE_DECODING_MODELS)",
    foreign={},
    taps=_VLLM_TAPS_036A00D,
    taps_rule="eagle3_utils.get_eagle3_aux_layers_from_config",
    mask_rule="qwen3_dflash.py",
    tap_fallback="the target model's own default aux layers",
    checks={"qwen3_dflash": (_vllm_no_domino, _vllm_layer_types_v1, _vllm_reduced_vocab),
            "qwen3_dflash2": (_vllm_dflash2_fields, _vllm_layer_types_v1, _vllm_reduced_vocab),
            "qwen3_dspark": (_vllm_dspark_head, _vllm_layer_types_v1, _vllm_reduced_vocab)},
    command=_vllm_command_036a00d,
)


def _sglang_default_taps(draft: DraftFile) -> list[int]:
    """DFlashDraftConfig.resolve_target_layer_ids without a tap list: DFlash's formula over num_target_layers
    (dflash_config first, then the top level, else the draft's depth) and the draft's depth."""
    layers = int(draft.config.get("num_hidden_layers") or 1)
    target = first_present(draft.config, (("dflash_config", "num_target_layers"), ("num_target_layers",)))[1]
    return default_target_layer_ids(int(target or layers), layers)


_SGLANG_DFLASH2 = "models/dflash.py DFlash2DraftModel"
_SGLANG_HEAD = (("dflash_config", "output_multiplier"), ("dflash_config", "final_logit_softcapping"))

SGLANG = RuntimeRules(
    name="SGLang",
    version="0.5.23",
    source="sglang 0.5.23: srt/models/dflash.py, models/dspark.py, speculative/dflash_utils.py, "
           "speculative/dspark_components/dspark_config.py, arg_groups/speculative_hook.py",
    registry="the EntryClass lists of models/dflash.py:1317-1324 and models/dspark.py:995",
    models={"DFlashDraftModel": "models/dflash.py", "DFlash2DraftModel": _SGLANG_DFLASH2,
            "Qwen3DSparkModel": "models/dspark.py", "DSparkDraftModel": "models/dspark.py",
            "LingDSparkModel": "models/dspark.py"},
    foreign={"DFlashLagunaForCausalLM": "Laguna's DFlash drafter (models/dflash.py:1057)",
             "DSparkMiniMaxDraftModel": "MiniMax's DSpark drafter (models/dspark_minimax.py)"},
    # dflash_utils.parse_dflash_draft_config: every field from dflash_config first, then the top level
    block_source="unless --speculative-num-draft-tokens says otherwise, SGLang serves dflash_config.block_size, "
                 "else the top-level one (speculative/dflash_utils.py:608-617), else its default "
                 "(arg_groups/speculative_hook.py:389-422; DSpark's gamma: :808-818)",
    block_level=FAILS,
    # arg_groups/speculative_hook.py:389-422 (DFLASH: 16) and :815-818 (DSPARK: gamma 7)
    block_size_default={"models/dflash.py": 16, _SGLANG_DFLASH2: 16, "models/dspark.py": 7},
    mask_token_id=(("dflash_config", "mask_token_id"), ("mask_token_id",)),
    mask_rule="speculative/dflash_utils.py:688-702",
    mask_fallback="the token string '<|MASK|>' (dflash_config.mask_token), added to the target's tokenizer when it "
                  "has none (speculative/dflash_worker_v2.py:1423-1445)",
    # models/qwen3.py:803-805: SGLang captures "before layer i + 1": a stored id i taps layer i's output
    taps=(TapSource(("dflash_config", "target_layer_ids"), 0), TapSource(("target_layer_ids",), 0)),
    taps_rule="speculative/dflash_utils.py:657-670, models/qwen3.py:803-805",
    tap_fallback="DFlash's default formula (speculative/dflash_utils.py:348-385)",
    causal=sglang_causal,
    causal_rule="SGLang: no layer_types, all bidirectional; else top-level is_causal, else sliding layers causal, "
                "models/dflash.py:157-190; dflash_config.causal is not read",
    # only DFlash2DraftModel applies output_multiplier / final_logit_softcapping (models/dflash.py:1284-1290, from
    # dflash_config); input_embedding_scale is read nowhere
    applies={"models/dflash.py": (), _SGLANG_DFLASH2: _SGLANG_HEAD, "models/dspark.py": ()},
    checks={"models/dflash.py": (_sglang_domino, _sglang_dflash2_under_dflash, _sglang_sliding_window,
                                 _sglang_reduced_vocab),
            _SGLANG_DFLASH2: (_sglang_dflash2_fields, _sglang_sliding_window, _sglang_reduced_vocab),
            "models/dspark.py": (_sglang_dspark, _sglang_sliding_window)},
    command=_sglang_command,
    tap_default=_sglang_default_taps,
)

# The commit-pinned rules 0.5.23 replaces: no DFlash 2 or SpecForge DSpark label, `is_causal` not read, the
# head settings applied by every model file, the confidence head always built.
SGLANG_003B23D = replace(
    SGLANG,
    version="003b23d",
    source="sgl-project/sglang: models/dflash.py @003b23d, models/dspark.py @01f4762, "
           "speculative/dflash_utils.py @00731f0, speculative/domino_utils.py @04d4c1a",
    registry="the EntryClass of models/dflash.py and models/dspark.py",
    models={"DFlashDraftModel": "models/dflash.py", "Qwen3DSparkModel": "models/dspark.py"},
    foreign={},
    block_source="SGLang serves dflash_config.block_size, else the top-level one, else 16 "
                 "(dflash_utils.parse_dflash_draft_config)",
    block_size_default={"models/dflash.py": 16, "models/dspark.py": 16},
    mask_fallback="the token string '<|MASK|>' (dflash_config.mask_token)",
    mask_rule="dflash_utils.parse_dflash_draft_config",
    taps_rule="dflash_utils.parse_dflash_draft_config",
    tap_fallback="DFlash's default formula",
    causal=sglang_causal_003b23d,
    causal_rule="SGLang @003b23d: sliding layers causal, full-attention layers bidirectional; is_causal not read",
    applies={"models/dflash.py": _SGLANG_HEAD, "models/dspark.py": _SGLANG_HEAD},
    checks={"models/dflash.py": (_sglang_domino, _sglang_no_dflash2, _sglang_reduced_vocab),
            "models/dspark.py": (_sglang_dspark_003b23d,)},
)

RUNTIMES = (VLLM, SGLANG)  # the current releases, checked by default
# runtime (lower case) -> its releases, the current one first (`--runtime-version vllm=036a00d`)
RELEASES = {"vllm": (VLLM, VLLM_036A00D), "sglang": (SGLANG, SGLANG_003B23D)}


def runtime_rules(versions: Optional[Mapping[str, str]] = None) -> tuple[RuntimeRules, ...]:
    """The rules of each runtime's chosen release (`versions`: runtime name -> version, any case; a runtime
    not named gets its current release). `ValueError` names an unknown runtime or version and the known ones."""
    chosen = {name.lower(): version for name, version in (versions or {}).items()}
    unknown = sorted(set(chosen) - set(RELEASES))
    if unknown:
        raise ValueError(f"--runtime-version {unknown[0]}: no such runtime (choose {', '.join(RELEASES)}).")
    out = []
    for name, releases in RELEASES.items():
        version = chosen.get(name, releases[0].version)
        match = [rules for rules in releases if rules.version == version]
        if not match:
            raise ValueError(f"--runtime-version {name}={version}: no rules for that release (known: "
                             f"{', '.join(r.version for r in releases)}).")
        out.append(match[0])
    return tuple(out)


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


def _registry_finding(draft: DraftFile, rules: RuntimeRules) -> Finding:
    """The runtime's own reason for an architecture it builds no model of ours for."""
    name = draft.architecture
    if name in rules.foreign:
        return Finding(FAILS, f"{rules.label} registers {name!r} for {rules.foreign[name]}, not for this draft")
    hint = (" (write the SGLang label with `convert_checkpoint.py to-hf --export-for sglang`)"
            if name == DOMINO_ARCHITECTURE and rules.name == "SGLang" else "")
    return Finding(FAILS, f"{rules.label} has no {name!r} in its registry, {rules.registry}; the names it builds a "
                          f"draft of ours from: {', '.join(sorted(rules.models))}{hint}")


def check_runtime(draft: DraftFile, rules: RuntimeRules, options: CheckOptions, shared: list,
                  target: str) -> RuntimeReport:
    """One runtime's verdict on a draft: its registry, its readings against the trained ones, its model file's
    checks, and the `shared` findings (the target's, this package's own reading). This package's failure to read
    the file is no runtime's reason: a caveat (what the draft was trained with is unknown) for a runtime whose
    rules find nothing wrong, left out for one that fails it by its own."""
    report = RuntimeReport(runtime=rules.name, version=rules.version, source=rules.source, verdict=LOADS)
    model = rules.models.get(draft.architecture)
    if model is None:
        report.findings.append(_registry_finding(draft, rules))
    else:
        for check in (*_GENERIC_CHECKS, *rules.checks.get(model, ())):
            report.findings += check(draft, rules, options)
        report.findings += _check_block_size(draft, rules, options, model)
        report.findings += _check_head_settings(draft, rules, model)
    own_failure = any(f.level == FAILS for f in report.findings)
    for finding in shared:
        if finding.reason.startswith(_UNREAD):  # not the runtime's reason: whether it serves as trained is unknown
            if own_failure:
                continue
            finding = Finding(CAVEAT, f"{rules.label} reads it by the rules above, but {finding.reason}")
        report.findings.append(finding)
    report.verdict = max((f.level for f in report.findings), key=_SEVERITY.__getitem__, default=LOADS)
    if report.verdict != FAILS:
        report.command = rules.command(draft, model, target, options)
    return report


_UNREAD = "this package does not read it as a draft"


def check_serving(directory: str, target: Optional[str] = None, *, target_name: Optional[str] = None,
                  vllm_v2_runner: bool = False,
                  versions: Optional[Mapping[str, str]] = None,
                  runtimes: Optional[Sequence[RuntimeRules]] = None) -> list[RuntimeReport]:
    """Per runtime: whether the HF draft in `directory` loads (`LOADS`, `CAVEAT`, `FAILS`), why, and its serve
    command (for a draft that loads). `target`: the target's HF directory (config.json, tokenizer.json);
    `target_name`: how the serve commands name the target (a hub id, which the runtimes resolve themselves;
    default the directory); `versions`: the release per runtime (`runtime_rules`; default the current ones), or
    `runtimes` given."""
    runtimes = runtime_rules(versions) if runtimes is None else runtimes
    draft = read_draft_file(directory)
    if draft.file_error is not None:  # malformed, or its config contradicts its weights: no runtime loads it
        return [RuntimeReport(runtime=rules.name, version=rules.version, source=rules.source, verdict=FAILS,
                              findings=[Finding(FAILS, draft.file_error)]) for rules in runtimes]
    shared = target_findings(draft, target)
    if draft.trained_error is not None:
        shared.append(Finding(FAILS, f"{_UNREAD}, so what it was trained with is unknown: {draft.trained_error}"))
    shown_target = shlex.quote(target_name or os.path.abspath(target)) if target else "<target>"
    options = CheckOptions(vllm_v2_runner=vllm_v2_runner)
    return [check_runtime(draft, rules, options, shared, shown_target) for rules in runtimes]


def exit_status(reports: Sequence[RuntimeReport]) -> int:
    """0 when every runtime loads the draft (caveats included), 1 when one does not."""
    return 1 if any(r.verdict == FAILS for r in reports) else 0


def report_lines(directory: str, reports: Sequence[RuntimeReport]) -> list[str]:
    """The console report: per runtime its verdict and reasons, then the serve commands."""
    lines = [f"serving check of {directory}"]
    for report in reports:
        lines.append(f"{report.runtime} {report.version}: {report.verdict}")
        lines.append(f"  (as read by {report.source})")
        lines += [f"  - {'caveat' if f.level == CAVEAT else 'does not load'}: {f.reason}" for f in report.findings]
    lines.append("serve commands:")
    for report in reports:
        lines.append(f"  # {report.runtime} {report.version}")
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
