"""The CLI as a user runs it on the default model: `python -m conveyor.cli` in a child process, and the other
command lines through the console script's own entry point (conveyor.cli.main, run by tests/helpers/run_cli.py)
in one child interpreter: one torch import between them, each line with its own stdin, stdout, stderr, exit status
and logging set-up, as in a process of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = str(Path(__file__).resolve().parents[1])
CLI = [sys.executable, "-m", "conveyor.cli"]
RUNNER = [sys.executable, os.path.join(ROOT, "tests", "helpers", "run_cli.py")]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
SMALL = ["--kv-cache-memory", "64MiB", "--max-model-len", "512"]


CHAT_HISTORY = "My name is Alice and I live in Lisbon.\nWhat is my name?\n"
CHAT_OVERFLOW = "Hi\nTell me a long story about a dragon and a knight.\nAnd another one, please.\n" + "x " * 200 + "\n"
MODEL_LINES: dict[str, tuple[list[str], str]] = {
    # 16 tokens a reply tell the answer with the first turn in its context from the answer without it
    "chat-history": (["chat", "--max-tokens", "16", *SMALL], CHAT_HISTORY),
    "chat-fresh": (["chat", "--max-tokens", "16", *SMALL], "What is my name?\n"),
    "chat-exit": (["chat", *SMALL], "/exit\nnever read\n"),
    "chat-overflow": (
        ["chat", "--max-tokens", "16", "--kv-cache-memory", "64MiB", "--max-model-len", "96"],
        CHAT_OVERFLOW,
    ),
    "generate-n-stop-verbose": (
        [
            "generate",
            "Count: one, two,",
            "--raw",
            "-n",
            "2",
            "--temperature",
            "0.8",
            "--seed",
            "1",
            "--stop",
            "five",
            "--max-tokens",
            "12",
            "-v",
            *SMALL,
        ],
        "",
    ),
}
"""The command lines that load the model, by name."""
MODEL_LINES_OF = {
    "test_chat_keeps_history_and_exits_on_eof": ["chat-history", "chat-fresh"],
    "test_chat_exit_command": ["chat-exit"],
    "test_chat_drops_the_oldest_turns_when_the_context_is_full": ["chat-overflow"],
    "test_generate_with_n_stop_and_verbose_after_the_command": ["generate-n-stop-verbose"],
}


def _lines_of(item: Any) -> dict[str, tuple[list[str], str]]:
    """The named (argv, stdin) lines a collected test of this module reads from `cli_runs`."""
    params = item.callspec.params if hasattr(item, "callspec") else {}
    if "args" in params:  # test_bad_flags_give_clear_errors
        return {" ".join(params["args"]): (params["args"], "")}
    if "command" in params:  # test_every_command_prints_its_help
        argv = [*params["command"], "--help"]
        return {" ".join(argv): (argv, "")}
    return {name: MODEL_LINES[name] for name in MODEL_LINES_OF.get(getattr(item, "originalname", item.name), [])}


@pytest.fixture(scope="module")
def cli_runs(request: pytest.FixtureRequest) -> dict[str, dict[str, Any]]:
    """The lines of this module's collected tests, run together in one child interpreter -> {name: {rc, stdout,
    stderr}}."""
    lines = {
        name: line
        for item in request.session.items
        if item.module is request.module
        for name, line in _lines_of(item).items()
    }
    runs = [{"argv": argv, "stdin": stdin} for argv, stdin in lines.values()]
    done = subprocess.run(RUNNER, input=json.dumps(runs), capture_output=True, text=True, timeout=900, env=ENV)
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(runs), f"the CLI runner stopped after {len(results)} lines:\n{done.stderr[-3000:]}"
    return dict(zip(lines, results))


def test_generate_answers_capital_of_france() -> None:
    done = subprocess.run(
        [*CLI, "generate", "What is the capital of France?", "--max-tokens", "32", *SMALL],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    )
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout
    assert "time to first token" in done.stderr and "tokens/s" in done.stderr


def _replies(result: dict[str, Any]) -> list[str]:
    assert result["rc"] == 0, result["stderr"]
    return [part for part in result["stdout"].split("you> ") if part.startswith("bot> ")]


def test_chat_keeps_history_and_exits_on_eof(cli_runs: dict[str, dict[str, Any]]) -> None:
    replies = _replies(cli_runs["chat-history"])
    assert len(replies) == 2 and all(len(r) > len("bot> \n") for r in replies)
    fresh = _replies(cli_runs["chat-fresh"])
    # greedy decoding: the same question answers differently only because the first turn is in the context
    assert replies[1] != fresh[0]


def test_chat_exit_command(cli_runs: dict[str, dict[str, Any]]) -> None:
    done = cli_runs["chat-exit"]
    assert done["rc"] == 0 and "bot>" not in done["stdout"]


def test_chat_drops_the_oldest_turns_when_the_context_is_full(cli_runs: dict[str, dict[str, Any]]) -> None:
    done = cli_runs["chat-overflow"]
    assert done["rc"] == 0, done["stderr"]
    assert done["stdout"].count("bot> ") == 3  # every message that fits got a reply, the session went on
    assert "oldest message(s) left the conversation" in done["stderr"]
    assert "does not fit the 96-token context" in done["stderr"] and "Traceback" not in done["stderr"]


BAD_FLAGS = [
    (["bench", "throughput", "--num-prompts", "0"], "must be at least 1, got 0"),
    (["bench", "throughput", "--runs", "0"], "must be at least 1, got 0"),
    (["bench", "decode-step", "--num-seqs", "-2"], "must be at least 1, got -2"),
    (["generate", "x", "--dtype", "float64"], "invalid choice"),
    (["generate", "x", "--temperature", "-1"], "temperature=-1"),
    (["generate", "x", "--model", "/no/such/model.gguf"], "no such file or folder"),
]
COMMANDS = [
    ["generate"],
    ["chat"],
    ["serve"],
    ["bench", "throughput"],
    ["bench", "latency"],
    ["bench", "serve"],
    ["bench", "decode-step"],
    ["bench", "async-vs-sync"],
]


@pytest.mark.parametrize("args, fragment", BAD_FLAGS)
def test_bad_flags_give_clear_errors(args: list[str], fragment: str, cli_runs: dict[str, dict[str, Any]]) -> None:
    done = cli_runs[" ".join(args)]
    assert done["rc"] == 2
    assert fragment in done["stderr"] and "Traceback" not in done["stderr"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_prints_its_help(command: list[str], cli_runs: dict[str, dict[str, Any]]) -> None:
    """Each engine option appears in --help with its description (argparse must be able to format it)."""
    done = cli_runs[" ".join([*command, "--help"])]
    assert done["rc"] == 0, done["stderr"]
    if command != ["bench", "serve"]:  # the load generator takes no engine options
        text = " ".join(done["stdout"].split())
        assert "--kernels" in text and "--gguf-weights" in text and "the file's own blocks" in text


def test_engine_seed_and_sampling_seed_are_separate_flags() -> None:
    from conveyor.cli import build_parser, engine_config_from, sampling_params_from

    args = build_parser().parse_args(["generate", "x", "--seed", "5"])
    assert engine_config_from(args).seed == 0 and sampling_params_from(args).seed == 5
    args = build_parser().parse_args(["generate", "x", "--engine-seed", "3"])
    assert engine_config_from(args).seed == 3 and sampling_params_from(args).seed is None


def test_generate_with_n_stop_and_verbose_after_the_command(cli_runs: dict[str, dict[str, Any]]) -> None:
    done = cli_runs["generate-n-stop-verbose"]
    assert done["rc"] == 0, done["stderr"]
    assert "[sample 1]" in done["stdout"] and "[sample 2]" in done["stdout"] and "five" not in done["stdout"]
    assert "engine ready" in done["stderr"]  # -v after the command turns on the engine's log


def test_fit_history_drops_whole_exchanges_and_keeps_history_when_a_message_cannot_fit(default_llm: Any) -> None:
    from conveyor.cli import _fit_history

    context = default_llm.engine.max_model_len  # 1024 for the shared test LLM
    long = "word " * 300  # about 300 tokens
    history = [{"role": "system", "content": "Be brief."}]
    for i in range(3):
        history += [{"role": "user", "content": f"{i} {long}"}, {"role": "assistant", "content": f"reply {i}"}]
    history.append({"role": "user", "content": "last question"})
    before = list(history)
    prompt = _fit_history(default_llm, history, max_tokens=64)
    assert prompt is not None and len(default_llm.engine.tokenize(prompt)) + 64 <= context
    assert history[0] == before[0] and history[-1] == before[-1]
    assert history[1]["role"] == "user" and history[1:] == before[-len(history) + 1 :]  # whole exchanges left
    assert len(history) < len(before)
    kept = list(history)
    history.append({"role": "user", "content": "word " * 2000})
    assert _fit_history(default_llm, history, max_tokens=64) is None
    assert history[:-1] == kept  # nothing was dropped for a message that cannot fit
