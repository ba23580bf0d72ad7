"""Speculative decoding (`spec_generate`) and the acceptance CLI on tiny in-process models.

The checks that matter:

* the draft forward with a KV cache (decoding: the context written in pieces) gives the same
  block hidden states as the forward over the whole context with a plan from explicit anchors
  (training's path), per-row lengths, cache growth and sliding window layers included;
* greedy speculative decoding emits exactly the target's own greedy tokens (HF `generate`),
  for DFlash and DFlash 2 drafts, batch 1 and batch 3 with prompts of different lengths,
  whatever the acceptance pattern (none, partial, full);
* with sampling, the emitted tokens follow the target's distribution (computed exactly by
  enumeration on a vocabulary of 8), also with top-k / top-p;
* stop tokens and `max_new_tokens` are honoured, the statistics add up, and the CLI runs end
  to end on HF directories written to a temporary path.

Tiny random targets accept almost nothing from a random draft, so some targets are shaped
(`tiny_decoding.shape_target`) so that the draft's proposals are accepted fully ("absorbing") or partly
("alternating"); the greedy tests assert that those acceptance patterns really occur.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest
import torch

from megatron_dflash.decoding import generate, target_side
from megatron_dflash.decoding.generate import spec_generate
from megatron_dflash.draft.kv_cache import DraftKVCache
from megatron_dflash.plan.batch_plan import DFlashBatchPlan

pytestmark = pytest.mark.usefixtures("one_thread")

transformers = pytest.importorskip("transformers")
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402
from reference_sampling import chi_square_pvalue, exact_joint, marginal  # noqa: E402
from repo_paths import REPO_ROOT  # noqa: E402
from tiny_decoding import (  # noqa: E402
    HIDDEN,
    PROMPTS,
    PROMPTS_SMALL,
    TAPS,
    check_statistics,
    hf_greedy,
    llama_target,
    make_draft,
    qwen3_target,
    write_models,
)

ROOT = REPO_ROOT


# ================================================================================== cached decode path


@pytest.mark.parametrize("dflash2", [False, True], ids=["dflash", "dflash2"])
def test_cached_block_hidden_matches_body_forward(dflash2):
    """Forwards with a KV cache, the context written in pieces == one forward over the whole context."""
    vocab, W, S = 40, 4, 16
    body = make_draft(
        vocab, dflash2=dflash2, block_size=W,
        layer_types=["full_attention", "sliding_attention"], sliding_window=5,
    )
    torch.manual_seed(3)
    B = 3
    taps = torch.randn(B, S, len(TAPS) * HIDDEN)
    blocks = torch.randn(B, W, HIDDEN)
    anchors = torch.tensor([5, 9, 12])

    cache = DraftKVCache(body, B, capacity=4)  # too small: the forwards grow it

    def forward(context, starts, block_anchors):
        """One decoding forward: write `context` at `starts[b] + j`, draft a block at `block_anchors`."""
        positions = starts[:, None] + torch.arange(context.shape[1])
        plan = DFlashBatchPlan.for_decoding(block_anchors, positions, block_size=W)
        with torch.no_grad():
            return body(context, blocks[:, None], plan, kv_cache=cache, attention_backend="chunked")[:, 0]

    # Written in pieces with per-row starts, as decoding does; then junk at and past each anchor
    # (written by the forward that drafts there), which must stay invisible.
    zeros = torch.zeros(B, dtype=torch.int64)
    forward(taps[:, :6], zeros, zeros + 6)
    starts = torch.tensor([4, 5, 6])
    piece = torch.stack([taps[b, int(s) : int(s) + 8] for b, s in enumerate(starts)])
    forward(piece, starts, starts + 8)
    ours = forward(torch.randn(B, W, len(TAPS) * HIDDEN) * 10, anchors, anchors)
    assert cache.capacity >= int(anchors.max()) + W

    plan = DFlashBatchPlan.from_anchors(anchors[:, None], block_size=W, seq_length=S)
    with torch.no_grad():
        reference = body(taps, blocks[:, None], plan)[:, 0]
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


def test_kv_cache_rows_growth_and_misuse():
    """Growth keeps every entry, `select_rows` keeps the chosen rows in order, and a cache that does
    not fit the forward (another batch, another draft, no `prepare`) is refused with a clear error."""
    W = 4
    body = make_draft(40, block_size=W)
    cache = DraftKVCache(body, 3, capacity=2)
    torch.manual_seed(0)
    taps = torch.randn(3, 5, len(TAPS) * HIDDEN)
    blocks = torch.randn(3, 1, W, HIDDEN)
    with torch.no_grad():
        plan = DFlashBatchPlan.for_decoding(torch.full((3,), 5), torch.arange(5).expand(3, 5), block_size=W)
        body(taps, blocks, plan, kv_cache=cache)
        assert cache.capacity == 5 and cache.num_layers == 2
        written = [k.clone() for k in cache.keys]
        cache.grow(11)
        assert cache.capacity == 11 and all(torch.equal(k[:, :5], w) for k, w in zip(cache.keys, written))
        assert all(not k[:, 5:].any() for k in cache.keys)
        cache.select_rows(torch.tensor([2, 0]))
        assert cache.batch_size == 2 and torch.equal(cache.keys[1][:, :5], written[1][[2, 0]])
        # the kept rows decode as when decoded alone
        alone = DraftKVCache(body, 1, capacity=8)
        one = DFlashBatchPlan.for_decoding(torch.tensor([5]), torch.arange(5)[None], block_size=W)
        body(taps[2:], blocks[2:], one, kv_cache=alone)
        empty = DFlashBatchPlan.for_decoding(torch.tensor([5, 5]), torch.zeros(2, 0, dtype=torch.int64), block_size=W)
        kept = body(taps[[2, 0], :0], blocks[[2, 0]], empty, kv_cache=cache)
        none_new = DFlashBatchPlan.for_decoding(torch.tensor([5]), torch.zeros(1, 0, dtype=torch.int64), block_size=W)
        again = body(taps[2:, :0], blocks[2:], none_new, kv_cache=alone)
        # to fp32 rounding: a batch of two and a batch of one may take different BLAS kernels
        torch.testing.assert_close(kept[:1], again, atol=1e-5, rtol=1e-5)

        with pytest.raises(ValueError, match="select_rows"):
            body(taps, blocks, plan, kv_cache=cache)
        other = make_draft(40, block_size=W, num_hidden_layers=1)
        with pytest.raises(ValueError, match="KV cache holds 2 layers"):
            other(taps, blocks, plan, kv_cache=DraftKVCache(body, 3, 8))
    with pytest.raises(RuntimeError, match="before prepare"):
        DraftKVCache(body, 3, 8).update(0, torch.zeros(3, 5, 2, 16), torch.zeros(3, 5, 2, 16))


# ================================================================================== greedy


CASES = {
    # name: (target factory, mode, dflash2, batch)
    "qwen3-random-b1": (qwen3_target, "random", False, 1),
    "qwen3-absorbing-b3": (qwen3_target, "absorbing", False, 3),
    "qwen3-alternating-b3": (qwen3_target, "alternating", False, 3),
    "qwen3-mixed-b3": (qwen3_target, "mixed", False, 3),
    "llama-mixed-b3": (llama_target, "mixed", False, 3),
    "dflash2-random-b1": (qwen3_target, "random", True, 1),
    "dflash2-mixed-b3": (qwen3_target, "mixed", True, 3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_equals_target_greedy(case, monkeypatch):
    factory, mode, dflash2, batch = CASES[case]
    vocab, W, new = 96, 4, 23
    target = factory(vocab=vocab, mode=mode)
    draft = make_draft(vocab, dflash2=dflash2, block_size=W, backend="chunked")
    prompts = PROMPTS[:batch]
    compactions = []

    def spy(cache, valid):
        compactions.append(valid.shape)
        return compact(cache, valid)

    compact = target_side._compact_target_cache
    monkeypatch.setattr(target_side, "_compact_target_cache", spy)
    out = spec_generate(target, draft, prompts, max_new_tokens=new)
    for b, prompt in enumerate(prompts):
        assert out.sequence(b) == hf_greedy(target, prompt, new), f"row {b}"
    check_statistics(out, W, new)
    seen = Counter(a for row in out.acceptance_lengths for a in row)
    if mode == "absorbing":
        assert seen[W] > 0  # whole blocks accepted
    if mode == "alternating":
        assert seen[2] > 0  # partial acceptance
    if mode == "mixed" and factory is qwen3_target:
        # Rejections, partial and whole blocks, and rows that do not advance in step.
        assert seen[1] > 0 and seen[W] > 0 and len(seen) >= 3
        assert len({tuple(row) for row in out.acceptance_lengths}) > 1
        # Rows out of step leave holes in the middle of the target cache: it got compacted.
        assert compactions
    # Rows decoded together or alone give the same tokens.
    if batch > 1:
        alone = spec_generate(target, draft, [prompts[1]], max_new_tokens=new)
        assert alone.sequence(0) == out.sequence(1)


@pytest.mark.parametrize(
    "dflash2, mode, causal", [(False, "random", None), (False, "mixed", None), (True, "random", None),
                              (False, "random", True)],
    ids=["dflash-random", "dflash-mixed", "dflash2-random", "jetspec-random"],
)
def test_proposals_match_reference_decoder(dflash2, mode, causal, tmp_path, monkeypatch):
    """Every block our decoder drafts equals the one the published reference decoder
    (`dflash.model.dflash_generate`, loading our exported checkpoint) drafts in the same cycle.

    "random": the proposals are whatever the random draft's hidden states say (a sharp check
    of the cached draft path); "mixed": rows accept varying lengths (the caches get cropped).
    `causal=True` is a JetSpec draft (causal in-block attention, `is_causal: true` in its file)."""
    ref = pytest.importorskip("dflash.model")
    import time

    from megatron_dflash.checkpoint.hf import save_hf_checkpoint

    monkeypatch.setattr(ref, "_cuda_time", time.perf_counter)  # its timer assumes CUDA
    vocab, new = 96, 17
    target = qwen3_target(vocab=vocab, mode=mode)
    draft = make_draft(vocab, dflash2=dflash2, backend="chunked", **({} if causal is None else {"causal": causal}))
    save_hf_checkpoint(draft, str(tmp_path / "draft"))
    model_class = ref.DFlash2DraftModel if dflash2 else ref.DFlashDraftModel
    reference = model_class.from_pretrained(str(tmp_path / "draft"), dtype=torch.float32).eval()

    theirs: list[list[int]] = []
    if dflash2:
        propose = reference.propose

        def record(*args, **kwargs):
            out = propose(*args, **kwargs)
            theirs.append(out[0][0].tolist())
            return out

        monkeypatch.setattr(reference, "propose", record)
    else:
        compute_logits = reference.compute_logits

        def record(*args, **kwargs):
            logits = compute_logits(*args, **kwargs)
            theirs.append(logits[0].argmax(-1).tolist())
            return logits

        monkeypatch.setattr(reference, "compute_logits", record)
    ours: list[list[int]] = []
    verify = generate.greedy_verify

    def record_ours(draft_tokens, target_logits, *rest):
        ours.append(draft_tokens[0].tolist())
        return verify(draft_tokens, target_logits, *rest)

    monkeypatch.setattr(generate, "greedy_verify", record_ours)
    for prompt in PROMPTS:
        theirs.clear()
        ours.clear()
        expected = ref.dflash_generate(
            reference, target, torch.tensor([prompt]), max_new_tokens=new, stop_token_ids=None, return_stats=True
        )
        out = spec_generate(target, draft, [prompt], max_new_tokens=new)
        assert out.sequence(0) == expected.output_ids[0].tolist()
        # The reference shrinks its last blocks to the remaining budget (a shorter block is a
        # different input to bidirectional attention); compare the full-size ones.
        assert len(ours) == len(theirs)
        full = [(mine, its) for mine, its in zip(ours, theirs) if len(its) == len(mine)]
        assert len(full) >= len(ours) - 3
        for mine, its in full:
            assert mine == its
        assert out.acceptance_lengths[0] == expected.acceptance_lengths


def test_padded_tensor_input_equals_list_input():
    vocab = 96
    target = qwen3_target(vocab=vocab, mode="alternating")
    draft = make_draft(vocab, backend="chunked")
    S = max(len(p) for p in PROMPTS)
    ids = torch.zeros(len(PROMPTS), S, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(PROMPTS):  # left padding on some rows, right padding on others
        if b % 2:
            ids[b, : len(p)], mask[b, : len(p)] = torch.tensor(p), 1
        else:
            ids[b, S - len(p) :], mask[b, S - len(p) :] = torch.tensor(p), 1
    a = spec_generate(target, draft, ids, attention_mask=mask, max_new_tokens=9, pad_token_id=0)
    b = spec_generate(target, draft, PROMPTS, max_new_tokens=9, pad_token_id=0)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.lengths, b.lengths)
    assert a.acceptance_lengths == b.acceptance_lengths


def test_stop_tokens_and_budget():
    vocab, W = 96, 4
    target = qwen3_target(vocab=vocab, mode="absorbing")
    draft = make_draft(vocab, block_size=W, backend="chunked")
    new = 21
    references = [hf_greedy(target, p, new)[len(p) :] for p in PROMPTS]
    # A stop token that row 0 emits after a few tokens, inside an accepted run for some rows.
    stop = references[0][3]
    out = spec_generate(target, draft, PROMPTS, max_new_tokens=new, stop_token_ids=[stop], pad_token_id=vocab - 1)
    for b, reference in enumerate(references):
        if stop in reference:
            expected = reference[: reference.index(stop) + 1]
            assert bool(out.stopped[b])
        else:
            expected = reference
            assert not bool(out.stopped[b])
        assert out.generated(b) == expected, f"row {b}"
    assert bool(out.stopped[0])
    check_statistics(out, W, new)

    # A budget that ends inside an accepted block.
    for budget in (1, 2, 6):
        out = spec_generate(target, draft, PROMPTS, max_new_tokens=budget)
        for b, reference in enumerate(references):
            assert out.generated(b) == reference[:budget]
        check_statistics(out, W, budget)
    nothing = spec_generate(target, draft, PROMPTS, max_new_tokens=0)
    assert nothing.num_generated.tolist() == [0, 0, 0] and nothing.num_prefill_forwards == 0
    assert nothing.sequence(1) == PROMPTS[1]


def test_first_token_stop_ends_the_row_without_cycles():
    vocab = 96
    target = qwen3_target(vocab=vocab, mode="absorbing")
    draft = make_draft(vocab, backend="chunked")
    first = hf_greedy(target, PROMPTS[0], 1)[-1]
    out = spec_generate(target, draft, PROMPTS[:1], max_new_tokens=10, stop_token_ids=[first])
    assert out.generated(0) == [first] and out.acceptance_lengths == [[]]
    assert out.num_target_forwards == 0 and out.num_draft_forwards == 0


# ================================================================================== sampling


SAMPLING = {
    "t1": (1.0, 1.0, 0, False),
    "t0.7-topk3": (0.7, 1.0, 3, False),
    "t1-topp0.8": (1.0, 0.8, 0, False),
    "dflash2-t1": (1.0, 1.0, 0, True),
}


@pytest.mark.parametrize("case", list(SAMPLING))
def test_sampling_follows_target_distribution(case):
    """4 generated tokens, many times: tokens 2-3 come from draft/residual, token 4 from the bonus
    or the next cycle. Their joint law must be the target's (chi-square, fixed seed)."""
    pytest.importorskip("scipy")
    temperature, top_p, top_k, dflash2 = SAMPLING[case]
    vocab, W, steps, N = 8, 3, 4, 3000
    target = qwen3_target(vocab=vocab, seed=2, head_std=0.3)
    draft = make_draft(vocab, dflash2=dflash2, block_size=W, backend="chunked", seed=5)
    prompt = [1, 4, 2, 6]
    generator = torch.Generator().manual_seed(1234)
    out = spec_generate(
        target, draft, [prompt] * N, max_new_tokens=steps, temperature=temperature, top_p=top_p, top_k=top_k,
        generator=generator,
    )
    check_statistics(out, W, steps)
    samples = [tuple(out.generated(b)) for b in range(N)]
    joint = exact_joint(target, prompt, steps, temperature, top_p, top_k)
    cycles = Counter(a for row in out.acceptance_lengths for a in row)
    assert cycles[1] > 0 and cycles[W] > 0  # rejections and fully accepted blocks both occur
    for positions in [(0,), (1,), (2,), (3,), (0, 1), (1, 2), (2, 3)]:
        counts = Counter(tuple(s[i] for i in positions) for s in samples)
        pvalue = chi_square_pvalue(counts, marginal(joint, positions), N)
        assert pvalue > 1e-4, f"positions {positions}: p-value {pvalue:.2e}"


