"""The command-line conventions every tool shares, and what a first run relies on.

Help text (each default once), usage errors (one line, "did you mean", exit status 2, before torch
loads), the known-harmless dependency warnings and progress bars kept out of logs, the shipped
prompts and tiny target, and the README's commands.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
import warnings

import pytest

from megatron_dflash.common import cli
from entry_points import TORCH_PROBE, child_env, evaluate_module, regenerate_module, tool_module
from repo_paths import REPO_ROOT

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = REPO_ROOT
PRETRAIN = os.path.join(ROOT, "pretrain_dflash.py")
CONVERT = os.path.join(ROOT, "tools", "convert_checkpoint.py")
EVALUATE = os.path.join(ROOT, "tools", "evaluate_acceptance.py")
SHIPPED_PROMPTS = os.path.join(ROOT, "examples", "prompts_tiny_target.jsonl")
MT_BENCH_FIXTURE = os.path.join(ROOT, "examples", "mt_bench_tiny_target.jsonl")


def _parsers():
    from megatron_dflash.checkpoint import convert
    from megatron_dflash.training.arguments import build_parser

    top = convert.build_parser()
    subcommands = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction)).choices
    return {"pretrain_dflash.py": build_parser(), "evaluate_acceptance.py": evaluate_module().build_parser(),
            **{f"convert {name}": sub for name, sub in subcommands.items()}}


# ------------------------------------------------------------------------------------------ help


def test_help_shows_every_default_exactly_once():
    for tool, parser in _parsers().items():
        for action in parser._actions:
            if not action.option_strings or action.nargs == 0:
                continue
            formatter = parser._get_formatter()
            formatter.add_argument(action)
            text = " ".join(formatter.format_help().split())
            count = text.lower().count("default")
            where = (tool, action.option_strings[0], text)
            if action.default is None:
                assert count <= 1, where  # "(default: ...)" in words, or nothing to show
            else:
                assert count == 1, where
                assert f"(default: {action.default})" in text or "default" in (action.help or "").lower(), where
    help_text = " ".join(_parsers()["pretrain_dflash.py"].format_help().split())
    for flag, default in (("--seq-length SEQ_LENGTH", "48"), ("--train-iters TRAIN_ITERS", "1200"),
                          ("--lr LR", "0.002"), ("--min-lr MIN_LR", "0.0001"), ("--log-interval LOG_INTERVAL", "50"),
                          ("--dflash-anchors-per-sample DFLASH_ANCHORS_PER_SAMPLE", "512 with --target, 8 for the embedded job")):
        assert f"{flag} " in help_text and f"(default: {default})" in help_text, flag
    assert "gamma + 1 (default 8). (default" not in help_text


# ------------------------------------------------------------------------------------------ usage errors


def test_a_mistyped_flag_gets_one_line_and_a_suggestion():
    done = subprocess.run([sys.executable, PRETRAIN, "--train-iter", "5"], capture_output=True, text=True,
                          timeout=120, env=child_env())
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "usage:" not in done.stderr, done.stderr
    assert "unrecognized arguments: --train-iter 5 (did you mean --train-iters?)" in done.stderr
    from megatron_dflash.checkpoint import convert

    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_info:
        convert.main(["to-hf", "--load", "a", "--output", "b", "--valdate"])
    assert exit_info.value.code == 2 and "did you mean --validate?" in err.getvalue(), err.getvalue()
    assert cli.suggest_option("--dflash-blok-size=4", ["--dflash-block-size", "--seed"]) == "--dflash-block-size"
    assert cli.suggest_option("--zzz", ["--dflash-block-size", "--seed"]) is None




@pytest.mark.parametrize("argv, message", [
    ([CONVERT, "to-hf", "--load", "/nonexistent", "--output", "out"], "--load /nonexistent: no such directory."),
    ([CONVERT, "to-megatron", "--load", ROOT, "--output", os.path.join(ROOT, "tools")],
     "overlaps the input"),
    ([EVALUATE, "--target", "/nonexistent", "--draft", "x"], "--target /nonexistent: no such HF model directory."),
    ([EVALUATE, "--draft", "/nonexistent"], "--draft /nonexistent: no such HF draft directory."),
    ([EVALUATE, "--target", ROOT, "--draft", "x"], f"--target {ROOT}: no config.json in it"),
    ([EVALUATE, "--draft", os.path.join(ROOT, "megatron_dflash", "assets", "tiny_target"), "--prompts", "/no.jsonl"],
     "--prompts /no.jsonl: no such prompt file."),
    ([EVALUATE, "--draft", os.path.join(ROOT, "megatron_dflash", "assets", "tiny_target"), "--benchmark", "gsm8k",
      "--benchmark-file", MT_BENCH_FIXTURE], f"{MT_BENCH_FIXTURE}:1: field 'question' is missing"),
    ([PRETRAIN, "--target", "/nonexistent"], "--target /nonexistent: no such HF model directory."),
    ([PRETRAIN, "--target", ROOT], f"--target {ROOT}: no config.json in it; expected a HF model directory."),
    ([PRETRAIN, "--data-format", "chat", "--train-data", "/no.jsonl"], "--train-data /no.jsonl: no such data file or directory."),
    ([PRETRAIN, "--data-format", "text", "--data-path", ROOT], f"--data-path {ROOT}: a data directory holds .jsonl, .json or .parquet files"),
    ([PRETRAIN, "--data-format", "text", "--train-data", SHIPPED_PROMPTS, "--valid-data", "/no.jsonl"],
     "--valid-data /no.jsonl: no such data file or directory."),
    ([PRETRAIN, "--data-format", "indexed", "--train-data", "/no/prefix"],
     "--train-data /no/prefix: --data-format indexed expects the Megatron indexed dataset prefix"),
    ([PRETRAIN, "--tokenizer", "/nonexistent"], "--tokenizer /nonexistent: no such tokenizer directory."),
    ([PRETRAIN, "--dflash-init-from", ROOT], f"--dflash-init-from {ROOT}: no config.json in it; expected a HF drafter"),
    ([PRETRAIN, "--dflash-eval-prompts", "/no.jsonl"], "--dflash-eval-prompts /no.jsonl: no such JSONL prompt file."),
    ([PRETRAIN, "--load", PRETRAIN], f"--load {PRETRAIN}: not a directory."),
], ids=["convert-missing-load", "convert-overlap", "evaluate-missing-target", "evaluate-missing-draft",
        "evaluate-not-a-model", "evaluate-missing-prompts", "evaluate-benchmark-record", "pretrain-missing-target", "pretrain-not-a-model",
        "pretrain-missing-train-data", "pretrain-data-is-a-directory", "pretrain-missing-valid-data",
        "pretrain-missing-indexed-prefix", "pretrain-missing-tokenizer", "pretrain-init-from-not-a-drafter",
        "pretrain-missing-eval-prompts", "pretrain-load-is-a-file"])
def test_bad_paths_fail_in_one_line_before_torch_loads(argv, message):
    done = subprocess.run([sys.executable, "-c", TORCH_PROBE, *argv], capture_output=True, text=True, timeout=120,
                          env=child_env())
    assert done.stdout.strip() == "torch loaded: False exit: 2", (done.stdout, done.stderr)
    assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr


def test_bad_prompt_files_are_one_line_usage_errors(tmp_path, capsys):
    tool = evaluate_module()
    target = os.path.join(ROOT, "megatron_dflash", "assets", "tiny_target")
    bad = tmp_path / "bad.jsonl"
    for content, message in (('{"text": "count from 1 to 4"}\n{"text": 3}\n', "bad.jsonl:2: 'text' / 'prompt' must be a string"),
                             ("not json\n", "bad.jsonl:1: invalid JSON"),
                             ("\n\n", "holds no prompt"),
                             ('{"input_ids": ["a"]}\n', "'input_ids' must be a list of integers")):
        bad.write_text(content)
        # the draft is the target's directory: never reached, the prompts fail first
        assert tool.main(["--target", target, "--draft", target, "--prompts", str(bad)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    from megatron_dflash.training.arguments import ArgumentError
    from megatron_dflash.training.job import load_eval_prompts

    with pytest.raises(ArgumentError, match="bad.jsonl:1: expected a JSON object with one of"):
        bad.write_text('{"question": "x"}\n')
        load_eval_prompts(str(bad), tokenizer=None)


def test_pretrain_reports_a_bad_target_in_one_line_without_warnings():
    done = subprocess.run([sys.executable, PRETRAIN, "--target", "/nonexistent", "--data-format", "synthetic"],
                          capture_output=True, text=True, timeout=300, env=child_env())
    assert done.returncode == 2
    assert done.stderr == "pretrain_dflash.py: error: --target /nonexistent: no such HF model directory.\n", done.stderr


# ------------------------------------------------------------------------------------------ quiet output

_NOISY = """
import sys, tempfile
if sys.argv[1] == "quiet":
    from megatron_dflash.common.cli import quiet_dependency_warnings
    quiet_dependency_warnings()
