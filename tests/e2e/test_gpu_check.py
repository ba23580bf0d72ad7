"""`benchmarks/gpu_check.py` stays runnable between GPU runs: every check runs here on the CPU, at small sizes.

On the CPU the flex comparison is forward only (flex has no CPU backward), Transformer Engine does not
import and there is one device, so those rows must say why they are skipped.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch
from repo_paths import REPO_ROOT

_PATH = os.path.join(REPO_ROOT, "benchmarks", "gpu_check.py")


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_check_compares_flex_with_chunked(gpu_check, dtype):
    row = gpu_check.check_attention("cpu", dtype, seq_length=64, num_blocks=4, block_size=4, heads=4, kv_heads=2,
                                    head_dim=16)
    assert row.status == "ok", row
    assert "forward only" in row.detail
    assert float(row.measured.split()[3]) <= gpu_check.ATTENTION_TOLERANCE[dtype]


def test_train_step_check_runs_the_megatron_engine(gpu_check, tiny_target):
    torch.set_num_threads(1)
    row = gpu_check.check_train_step(("--target", tiny_target, "--dflash-num-layers", "2", "--dflash-block-size", "8",
                                      "--seq-length", "48", "--micro-batch-size", "2",
                                      "--dflash-anchors-per-sample", "4", "--data-format", "synthetic",
                                      "--synthetic-train-samples", "16", "--synthetic-valid-samples", "4",
                                      "--eval-iters", "1"))
    assert row.status == "ok", row
    assert "engine MegatronEngine" in row.detail and "bf16" in row.detail


def test_draft_step_check_reports_time_and_the_auto_kernel(gpu_check):
    size = gpu_check.DraftSize(seq_length=64, anchors=4, block_size=4, hidden=64, intermediate=96, layers=2, heads=4,
                               kv_heads=2, head_dim=16, vocab=128, target_layers=8)
    row = gpu_check.check_draft_step("cpu", size, dtype=torch.float32, repeats=1)
    assert row.status == "ok", row
    assert row.measured.endswith("GiB") and "auto attention -> chunked" in row.detail  # auto on CPU: chunked


def test_checks_that_need_hardware_skip_with_a_reason(gpu_check, tiny_target):
    try:
        import transformer_engine  # noqa: F401
        pytest.skip("transformer_engine imports here")
    except Exception:  # noqa: BLE001
        pass
    te = gpu_check.check_te_layer_spec(tiny_target, "cpu")
    assert (te.status, te.detail) == ("skip", "transformer_engine does not import")
    if not torch.cuda.is_available():
        tp2 = gpu_check.check_torchrun_tp2("unused")
        assert tp2.status == "skip" and "0 GPU(s)" in tp2.detail


def test_te_check_runs_its_comparison_with_the_local_spec(gpu_check, tiny_target):
    from megatron_dflash.training.device_shim import megatron_target_on_cpu

    torch.set_num_threads(1)
    with megatron_target_on_cpu():  # megatron's GPTModel (the target) on CPU
        row = gpu_check.check_te_layer_spec(tiny_target, "cpu", specs=(False, False))
    assert row.status == "ok" and row.measured == "max rel diff of the taps 0.00e+00", row


def test_table_and_exit_status(gpu_check, monkeypatch, capsys):
    rows = [gpu_check.Row("a", "ok", "1 ms", "x"), gpu_check.Row("b", "skip", "", "no GPU")]
    table = gpu_check.format_table(rows)
    assert table.splitlines()[0].startswith("check") and len(table.splitlines()) == 4
    failing = gpu_check._guarded("boom", lambda: 1 / 0)
    assert failing.status == "FAIL" and "ZeroDivisionError" in failing.detail
    monkeypatch.setattr(gpu_check, "check_torchrun_tp2", lambda cache: failing)
    assert gpu_check.main(["--device", "cpu", "--only", "torchrun_tp2"]) == 1
    assert "FAIL" in capsys.readouterr().out
