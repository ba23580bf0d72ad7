"""A HF target directory from a GGUF file, built once into the user's cache and fingerprinted by the
GGUF's digest.

`gguf_target_dir(path)` returns a directory the rest of the package reads like any HF target
(`config.json`, fp32 `model.safetensors`, the tokenizer with its chat template, `generation_config.json`)
and `source.json` (the GGUF's name and sha256, the converter's version). A directory whose `source.json`
does not match the file (a changed GGUF, an older converter) is rebuilt; the build is published whole
(`common/atomic.py`), so an interrupted one leaves nothing behind.

The conversion reads the config and the tokenizer through transformers' GGUF support and dequantizes the
tensors one at a time with the `gguf` package, through transformers' tensor processors (which undo
llama.cpp's permutation of the query / key rows), straight into a plain model of that config: a model
loaded with `from_pretrained(gguf_file=...)` keeps a GGUF quantizer that `save_pretrained` refuses, and
one tensor at a time keeps the peak near the fp32 model's size. Progress is printed at a steady interval.
Only Llama-architecture GGUFs are converted (the ones tested).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from typing import Callable, Iterator, Optional

from ..common.atomic import atomic_directory, file_sha256
from ..common.errors import RunError
from ..embedded_job.tiny_target import default_cache_dir
from .installed import require_module

CONVERTER_VERSION = 1
SOURCE_FILE = "source.json"
ARCHITECTURES = ("llama",)  # GGUF `general.architecture` values this converter is tested on
GGUF_PIP_LINE = "pip install gguf"
PROGRESS_INTERVAL_S = 10.0


def source_record(gguf_path: str, digest: Optional[str] = None) -> dict:
    """What `source.json` of a directory converted from `gguf_path` holds (the fingerprint)."""
    return {"gguf_file": os.path.basename(gguf_path), "gguf_sha256": digest or file_sha256(gguf_path),
            "converter_version": CONVERTER_VERSION}


def matches_gguf(directory: str, source: dict) -> bool:
    """Whether `directory` holds a complete conversion of the GGUF that `source` (`source_record`) names."""
    try:
        with open(os.path.join(directory, SOURCE_FILE), encoding="utf-8") as f:
            return json.load(f) == source and os.path.isfile(os.path.join(directory, "model.safetensors"))
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def heartbeat(log: Callable[[str], None], what: str, interval: float = PROGRESS_INTERVAL_S) -> Iterator[None]:
    """A line `[gguf] still <what> (Ns)` every `interval` seconds while the block runs: the steps that are one
    library call (reading the tokenizer, writing the weights) say they are alive, in a log file too; none with
    `interval` 0."""
    done = threading.Event()
    start = time.monotonic()

    def beat():
        while not done.wait(interval):
            log(f"[gguf] still {what} ({time.monotonic() - start:.0f}s)")

    thread = threading.Thread(target=beat, daemon=True)
    if interval > 0:
        thread.start()
    try:
        yield
    finally:
        done.set()
        if interval > 0:
            thread.join()


def _read_metadata(gguf_path: str):
    """(config, tokenizer) of `gguf_path`, as transformers reads them from the GGUF's metadata."""
    from transformers import AutoConfig, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf_path))
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if config.model_type not in ARCHITECTURES:
        raise RunError(f"{gguf_path}: a GGUF of architecture {config.model_type!r}; only {', '.join(ARCHITECTURES)} "
                       "GGUFs are converted to a target (convert this one to a HF directory with its own tools).")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return config, tokenizer


