"""The tiny Qwen3-architecture target of the embedded default job: shipped, or built and cached.

`embedded_target_dir()` returns a HF directory (config, safetensors weights, tokenizer with
chat template) of a small Qwen3 model trained on `synthetic_corpus`. The package ships that
directory, built by `train_tiny_target(TinyTargetRecipe())` (`SHIPPED_TARGET_DIR`, a few MB;
`tools/build_tiny_target.py` rebuilds it and compares it bit for bit), so the first run of
`pretrain_dflash.py` does not spend minutes training it. When the shipped copy does not match
the recipe (an edited recipe), `ensure_tiny_target()` trains the target once and caches it
under a key that covers every setting, written atomically so an interrupted build never
leaves a half-written target behind.

`recipe.json` of a built target also records a *trace*: the losses of the first
`TRACE_STEPS` steps and the parameter norms after them, which a short rebuild reproduces
(see the tests) without spending the minutes of a full build.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Optional

from ..common.atomic import atomic_directory
from . import synthetic_corpus

SHIPPED_TARGET_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets",
                                  "tiny_target")
TRACE_STEPS = 2


@dataclass(frozen=True)
class TinyTargetRecipe:
    seed: int = 1234
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 512
    train_steps: int = 600
    batch_size: int = 32
    seq_length: int = 96
    lr: float = 3e-3
    version: int = 1  # bump when the corpus or the training changes

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


def default_cache_dir() -> str:
    root = os.environ.get("MEGATRON_DFLASH_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "megatron_dflash"
    )
    return root


def tokenize_conversation(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids and the assistant mask (1 on assistant tokens) of one chat."""
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    return list(out["input_ids"]), list(out["assistant_masks"])


def _batches(tokenizer, recipe: TinyTargetRecipe):
    """Endless [batch, seq] id tensors of packed chats (the target learns whole chats)."""
    import torch

    pad = tokenizer.pad_token_id
    stream: list[int] = []
    chats = synthetic_corpus.conversations(recipe.seed, 10**9)
    while True:
        rows = []
        for _ in range(recipe.batch_size):
            while len(stream) < recipe.seq_length:
                ids, _ = tokenize_conversation(tokenizer, next(chats))
                stream.extend(ids)
            rows.append(stream[: recipe.seq_length])
            stream = stream[recipe.seq_length :]
        yield torch.tensor(rows, dtype=torch.long)
    del pad


def _train(recipe: TinyTargetRecipe, log=print, stop_after: Optional[int] = None):
    """(model, tokenizer, losses) after `stop_after` (default: all) steps of the recipe."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = synthetic_corpus.build_tokenizer()
    vocab = 64 * math.ceil(len(tokenizer) / 64)
    torch.manual_seed(recipe.seed)
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_hidden_layers,
        num_attention_heads=recipe.num_attention_heads,
        num_key_value_heads=recipe.num_key_value_heads,
        head_dim=recipe.head_dim,
        max_position_embeddings=recipe.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    model = Qwen3ForCausalLM(config)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.0, betas=(0.9, 0.98))
    warmup = max(1, recipe.train_steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return recipe.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, recipe.train_steps - warmup)
        return recipe.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))

    start = time.time()
    batches = _batches(tokenizer, recipe)
    losses = []
    steps = recipe.train_steps if stop_after is None else min(stop_after, recipe.train_steps)
    for step in range(steps):
        ids = next(batches)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if step % 100 == 0 or step == recipe.train_steps - 1:
            log(f"[tiny target] step {step:4d}/{recipe.train_steps} loss {loss.item():.3f} ({time.time() - start:.0f}s)")
    model.eval()
    return model, tokenizer, losses


def parameter_norms(model) -> dict:
    """{name: float L2 norm} of every parameter (the trace's weight fingerprint)."""
    return {name: float(p.detach().double().norm()) for name, p in sorted(model.named_parameters())}


def recipe_trace(recipe: TinyTargetRecipe, steps: int = TRACE_STEPS, log=print) -> dict:
    """The losses of the first `steps` training steps and the parameter norms after them."""
    model, _, losses = _train(recipe, log=log, stop_after=steps)
    return {"steps": steps, "losses": losses, "parameter_norms": parameter_norms(model)}


def train_tiny_target(recipe: TinyTargetRecipe, out_dir: str, log=print) -> None:
    model, tokenizer, _ = _train(recipe, log=log)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "recipe.json"), "w") as f:
        json.dump(asdict(recipe), f, indent=2)
    # After the full build, from a fresh short run (the trace is a function of the recipe).
    with open(os.path.join(out_dir, "trace.json"), "w") as f:
        json.dump(recipe_trace(recipe, log=lambda _: None), f, indent=2)


def matches_recipe(directory: str, recipe: TinyTargetRecipe = TinyTargetRecipe()) -> bool:
    """Whether `directory` holds a complete target built from `recipe`."""
    try:
        with open(os.path.join(directory, "recipe.json")) as f:
            return json.load(f) == asdict(recipe) and os.path.isfile(os.path.join(directory, "model.safetensors"))
    except (OSError, ValueError):
        return False


def embedded_target_dir(log=print) -> str:
    """The target of the embedded job: the shipped one when it matches the recipe, else the cached build."""
    if matches_recipe(SHIPPED_TARGET_DIR):
        return SHIPPED_TARGET_DIR
    return ensure_tiny_target(log=log)


def ensure_tiny_target(
    cache_dir: Optional[str] = None, recipe: TinyTargetRecipe = TinyTargetRecipe(), log=print
) -> str:
    """Path of the cached tiny target, training it first if it is not there yet."""
    cache_dir = cache_dir or default_cache_dir()
    final = os.path.join(cache_dir, f"tiny-qwen3-target-{recipe.key()}")
    if os.path.isfile(os.path.join(final, "recipe.json")):
        return final
    os.makedirs(cache_dir, exist_ok=True)
    log(f"[tiny target] building {final} (once; a few minutes on a CPU)")
    try:
        with atomic_directory(final, replace=False, remove_stale=False) as staged:
            train_tiny_target(recipe, staged, log=log)
    except FileExistsError:
        # Another process finished first: keep its copy.
        if not os.path.isfile(os.path.join(final, "recipe.json")):
            raise
    return final
