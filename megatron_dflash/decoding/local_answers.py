"""The target's answers in this process: HF `generate` with a KV cache, batched with left padding.

The answer back end of `decoding/regenerate.py` on the local device. Prompts are rendered with the
tokenizer's chat template (`add_generation_prompt`, the `chat_template_kwargs` of the settings) and
tokenised without extra special tokens, as a chat-completions server renders them. Greedy is the plain
argmax; at a temperature, every row draws its tokens from its own generator seeded by the request's seed
(`SeededDraws`: one uniform per row and step, inverse CDF of `decoding.sampling.sampling_probs`), so an
answer does not depend on the other rows of its batch. Records and prompts are checked against the
target's chat template and context first (`check_record`, and every prompt before `generate`:
`decoding/prompt_limits.py`); `chat_template` replaces the tokenizer's template (`--chat-template`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LogitsProcessor, LogitsProcessorList

from ..common.safetensors_files import refuse_pickled_weights
from .prompt_limits import PromptLimits, context_of
from .regenerate import Answer, Request, RequestFailed, Settings
from .sampling import GREEDY_BELOW_TEMPERATURE, sampling_probs

__all__ = ["SeededDraws", "LocalAnswers", "stop_token_ids"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class SeededDraws(LogitsProcessor):
    """Sampling as a logits processor: row `b` draws from `torch.Generator(seeds[b])`; every other logit
    becomes -inf, so `generate`'s argmax takes the drawn token."""

    def __init__(self, seeds: Sequence[int], temperature: float, top_p: float):
        self.generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
        self.temperature, self.top_p = temperature, top_p

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = sampling_probs(scores, self.temperature, self.top_p)  # [B, V]
        u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in self.generators])
        cdf = probs.double().cumsum(-1)
        drawn = torch.searchsorted(cdf, u.to(cdf.device)[:, None] * cdf[:, -1:]).clamp(max=probs.shape[-1] - 1)
        return torch.full_like(scores, float("-inf")).scatter_(1, drawn, 0.0)


def stop_token_ids(model, tokenizer) -> list[int]:
    """The tokens that end an answer: the generation config's EOS (one or several) and the tokenizer's."""
    eos = model.generation_config.eos_token_id
    ids = list(eos) if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("the target names no end-of-sequence token (generation_config.json or the tokenizer); "
                         "an answer could never stop.")
    return ids


class LocalAnswers:
    """Answers from the HF target at `target` on `device`, `batch_size` requests per `generate` call."""

    def __init__(self, target: str, settings: Settings, *, batch_size: int = 8, device: Optional[str] = None,
                 dtype: str = "float32", chat_template: Optional[str] = None, tokenizer: Optional[str] = None):
        self.settings, self.batch_size = settings, batch_size
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer or target)
        if chat_template is not None:
            self.tokenizer.chat_template = chat_template
        self.tokenizer.padding_side = "left"
        refuse_pickled_weights(target)  # one line naming the .bin; a hub id is fetched as safetensors only
        self.model = AutoModelForCausalLM.from_pretrained(target, dtype=DTYPES[dtype], use_safetensors=True)
        self.model = self.model.to(self.device).eval()
        self.stop = stop_token_ids(self.model, self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self.pad = self.stop[0] if pad is None else pad
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token_id = self.pad
        self.limits = PromptLimits(self.tokenizer, context_of(self.model.config), settings.max_new_tokens,
                                   settings.chat_template_kwargs)

    def prompt_text(self, messages: list) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                  **(self.settings.chat_template_kwargs or {}))

    def check_record(self, messages: list, where: str) -> None:
        self.limits.check_record(messages, where)

    def answer(self, requests: Sequence[Request]) -> list:
        out = []
        for i in range(0, len(requests), self.batch_size):
            out += self._batch(requests[i:i + self.batch_size])
        return out

    @torch.no_grad()
    def _batch(self, requests: Sequence[Request]) -> list:
        s = self.settings
        texts = [self.prompt_text(q.messages) for q in requests]
        problems = [self.limits.prompt_problem(q.messages) for q in requests]  # a later turn's prompt grew
        ok = [i for i, p in enumerate(problems) if p is None]
        out: list = [RequestFailed(p, bad_answer=True) if p is not None else None for p in problems]
        if not ok:
            return out
        enc = self.tokenizer([texts[i] for i in ok], add_special_tokens=False, padding=True,
                             return_tensors="pt").to(self.device)
        config = GenerationConfig(max_new_tokens=s.max_new_tokens, do_sample=False, eos_token_id=self.stop,
                                  pad_token_id=self.pad)
        processors = LogitsProcessorList()
        if s.temperature >= GREEDY_BELOW_TEMPERATURE:
            processors.append(SeededDraws([requests[i].seed for i in ok], s.temperature, s.top_p))
        generated = self.model.generate(**enc, generation_config=config, logits_processor=processors)
        for i, row in zip(ok, generated[:, enc["input_ids"].shape[1]:].tolist()):
            out[i] = self._answer(row)
        return out

    def _answer(self, row: list) -> Answer:
        stops = [j for j, t in enumerate(row) if t in self.stop]
        if stops:
            kept, reason, tokens = row[:stops[0]], "stop", stops[0] + 1
        else:
            kept, reason, tokens = row, "length", len(row)
        return Answer(self.tokenizer.decode(kept, skip_special_tokens=True), reason, tokens)