import megatron.core.optimizer  # warns without Transformer Engine and Apex
from transformers import Qwen3Config, Qwen3ForCausalLM
config = Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=8)
with tempfile.TemporaryDirectory() as d:
    Qwen3ForCausalLM(config).save_pretrained(d)   # "Writing model shards" bar
    Qwen3ForCausalLM.from_pretrained(d)           # "Loading weights" bar
"""


def test_known_harmless_warnings_and_progress_bars_stay_out_of_logs():
    """Piped stderr (not a terminal): quiet entry points print nothing; the same code without the
    filter prints megatron's warnings and transformers' bars (so this test can fail)."""
    runs = {mode: subprocess.run([sys.executable, "-c", _NOISY, mode], capture_output=True, text=True,
                                 timeout=300, env=child_env())
            for mode in ("quiet", "noisy")}
    for done in runs.values():
        assert done.returncode == 0, done.stderr
    assert "Transformer Engine and Apex are not installed" in runs["noisy"].stderr
    assert "Loading weights" in runs["noisy"].stderr or "Writing model shards" in runs["noisy"].stderr
    assert "Transformer Engine" not in runs["quiet"].stderr and "Loading weights" not in runs["quiet"].stderr
    assert "Writing model shards" not in runs["quiet"].stderr, runs["quiet"].stderr


def test_only_the_known_warnings_are_filtered():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli.quiet_dependency_warnings(stream=io.StringIO())
        # how megatron's torch_dist loader reaches torch's deprecated load_state_dict
        warnings.warn_explicit("`load_state_dict` is deprecated and will be removed in future versions.",
                               FutureWarning, "torch.py", 1, module="megatron.core.dist_checkpointing.strategies.torch")
        warnings.warn_explicit("Transformer Engine and Apex are not installed. Falling back",
                               UserWarning, "x.py", 1, module="megatron.core.optimizer")
        # the same words from anywhere else, or another warning from megatron, still show
        warnings.warn_explicit("Transformer Engine and Apex are not installed.", UserWarning, "y.py", 1,
                               module="somebody.else")
        warnings.warn_explicit("something else", UserWarning, "x.py", 1, module="megatron.core.optimizer")
    assert [str(w.message) for w in caught] == ["Transformer Engine and Apex are not installed.", "something else"]


def test_console_log_keeps_what_was_printed_once_the_run_is_valid(tmp_path):
    from megatron_dflash.training.rundir import ConsoleLog

    out = io.StringIO()
    saved = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = out
    try:
        log = ConsoleLog.start()
        print("before the run directory exists")
        log.attach(str(tmp_path / "run" / "console.log"))
        print("after", file=sys.stderr)
        sys.stderr.write("\r[####......] 4/10 bar redraw\033[K")
        log.stop()
    finally:
        sys.stdout, sys.stderr = saved
    assert (tmp_path / "run" / "console.log").read_text() == "before the run directory exists\nafter\n"
    assert "bar redraw" in out.getvalue()


# ------------------------------------------------------------------------------------------ prompts, report


def test_one_prompt_format_for_both_tools(tmp_path):
    from megatron_dflash.training.job import load_eval_prompts
    from megatron_dflash.embedded_job.synthetic_corpus import build_tokenizer

    tokenizer = build_tokenizer()
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (
        {"text": "count from 3 to 9"}, {"prompt": "count from 3 to 9"},
        {"messages": [{"role": "user", "content": "count from 3 to 9"}, {"role": "assistant", "content": "3 4"}]},
        {"input_ids": [1, 2, 3]},
        {"text": "please explain how photosynthesis works"})))
    logged = []
    trainer = load_eval_prompts(str(path), tokenizer, log=logged.append)
    tool = evaluate_module()
    holder = tool.PromptTokenizer("unused")
    holder._tokenizer = tokenizer
    ids, tool_warnings, _ = tool.read_prompts(str(path), None, holder)
    assert ids == trainer
    assert trainer[0] == trainer[1] == tokenizer("count from 3 to 9")["input_ids"]
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "count from 3 to 9"}], tokenize=True,
                                         add_generation_prompt=True, return_dict=True)["input_ids"]
    assert trainer[2] == list(chat) and trainer[3] == [1, 2, 3]
    # the natural-language prompt is mostly unknown words: one warning, from both tools, naming the line
    assert len(logged) == len(tool_warnings) == 1
    assert "p.jsonl:5: 4 of 5 words are unknown" in tool_warnings[0] and "prompts_tiny_target.jsonl" in logged[0]


def test_no_cycle_and_slow_speedup_are_explained():
    from megatron_dflash.training.evaluation import acceptance_line

    tool = evaluate_module()
    assert "first token is the stop token 5" in tool.no_cycle_reason([5], [5], 64)
    assert "--max-new-tokens 1" in tool.no_cycle_reason([7], [5], 1)
    note = tool.speedup_note(0.71, 3.0, "cpu")
    assert note.startswith("speedup < 1: on CPU a small target costs about as much per forward as the draft")
    assert "3.00 tokens per target forward" in note
    assert tool.speedup_note(1.4, 3.0, "cuda") is None
    line = acceptance_line({"acceptance_length": float("nan"), "cycles": 0, "prompts": 2, "generated_tokens": 2,
                             "tokens_per_target_forward": 1.0, "no_cycle_reason": "no verify cycle ran: because"})
    assert "nan" not in line and "n/a over 2 held-out prompts: no verify cycle ran: because" in line


# ------------------------------------------------------------------------------------------ shipped assets


def test_shipped_prompts_are_tasks_the_shipped_target_knows():
    """Every word is in the tiny target's vocabulary, and the target answers the deterministic tasks
    exactly (greedy); sequences of a random length must at least continue correctly."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_dflash.data.prompts import read_prompt_file, tokenize_prompt, unknown_token_fraction
    from megatron_dflash.embedded_job.tiny_target import SHIPPED_TARGET_DIR

    tokenizer = AutoTokenizer.from_pretrained(SHIPPED_TARGET_DIR)
    model = AutoModelForCausalLM.from_pretrained(SHIPPED_TARGET_DIR).eval()
    items = read_prompt_file(SHIPPED_PROMPTS)
    assert len(items) >= 12
    prompts = [tokenize_prompt(item, tokenizer) for item in items]
    for item, ids in zip(items, prompts):
        assert unknown_token_fraction(ids, tokenizer) == 0.0, item.where
    width = max(len(p) for p in prompts)  # one left-padded batch: one forward per generated token
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    exact = 0
    for item, row in zip(items, out[:, width:].tolist()):
        answer = tokenizer.decode(row, skip_special_tokens=True).split()
        reference = item.record["messages"][-1]["content"].split()
        if item.record["messages"][0]["content"].startswith("continue the sequence"):
            n = min(len(answer), len(reference))
            assert n >= 5 and answer[:n] == reference[:n], (item.where, answer)
        else:
            exact += answer == reference
    assert exact == sum(1 for i in items if not i.record["messages"][0]["content"].startswith("continue"))


