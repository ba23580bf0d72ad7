"""Shared pytest fixtures, and where the tests' shared code lives.

* `tests/<stage>/test_<module>.py` mirrors the package; `tests/e2e/` holds the end-to-end suites. A test
  module never imports another one (tests/test_test_layout.py checks it).
* `tests/helpers/`: what several test modules use, each module named for what it holds:
  `tp_harness.py` (the gloo rank pool), `tp_checks.py` (TP-vs-TP=1 comparisons and bad-rank inputs),
  `builders.py` (tiny draft sizes, the smollm2-135m recipe's draft size, body inputs), `tiny_targets.py` (tiny HF targets for the target
  tests), `tiny_decoding.py` (targets, drafts, prompts and statistics checks for decoding),
  `reference_sampling.py` (the exact sampling distribution), `reference_decode.py` / `reference_engine.py`
  (oracles of the old decode path and of the training engine), `nemo_reference.py` (NeMo AutoModel's
  drafters as references), `kimi_k3_configs.py` (tiny Kimi K3 targets and drafts), `data_records.py`
  (a chat, a `Sample`), `largest_tensor.py` (the memory bound of the loss kernels), `training_runs.py`
  (short runs of the training entry point), `entry_points.py` (the tools' modules, a child process's
  environment), `chat_server.py` (the regeneration oracle and a chat-completions server on the tiny target), `repo_paths.py` (where the repository is),
  `variant_drafts.py` (a tiny draft of every built-in variant and its HF Qwen3 target), `gguf_files.py` (a tiny
  random Llama target written as a GGUF), `smollm2_tiny.py` (the SmolLM2 job's inputs and budget at test size).
* Fixtures: here for every folder (`tp_pool`, `one_thread`, `tiny_target`); in a folder's `conftest.py`
  for that folder (`data/`: the tokenizers `tok`, `tok_plain`; `e2e/`: the short run `trained`).
"""

from __future__ import annotations

import os
import signal
import sys

import pytest
import torch

# The tests import the package from the checkout and the modules of tests/helpers/ by module name. The
# test folders are on sys.path too (a test module's base name is unique across them): the rank processes
# spawned by the harness inherit sys.path and import the functions they run from their test module by name.
_TESTS = os.path.dirname(os.path.abspath(__file__))
_FOLDERS = sorted(dirpath for dirpath, _, names in os.walk(_TESTS)
                  if any(name.startswith("test_") and name.endswith(".py") for name in names))
for _path in reversed([os.path.dirname(_TESTS), os.path.join(_TESTS, "helpers"), *_FOLDERS]):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from tp_harness import RankPools  # noqa: E402

# A suite started in the background by a non-interactive shell (`pytest ... &`, as some CI runners do) inherits
# SIGINT ignored, and so would every child it starts: the Ctrl-C tests (a run interrupted ends in one line with
# status 130) would then see no interrupt at all. The suite takes Python's own handler back; children start
# with the default disposition again.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def tp_pool():
    """`tp_pool(world_size)` -> a `RankPool` of gloo ranks, spawned once per session.

    `tp_pool(2).run(fn, *args)` calls the module-level `fn(rank, world_size, *args)` on every
    rank (with megatron's parallel_state set up for TP = world size) and returns the list
    of per-rank results; an exception on any rank fails the test with its traceback.
    """
    pools = RankPools()
    try:
        yield pools
    finally:
        pools.close()


@pytest.fixture
def one_thread():
    """One CPU thread in this process for the test: tiny matmuls gain nothing from threads, and OpenMP
    threads that busy-wait crawl on a loaded machine. Modules opt in with
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    """A tiny Qwen3 target (6 layers) trained for 20 steps, in a temporary cache (never the user's); built
    once per session and shared read-only by every module."""
    from megatron_dflash.embedded_job.tiny_target import TinyTargetRecipe, ensure_tiny_target

    cache = tmp_path_factory.mktemp("dflash-cache")
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return ensure_tiny_target(str(cache), TinyTargetRecipe(train_steps=20, batch_size=8, seq_length=48),
                                  log=lambda *a: None)
    finally:
        torch.set_num_threads(saved)
