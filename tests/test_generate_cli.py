"""`kvpager generate` reads the prompt from an argument, a file or stdin and streams the greedy text."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvpager.api.llm import LLM
from kvpager.cli.generate import main as generate_main
from kvpager.core.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # CLI subprocesses


PROMPT = "The quick brown"
FLAGS = ["--max-tokens", "6", "--ignore-eos", "--kv-cache-memory", "4MiB"]


@pytest.fixture(scope="module")
def expected(llama_checkpoint: Path) -> str:
    llm = LLM(model=str(llama_checkpoint), kv_cache_memory=4 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    return llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text


def test_prompt_argument_streams_the_greedy_text(
    llama_checkpoint: Path, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert generate_main([PROMPT, "--model", str(llama_checkpoint), *FLAGS]) == 0
    assert capsys.readouterr().out == expected + "\n"


def test_prompt_file_gives_the_same_text(
    llama_checkpoint: Path, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(PROMPT, encoding="utf-8")
    assert generate_main(["--prompt-file", str(prompt_file), "--model", str(llama_checkpoint), *FLAGS]) == 0
    assert capsys.readouterr().out == expected + "\n"


def test_stdin_prompt_through_the_kvpager_command(llama_checkpoint: Path, expected: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvpager", "generate", "--model", str(llama_checkpoint), *FLAGS],
        input=PROMPT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected + "\n"


def test_missing_model_directory_is_a_clear_error_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert generate_main([PROMPT, "--model", str(tmp_path / "nope"), *FLAGS]) == 2
    err = capsys.readouterr().err
    assert "nope" in err and "Traceback" not in err
