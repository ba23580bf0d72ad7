"""`tools/check_serving.py` as a user runs it: help and usage errors before torch loads, the report and its
exit status on the converter's exports (`to-hf`, and `to-hf --export-for sglang` for Domino), the JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_dflash.checkpoint import convert
from megatron_dflash.checkpoint.conversion import convert_hf_to_megatron
from megatron_dflash.checkpoint.hf import save_hf_checkpoint
from megatron_dflash.checkpoint.serving import check_serving
from entry_points import TORCH_PROBE, child_env
from repo_paths import REPO_ROOT
from variant_drafts import variant_draft

pytestmark = pytest.mark.usefixtures("one_thread")

TOOL = os.path.join(REPO_ROOT, "tools", "check_serving.py")
PROG = "check_serving.py"


@pytest.mark.parametrize("argv, expected, message", [
    (["--help"], "exit: 0", None),
    (["/nonexistent"], "exit: 2", "draft /nonexistent: no such directory."),
    ([REPO_ROOT], "exit: 2", f"draft {REPO_ROOT}: no config.json in it"),
    ([REPO_ROOT, "--runtime-version", "vllm"], "exit: 2", "--runtime-version vllm: give RUNTIME=VERSION"),
], ids=["help", "missing-draft", "not-a-draft", "runtime-version-not-name=version"])
def test_help_and_usage_errors_answer_before_torch_loads(argv, expected, message):
    done = subprocess.run([sys.executable, "-c", TORCH_PROBE, TOOL, *argv], capture_output=True, text=True,
                          timeout=120, env=child_env())
    assert done.stdout.strip().splitlines()[-1] == f"torch loaded: False {expected}", done.stdout + done.stderr
    if message is not None:
        assert len(done.stderr.strip().splitlines()) == 1 and message in done.stderr, done.stderr


def _converted(tmp_path, variant: str, *extra) -> str:
    """`variant`'s tiny draft written by the converter's command line (HF -> torch_dist -> `to-hf` + `extra`)."""
    body, _, _ = variant_draft(variant)
    save_hf_checkpoint(body, str(tmp_path / variant / "hf"))
    convert_hf_to_megatron(str(tmp_path / variant / "hf"), str(tmp_path / variant / "megatron"))
    out = str(tmp_path / variant / "out")
    assert convert.main(["to-hf", "--load", str(tmp_path / variant / "megatron"), "--output", out, *extra]) == 0
    return out


def _run(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, TOOL, *argv], capture_output=True, text=True, timeout=300,
                          env=child_env(OMP_NUM_THREADS="1"))


def test_the_report_exit_status_and_json_of_the_converters_exports(tmp_path, capsys):
    domino = _converted(tmp_path, "domino", "--export-for", "sglang")
    assert "--export-for sglang: architectures DominoDraftModel -> DFlashDraftModel" in capsys.readouterr().out
    done = _run(domino, "--json", str(tmp_path / "domino.json"))
    assert done.returncode == 1, done.stdout + done.stderr  # vLLM serves no Domino draft
    lines = done.stdout.splitlines()
    assert lines[0] == f"serving check of {domino}"
    assert "vLLM 0.34.0: does not load" in lines and "SGLang 0.5.23: loads" in lines
    assert any("no Domino correction head" in line for line in lines)
    assert lines[-2] == "  # SGLang 0.5.23" and "--speculative-algorithm DFLASH" in lines[-1] and "--dtype bfloat16" in lines[-1]
    report = json.loads((tmp_path / "domino.json").read_text())
    expected = [r.to_json() for r in check_serving(domino)]
    assert report["runtimes"] == expected and report["exit_status"] == 1

    dflash = _converted(tmp_path, "dflash")
    done = _run(dflash)
    assert done.returncode == 0 and "vLLM 0.34.0: loads" in done.stdout.splitlines(), done.stdout + done.stderr
    assert done.stdout.splitlines()[-3].strip().startswith("vllm serve <target> --speculative-config")

    dflash2 = _converted(tmp_path, "dflash2")
    done = _run(dflash2, "--runtime-version", "sglang=003b23d", "vllm=036a00d")
    assert done.returncode == 1 and "SGLang 003b23d: does not load" in done.stdout.splitlines(), done.stdout
    assert "vLLM 036a00d: loads" in done.stdout.splitlines()
    done = _run(dflash2, "--runtime-version", "sglang=0.5.22")
    assert done.returncode == 2 and done.stderr.strip() == (f"{PROG}: error: --runtime-version sglang=0.5.22: no rules "
                                                            "for that release (known: 0.5.23, 003b23d)."), done.stderr
