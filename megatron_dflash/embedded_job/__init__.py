"""The embedded default job of `pretrain_dflash.py`: everything it needs besides the library.

`synthetic_corpus` is its deterministic chat corpus and word-level tokenizer, `tiny_target` its
tiny Qwen3 target (shipped in `megatron_dflash/assets/tiny_target`, or built and cached). Both
depend only on torch / transformers / tokenizers, so the data layer (`data.datasets.SyntheticChatDataset`),
the training job and the tools can use them without reaching into `training/`.
"""
