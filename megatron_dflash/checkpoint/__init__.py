"""Drafts on disk: the HF safetensors format and megatron's `torch_dist` layout (docs/design.md §10, §11).

Owns: HF directories of the draft (`hf`), which variant a `config.json` names (`architectures`), the
`torch_dist` layout and its in-process save and restricted load (`torch_dist`, `torch_dist_save`,
`torch_dist_load`, `restricted_unpickle`), HF <-> `torch_dist` conversion and its command line.
May import: every stage before it (`variants` included); never `decoding` or `training`.
"""
