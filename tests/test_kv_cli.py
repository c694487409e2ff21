"""`kvpager kv save | inspect`: a saved pack (plain text or chat system prompt) makes the first
request with that prefix skip its prefill, with exact tokens; inspect prints the header."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpager.cli.kv import main, prompt_token_ids
from kvpager.core.config import EngineConfig
from kvpager.core.sampling_params import SamplingParams
from kvpager.engine.engine import Engine

pytestmark = pytest.mark.slow  # CLI subprocesses


TEXT = "Prefill writes the state for the prompt; decode appends one position per step. " * 3
ENGINE_FLAGS = ["--block-size", "4", "--kv-cache-memory", "1MiB"]


def first_output(engine: Engine, prompt: list[int]) -> tuple[list[int], int]:
    engine.add_request("q", prompt, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                result = (out.outputs[0].token_ids, out.num_cached_tokens)
    return result


def config(checkpoint: Path, **kv: object) -> EngineConfig:
    return EngineConfig(model=str(checkpoint), block_size=4, kv_cache_memory=1 << 20, **kv)  # type: ignore[arg-type]


@pytest.mark.parametrize("chat", [False, True], ids=["text", "chat-system-prompt"])
def test_saved_pack_skips_the_prefill_of_the_first_request(llama_checkpoint: Path, tmp_path: Path, chat: bool) -> None:
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(TEXT, encoding="utf-8")
    pack = tmp_path / "p.kvpack"
    argv = ["save", "--model", str(llama_checkpoint), "--prompt-file", str(prompt_file), "-o", str(pack)]
    assert main(argv + ENGINE_FLAGS + (["--chat"] if chat else [])) == 0

    cold = Engine(config(llama_checkpoint, enable_prefix_caching=False))
    if chat:
        messages = [{"role": "system", "content": TEXT}, {"role": "user", "content": "Hello, world!"}]
        rendered = cold.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        request = cold.tokenizer.encode(rendered, add_special_tokens=False)
    else:
        request = cold.tokenizer.encode(TEXT + " How much wood?")
    prefix = prompt_token_ids(cold.tokenizer, TEXT, chat)
    assert request[: len(prefix)] == prefix
    warm = Engine(config(llama_checkpoint, kv_packs=(str(pack),)))
    expected_tokens, _ = first_output(cold, request)
    assert first_output(warm, request) == (expected_tokens, len(prefix) // 4 * 4)


def test_inspect_prints_the_header_with_shortened_token_ids(
    llama_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(TEXT, encoding="utf-8")
    pack = tmp_path / "p.kvpack"
    argv = ["save", "--model", str(llama_checkpoint), "--prompt-file", str(prompt_file), "-o", str(pack)]
    assert main(argv + ENGINE_FLAGS + ["--codec", "int8"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(pack)]) == 0
    text = capsys.readouterr().out
    assert f"file size:              {pack.stat().st_size} bytes" in text
    assert "codec:                  int8" in text and "model.architecture:     LlamaForCausalLM" in text
    assert "more]" in text  # token ids shortened
    assert main(["inspect", str(pack), "--json"]) == 0
    header = json.loads(capsys.readouterr().out)
    assert header["codec"] == "int8" and header["num_blocks"] == len(header["token_ids"]) // 4


def test_kv_commands_report_errors_with_exit_code_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    garbage = tmp_path / "x.kvpack"
    garbage.write_bytes(b"not a pack at all, just bytes" * 4)
    assert main(["inspect", str(garbage)]) == 2
    assert "bad magic" in capsys.readouterr().err
    assert main(["save", "--prompt-file", str(tmp_path / "missing.txt"), "-o", str(garbage)]) == 2
    assert "missing.txt" in capsys.readouterr().err