def test_shipped_tiny_target_is_the_recipe():
    """The shipped target is what `train_tiny_target(TinyTargetRecipe())` writes: its recipe, and a
    short rebuild reproduces the recorded first steps (losses and parameter norms)."""
    import torch

    from megatron_dflash.embedded_job.tiny_target import (SHIPPED_TARGET_DIR, TRACE_STEPS, TinyTargetRecipe,
                                                      embedded_target_dir, matches_recipe, recipe_trace)

    assert matches_recipe(SHIPPED_TARGET_DIR) and embedded_target_dir() == SHIPPED_TARGET_DIR
    size = os.path.getsize(os.path.join(SHIPPED_TARGET_DIR, "model.safetensors"))
    assert size < 8 * 2**20
    with open(os.path.join(SHIPPED_TARGET_DIR, "trace.json")) as f:
        shipped = json.load(f)
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trace = recipe_trace(TinyTargetRecipe(), steps=TRACE_STEPS, log=lambda *_: None)
    finally:
        torch.set_num_threads(saved)
    assert shipped["steps"] == trace["steps"] == TRACE_STEPS
    assert trace["losses"] == pytest.approx(shipped["losses"], rel=1e-5)
    assert trace["parameter_norms"].keys() == shipped["parameter_norms"].keys()
    for name, norm in trace["parameter_norms"].items():
        assert norm == pytest.approx(shipped["parameter_norms"][name], rel=1e-4), name
    # a recipe that does not match is not taken for the shipped one
    assert not matches_recipe(SHIPPED_TARGET_DIR, TinyTargetRecipe(train_steps=599))


