"""How much a ready-made job does: the prompts it takes, the answers it asks for, the draft it trains, the
questions it evaluates. `BUDGETS` holds the named ones of the command line (`--recipe-budget`); a test builds
its own, smaller.

The draft settings of the SmolLM2-135M job (README, "A real target"), and why:
- 1 draft layer for short, 2 for full: the target has 30 layers of hidden 576; a draft layer costs about as much
  as a target layer, so one or two keep the drafting cheap next to the target's forward (the published 8B
  drafters use 5 of 36, for a target that is 60x larger);
- block 8 for full (the published 16 halves), 4 for short: a small target's draft predicts fewer tokens right
  in a row, and a smaller block puts more of the training signal on the first positions, the ones acceptance
  depends on; with the short budget's few hundred chats, block 4 with 32 anchors trained to a teacher-forced
  acceptance of 1.59 in 300 iterations where block 8 with 16 anchors reached 1.34 (same data, same steps);
- 3 taps, layers 1, 14 and 27 of 30 (`smollm2_job.tap_layers`: evenly from layer 1 to the third from last, as
  the published drafters spread theirs): an early, a middle and a late view of the context, whatever the draft's
  depth (the default rule ties the taps' count to the draft's layers, one tap for one layer);
- sequence length 384: a first turn of at most 192 tokens (the slice's bound) and its answer of at most
  `max_new_tokens` fit, with the chat template's system turn;
- 16 anchors per sample (32 with block 4, the same tokens covered): the answers are short (at most
  `max_new_tokens`), a few blocks each;
- answers cut at `max_new_tokens` kept (`on_truncated="drop-rest"`) for short: three of four SmolLM2 answers run
  past 128 tokens (leaving them out kept 23 chats of 96), and a cut answer is trained with an open end, its
  tokens all the target's own and no end of turn after them (`data.chat.open_end`);
- lr 6e-4, cosine to 6e-5 with a short warm-up: the published recipe's rate for a draft trained from scratch.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Budget:
    name: str
    prompts: int  # first user turns sliced from ShareGPT
    max_new_tokens: int  # the target's answer length at regeneration
    on_truncated: str = "skip-record"  # an answer cut at max_new_tokens: never trained as if the target stopped
    draft_layers: int = 1
    block_size: int = 8
    anchors: int = 16
    taps: int = 3  # target layers the draft reads (`smollm2_job.tap_layers`)
    seq_length: int = 384
    train_iters: int = 200
    micro_batch: int = 4
    global_batch: int = 8
    lr: float = 6e-4
    min_lr: float = 6e-5
    questions_per_category: int = 2  # MT-Bench questions per category decoded at the end
    eval_max_new_tokens: int = 64
    prompt_min_tokens: int = 8
    prompt_max_tokens: int = 192
    shard_size: int = 32  # regeneration records per shard: what a resume keeps
    extra_train_args: tuple = field(default_factory=tuple)  # more pretrain_dflash.py flags (tests)

    def epochs(self, samples: int) -> float:
        """How many times training sees each sample: the target-state cache pays when it is more than once."""
        return self.train_iters * self.global_batch / max(samples, 1)


BUDGETS = {
    # minutes on a 2-core CPU: a first figure, not a good draft
    "short": Budget("short", prompts=384, max_new_tokens=128, on_truncated="drop-rest", block_size=4, anchors=32,
                    train_iters=400, questions_per_category=2),
    # a GPU, or a long CPU run
    "full": Budget("full", prompts=4000, max_new_tokens=256, draft_layers=2, train_iters=6000, micro_batch=8,
                   global_batch=32, seq_length=512, questions_per_category=10, eval_max_new_tokens=256,
                   shard_size=250),
}
