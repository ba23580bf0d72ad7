"""Training data, from a file to token ids and loss masks (docs/design.md §8 Data path).

Owns: dataset files and record formats (`formats`), chat tokenisation with its options and loss mask (`chat`),
samples and their IDs (`samples`), the datasets
(chat / text records of any format, megatron indexed, the embedded job's synthetic chats: `datasets`), packing, collation,
the resumable data-parallel sampler and megatron GPT batches (`batching`), and the prompt-file format shared
by evaluation (`prompts`). The plan hook is the plan's (`plan.data_hook`).
May import: `common`, `embedded_job`, `plan`.
"""
