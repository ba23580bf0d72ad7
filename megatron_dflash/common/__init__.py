"""What every stage shares, and nothing stage-specific (docs/design.md §7 Module map).

Owns: publishing files whole or not at all (`atomic`), the expected-failure classes (`errors`), what every
command line shares (`cli`), the 32-bit hashing behind deterministic draws (`hashing`), and the parallel
helpers (`parallel`: megatron's process groups set up and released, cross-rank agreement).
May import: the standard library, torch and megatron-core; no other stage.
"""
