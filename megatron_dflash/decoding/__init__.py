"""Speculative decoding with a trained draft: `spec_generate`, lossless verification, acceptance
statistics (docs/design.md §3, §17).

May import: every stage before it (`variants`, `checkpoint` included); never `training`.
"""