def test_sampling_test_has_power():
    """The draft's own law is far from the target's: a sampler that skipped rejection would fail."""
    vocab = 8
    target = qwen3_target(vocab=vocab, seed=2, head_std=0.3)
    prompt = [1, 4, 2, 6]
    joint = exact_joint(target, prompt, 1, 1.0, 1.0, 0)
    p = torch.tensor([joint[(t,)] for t in range(vocab)])
    assert p.max() < 0.9  # not degenerate
    draft = make_draft(vocab, block_size=3, backend="chunked", seed=5)
    # q of slot 1 given the prompt's context (+ the first token): TV to p of slot 2 is large.
    with torch.no_grad():
        hidden = target(torch.tensor([prompt]), output_hidden_states=True).hidden_states
        taps = torch.cat([hidden[i + 1] for i in TAPS], dim=-1)
        cache = DraftKVCache(draft, 1, 16)
        first = int(p.argmax())
        block = torch.tensor([[first, vocab - 1, vocab - 1]])
        plan = DFlashBatchPlan.for_decoding(torch.tensor([len(prompt)]), torch.arange(len(prompt))[None], block_size=3)
        h = draft(taps, target.get_input_embeddings()(block)[:, None], plan, kv_cache=cache)[:, 0]
        q = torch.softmax(target.lm_head(h[0, 1]), dim=-1)
        ids = torch.tensor([prompt + [first]])
        p2 = torch.softmax(target(ids).logits[0, -1], dim=-1)
    assert 0.5 * (q - p2).abs().sum() > 0.15