def test_the_embedded_job_keeps_a_checkpoint_and_uses_the_shipped_target():
    from megatron_dflash.training.arguments import parse_args
    from megatron_dflash.training.job import prepare_job
    from megatron_dflash.embedded_job.tiny_target import SHIPPED_TARGET_DIR

    job = prepare_job(parse_args([]), world_size=1, env={"DFLASH_RUN_NAME": "first"}, cuda=False, log=print)
    assert job.target_dir == SHIPPED_TARGET_DIR and job.embedded_target
    assert job.run_dir == os.path.join("runs", "first")
    assert job.args.save == os.path.join("runs", "first", "checkpoints")
    assert job.export_dir == os.path.join("runs", "first", "hf")
    assert len(job.eval_prompts) == 24
    explicit = prepare_job(parse_args(["--target", SHIPPED_TARGET_DIR, "--dflash-num-layers", "2",
                                       "--dflash-block-size", "8", "--data-format", "synthetic",
                                       "--dflash-eval-prompts", "0"]), world_size=1,
                           env={"DFLASH_RUN_NAME": "second"}, cuda=False, log=print)
    assert explicit.args.save is None and not explicit.embedded_target  # real runs choose their --save


# ------------------------------------------------------------------------------------------ README


def _readme_commands() -> list[str]:
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    commands = []
    for block in blocks:
        joined = re.sub(r"\\\n\s*", "", block)
        commands += [line.split("#")[0].strip() for line in joined.splitlines() if line.strip()]
    return commands