def _plain_model(config):
    """An fp32 causal LM of `config` without a GGUF quantizer; its weights are left uninitialised (every one is
    overwritten from the GGUF, `_check_complete`), which saves the seconds of a random initialisation."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights

    config._name_or_path = ""  # the GGUF's free-text model name is no path
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()  # tying is part of the skipped initialisation
    return model.eval()


def read_gguf_weights(gguf_path: str, model, log: Callable[[str], None] = print,
                      interval: float = PROGRESS_INTERVAL_S) -> list:
    """Dequantize every tensor of `gguf_path` into `model`'s parameter of the same name, one at a time, with a
    progress line every `interval` seconds; returns the HF names written. Shapes are checked."""
    import numpy as np
    import torch
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    gguf = require_module("gguf", GGUF_PIP_LINE, "reading a GGUF file")
    reader = gguf.GGUFReader(gguf_path)
    architecture, config = model.config.model_type, model.config.to_dict()
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config)
    names = get_gguf_hf_weights_map(model, processor)
    params = dict(model.named_parameters(remove_duplicate=False))
    written, total = [], len(reader.tensors)
    start = last = time.monotonic()
    for count, tensor in enumerate(reader.tensors, 1):
        result = processor.process(weights=gguf.dequantize(tensor.data, tensor.tensor_type), name=tensor.name,
                                   tensor_key_mapping=names, parsed_parameters={"config": config})
        hf_name = names.get(result.name)
        if hf_name is None or hf_name not in params:
            raise RunError(f"{gguf_path}: tensor {tensor.name} has no parameter in a {architecture} model of its "
                           "config; this GGUF is not a plain causal LM of its architecture.")
        weights = torch.from_numpy(np.array(result.weights, dtype=np.float32))
        if tuple(weights.shape) != tuple(params[hf_name].shape):
            raise RunError(f"{gguf_path}: tensor {tensor.name} has shape {tuple(weights.shape)}, its config makes "
                           f"{hf_name} {tuple(params[hf_name].shape)}.")
        with torch.no_grad():
            params[hf_name].copy_(weights)
        written.append(hf_name)
        now = time.monotonic()
        if now - last >= interval or count == total:
            log(f"[gguf] {count}/{total} tensors dequantized ({now - start:.0f}s)")
            last = now
    return written


def _check_complete(gguf_path: str, model, written: list) -> None:
    """Every parameter of `model` written (a tied output layer shares the embedding's tensor)."""
    covered = {id(p) for name, p in model.named_parameters(remove_duplicate=False) if name in set(written)}
    missing = [name for name, p in model.named_parameters(remove_duplicate=False) if id(p) not in covered]
    if missing:
        raise RunError(f"{gguf_path}: no tensor for {', '.join(missing[:3])}"
                       f"{' and more' if len(missing) > 3 else ''}; the GGUF is incomplete.")


def convert_gguf(gguf_path: str, out_dir: str, *, log: Callable[[str], None] = print,
                 interval: float = PROGRESS_INTERVAL_S, digest: Optional[str] = None) -> None:
    """Write the HF directory of `gguf_path` into `out_dir` (an empty directory): fp32 safetensors, the
    tokenizer with its chat template, the generation config, and `source.json`."""
    from transformers.utils import logging as hf_logging

    require_module("gguf", GGUF_PIP_LINE, "reading a GGUF file")
    start = time.monotonic()
    with heartbeat(log, "reading the config and the tokenizer", interval):
        config, tokenizer = _read_metadata(gguf_path)
    log(f"[gguf] config and tokenizer read ({time.monotonic() - start:.0f}s)")
    model = _plain_model(config)
    written = read_gguf_weights(gguf_path, model, log=log, interval=interval)
    _check_complete(gguf_path, model, written)
    model.generation_config.bos_token_id = config.bos_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # the log has its own lines; a bar's carriage returns only clutter a file
    try:
        with heartbeat(log, "writing the weights", interval):
            model.save_pretrained(out_dir, safe_serialization=True)
            tokenizer.save_pretrained(out_dir)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    log(f"[gguf] written ({time.monotonic() - start:.0f}s)")
    with open(os.path.join(out_dir, SOURCE_FILE), "w", encoding="utf-8") as f:
        json.dump(source_record(gguf_path, digest), f, indent=2)


def gguf_target_dir(gguf_path: str, *, name: Optional[str] = None, cache_dir: Optional[str] = None,
                    log: Callable[[str], None] = print, interval: float = PROGRESS_INTERVAL_S) -> str:
    """The cached HF directory of `gguf_path` (`<cache>/<name>`, `name` defaulting to the file's stem),
    converted first when it is absent or was converted from another GGUF or by another converter version."""
    require_module("gguf", GGUF_PIP_LINE, "reading a GGUF file")
    source = source_record(gguf_path)
    final = os.path.join(cache_dir or default_cache_dir(), name or os.path.splitext(os.path.basename(gguf_path))[0])
    if matches_gguf(final, source):
        return final
    stale = os.path.exists(final)
    log(f"[gguf] converting {gguf_path} into {final} ({'rebuilt: another GGUF or converter' if stale else 'once'})")
    start = time.monotonic()
    try:
        with atomic_directory(final, replace=stale, remove_stale=False) as staged:
            convert_gguf(gguf_path, staged, log=log, interval=interval, digest=source["gguf_sha256"])
    except FileExistsError:
        if not matches_gguf(final, source):  # another process finished first with the same GGUF: keep its copy
            raise
    log(f"[gguf] {final} ready ({time.monotonic() - start:.0f}s)")
    return final
