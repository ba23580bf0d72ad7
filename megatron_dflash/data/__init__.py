"""Training data, from a file to token ids and loss masks (docs/design.md §8 Data path).

Owns: the datasets (chat / text JSONL, megatron indexed, the embedded job's synthetic chats), chat
tokenisation with its assistant mask, packing and collation, the resumable data-parallel sampler,
megatron GPT batches, and the prompt-file format shared by evaluation (`prompts`). The plan hook is the
plan's (`plan.data_hook`).
May import: `common`, `embedded_job`, `plan`.
"""