def test_readme_commands_parse_and_match_ci():
    commands = _readme_commands()
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = [line.strip() for line in f if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert ci == commands[:len(ci)], (ci, commands)
    parsers = _parsers()
    checked = 0
    for command in commands:
        words = shlex.split(command)
        if words[:2] == ["python", "tools/convert_checkpoint.py"]:
            parsers[f"convert {words[2]}"].parse_args(words[3:])
        elif words[:2] == ["python", "tools/evaluate_acceptance.py"]:
            parsers["evaluate_acceptance.py"].parse_args(words[2:])
        elif "pretrain_dflash.py" in words and "--recipe" in words:  # a ready-made job: its own command line
            from megatron_dflash.recipes.cli import build_parser as recipe_parser

            recipe_parser().parse_args(words[words.index("pretrain_dflash.py") + 1:])
        elif words[:2] == ["python", "pretrain_dflash.py"] or "pretrain_dflash.py" in words:
            parsers["pretrain_dflash.py"].parse_args(words[words.index("pretrain_dflash.py") + 1:])
        else:
            continue
        checked += 1
    assert checked >= 5
    readme = open(os.path.join(ROOT, "README.md")).read()
    from megatron_dflash.training.monitor import DECODE_ACCEPTANCE, TRAIN_ACCEPTANCE, VALID_ACCEPTANCE

    for label in (TRAIN_ACCEPTANCE, VALID_ACCEPTANCE, DECODE_ACCEPTANCE):
        assert label in readme, label


def _world_size(words: list[str]) -> int:
    """The ranks a README line launches: torchrun's --nnodes x --nproc-per-node, else one."""
    if words[0] != "torchrun":
        return 1
    size = {"--nnodes": 1, "--nproc-per-node": 1}
    for flag in size:
        if flag in words:
            size[flag] = int(words[words.index(flag) + 1])
    return size["--nnodes"] * size["--nproc-per-node"]


def _script_and_argv(words: list[str]):
    """(the repository script a README line runs, its arguments), or None for other commands (pip, vllm, ...)."""
    for i, word in enumerate(words):
        if word == "pretrain_dflash.py" or (word.startswith(("tools/", "benchmarks/")) and word.endswith(".py")):
            return word, words[i + 1:]
    return None


MODEL_FLAGS = ("--target", "--tokenizer", "--dflash-init-from")


def test_readme_commands_are_valid_command_lines(monkeypatch, tmp_path):
    """Every repository command of the README's code blocks (the quickstarts, the cluster launch, regeneration,
    evaluation, ...) is accepted by its tool's real parser, and training's by the whole argument check for the
    ranks it launches (flag combinations, parallel sizes, batch sizes); a hub id given as a model is accepted (read
    here from a cache filled in advance, offline). The files it names are not checked here (they are the user's)."""
    from hub_cache import fill_hub_cache, offline_hub_env
    from megatron_dflash.common.model_dirs import looks_like_hub_id, resolve_model_dir
    from megatron_dflash.training import arguments

    monkeypatch.setattr(arguments, "check_input_paths", lambda args: None)  # the user's files, not here
    commands = [shlex.split(command) for command in _readme_commands()]
    hub_ids = {words[i + 1] for words in commands for i, w in enumerate(words[:-1])
               if w in MODEL_FLAGS and looks_like_hub_id(words[i + 1])}
    assert "Qwen/Qwen3-8B" in hub_ids
    for hub_id in hub_ids:
        fill_hub_cache(str(tmp_path / "hub"), hub_id)
    for key, value in offline_hub_env(str(tmp_path / "hub")).items():
        monkeypatch.setenv(key, value)
    regenerate = regenerate_module()
    serving = tool_module("check_serving")
    checked = set()
    for words in commands:
        found = _script_and_argv(words)
        if found is None or found[0].startswith("benchmarks/"):
            continue
        script, argv = found
        for i, word in enumerate(argv[:-1]):
            if word in MODEL_FLAGS and looks_like_hub_id(argv[i + 1]):
                assert os.path.isdir(resolve_model_dir(word, argv[i + 1], must_contain=None)), (script, word)
        if script == "pretrain_dflash.py" and "--recipe" in argv:  # a ready-made job: its own command line
            from megatron_dflash.recipes.cli import build_parser as recipe_parser

            recipe_parser().parse_args(argv)
        elif script in ("pretrain_dflash.py", "tools/cache_target_states.py", "tools/count_draft_vocab.py"):
            if script == "tools/count_draft_vocab.py":  # pretrain_dflash.py's arguments plus its --output
                argv = tool_module("count_draft_vocab")._split_output(argv)[1]
            args = arguments.parse_args(argv)
            arguments.validate_args(args, _world_size(words), env={}, cuda="--bf16" in argv or words[0] == "torchrun")
        elif script == "tools/regenerate_data.py":
            regenerate.settings_of(regenerate.build_parser().parse_args(argv))
        elif script == "tools/evaluate_acceptance.py":
            evaluate_module().build_parser().parse_args(argv)
        elif script == "tools/check_serving.py":
            serving.runtime_versions(serving.build_parser().parse_args(argv).runtime_version)
        elif script == "tools/convert_checkpoint.py":
            _parsers()[f"convert {argv[0]}"].parse_args(argv[1:])
        else:
            continue  # tools/build_tiny_target.py: its parser is built inside its main
        checked.add(script)
    assert {"pretrain_dflash.py", "tools/cache_target_states.py", "tools/regenerate_data.py",
            "tools/evaluate_acceptance.py", "tools/check_serving.py", "tools/convert_checkpoint.py"} <= checked


def test_the_shipped_target_is_package_data():
    """An installed (non-editable) package carries every file of the shipped target."""
    import ast
    import fnmatch

    from megatron_dflash.embedded_job.tiny_target import SHIPPED_TARGET_DIR

    with open(os.path.join(ROOT, "setup.py")) as f:
        tree = ast.parse(f.read())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    package_data = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "package_data"))
    package = os.path.join(ROOT, "megatron_dflash")
    for name in os.listdir(SHIPPED_TARGET_DIR):
        relative = os.path.relpath(os.path.join(SHIPPED_TARGET_DIR, name), package)
        assert any(fnmatch.fnmatch(relative, pattern) for pattern in package_data["megatron_dflash"]), relative