def test_sampling_is_reproducible_with_a_generator():
    vocab = 8
    target = qwen3_target(vocab=vocab, seed=2, head_std=0.3)
    draft = make_draft(vocab, block_size=3, backend="chunked")
    runs = [
        spec_generate(target, draft, PROMPTS_SMALL, max_new_tokens=7, temperature=0.9,
                      generator=torch.Generator().manual_seed(7))
        for _ in range(2)
    ]
    assert torch.equal(runs[0].tokens, runs[1].tokens)
    assert runs[0].acceptance_lengths == runs[1].acceptance_lengths


# ================================================================================== validation


def test_invalid_arguments_raise_clear_errors():
    vocab = 96
    target = qwen3_target(vocab=vocab)
    draft = make_draft(vocab, backend="chunked")
    with pytest.raises(ValueError, match="temperature"):
        spec_generate(target, draft, PROMPTS, max_new_tokens=4, temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        spec_generate(target, draft, PROMPTS, max_new_tokens=4, temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        spec_generate(target, draft, PROMPTS, max_new_tokens=-1)
    with pytest.raises(ValueError, match="empty"):
        spec_generate(target, draft, [[1, 2], []], max_new_tokens=4)
    wrong = make_draft(vocab, backend="chunked", num_target_layers=6, target_layer_ids=[1, 3])
    with pytest.raises(ValueError, match="num_target_layers"):
        spec_generate(target, wrong, PROMPTS, max_new_tokens=4)
    with pytest.raises(ValueError, match="DFlashBody"):
        spec_generate(target, target, PROMPTS, max_new_tokens=4)
    # Holes in the rectangular cache would shrink a sliding window: refused, not silently wrong.
    config = target.config.to_dict()
    config.update(use_sliding_window=True, sliding_window=8, max_window_layers=2, layer_types=None)
    sliding = Qwen3ForCausalLM(Qwen3Config(**config)).eval()
    with pytest.raises(ValueError, match="sliding-window"):
        spec_generate(sliding, draft, PROMPTS, max_new_tokens=4)


# ================================================================================== CLI


@pytest.mark.parametrize("dflash2", [False, True], ids=["dflash", "dflash2"])
def test_cli_end_to_end(tmp_path, capsys, dflash2):
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import evaluate_acceptance
    finally:
        sys.path.pop(0)
    target, draft, target_dir, draft_dir, prompts = write_models(tmp_path, dflash2)
    report_path = tmp_path / "out" / "report.json"
    code = evaluate_acceptance.main([
        "--target", str(target_dir), "--draft", str(draft_dir), "--prompts", str(prompts),
        "--max-new-tokens", "10", "--batch-size", "2", "--limit", "3", "--device", "cpu",
        "--dtype", "float32", "--output", str(report_path),
    ])
    assert code == 0
    said = capsys.readouterr()
    printed = said.out
    assert "decode acceptance length (speculative decoding)" in printed and "speedup" in printed
    # Progress on stderr, a line at each phase's end (not a terminal), none on stdout.
    lines = [line for line in said.err.splitlines() if "prompts/s" in line]
    assert [line.split(": [")[0] for line in lines] == ["spec_generate", "autoregressive"], said.err
    assert all(" 3/3 prompts " in line and "tokens/s" in line and "elapsed" in line for line in lines), lines
    assert "prompts/s" not in printed
    report = json.loads(report_path.read_text())
    assert report["settings"]["draft_architecture"] == ("DFlash2Body" if dflash2 else "DFlashBody")
    assert len(report["prompts"]) == 3
    s = report["summary"]
    assert s["greedy_outputs_identical_fraction"] == 1.0
    assert s["speedup"] > 0 and s["autoregressive_tokens"] == s["generated_tokens"] == 30
    assert s["mean_acceptance_length"] >= 1.0
    for entry, prompt in zip(report["prompts"], PROMPTS):
        assert entry["generated_ids"] == hf_greedy(target, prompt, 10)[len(prompt):]
        assert entry["generated_tokens"] == 1 + sum(entry["acceptance_lengths"])


def test_cli_help_and_bad_prompts(tmp_path):
    script = os.path.join(ROOT, "tools", "evaluate_acceptance.py")
    result = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    for flag in ("--target", "--draft", "--prompts", "--max-new-tokens", "--temperature", "--top-p", "--top-k",
                 "--batch-size", "--limit", "--output", "--device", "--dtype"):
        assert flag in result.stdout
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import evaluate_acceptance
    finally:
        sys.path.pop(0)
    from megatron_dflash.data.prompts import PromptError, read_prompt_file

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a known field"}\n{"question": "no known field"}\n')
    with pytest.raises(PromptError, match=r"bad.jsonl:2: expected a JSON object with one of 'input_ids', 'text'"):
        read_prompt_file(str(bad))


def test_cli_text_and_chat_prompts_with_sampling(tmp_path):
    """'prompt' / 'messages' lines through the target's tokenizer (and its chat template)."""
    synthetic = pytest.importorskip("megatron_dflash.embedded_job.synthetic_corpus")
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import evaluate_acceptance
    finally:
        sys.path.pop(0)
    tokenizer = synthetic.build_tokenizer()
    vocab = len(tokenizer)
    target_dir, draft_dir = tmp_path / "target", tmp_path / "draft"
    qwen3_target(vocab=vocab, mode="mixed").save_pretrained(target_dir)
    tokenizer.save_pretrained(target_dir)
    from megatron_dflash.checkpoint.hf import save_hf_checkpoint

    save_hf_checkpoint(make_draft(vocab, backend="chunked"), str(draft_dir))
    prompts = tmp_path / "prompts.jsonl"
    lines = [
        {"prompt": "1 2 3 4"},
        {"messages": [{"role": "user", "content": "count 5 6 7"}]},
        {"input_ids": [7, 8, 9]},
    ]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    report_path = tmp_path / "report.json"
    assert evaluate_acceptance.main([
        "--target", str(target_dir), "--draft", str(draft_dir), "--prompts", str(prompts),
        "--max-new-tokens", "6", "--batch-size", "3", "--temperature", "0.8", "--top-k", "5",
        "--device", "cpu", "--output", str(report_path), "--warmup", "0",
    ]) == 0
    report = json.loads(report_path.read_text())
    chat = tokenizer.apply_chat_template(lines[1]["messages"], add_generation_prompt=True, tokenize=True)
    chat = chat["input_ids"] if hasattr(chat, "keys") else chat
    expected_lengths = [len(tokenizer("1 2 3 4")["input_ids"]), len(chat), 3]
    assert [p["prompt_tokens"] for p in report["prompts"]] == expected_lengths
    assert all(p["generated_tokens"] == 6 for p in report["prompts"])
    # decoded text next to the ids, and on the console
    for p in report["prompts"]:
        assert p["generated_text"] == tokenizer.decode(p["generated_ids"], skip_special_tokens=True)
    assert report["prompts"][0]["prompt_text"] == "1 2 3 4"
    assert report["prompts"][1]["prompt_text"] == "count 5 6 7"
    assert report["summary"]["greedy_outputs_identical_fraction"] is None  # sampling: not comparable
