"""Tokenizer: loading, special tokens, BOS handling, chat templates (checked against transformers), digest."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from kvpager.text.tokenizer import Tokenizer

TEMPLATE = """{%- set ns = namespace(system='') -%}
{{ bos_token }}
{%- for message in messages -%}
  {%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}
    {{ raise_exception('unknown role ' + message['role']) }}
  {%- endif -%}
  {%- if message['role'] == 'system' %}{% set ns.system = message['content'] %}{% continue %}{% endif -%}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}{% if loop.last and not add_generation_prompt %}{{ eos_token }}{% endif %}<|im_end|>
{% endfor -%}
{%- if tools %}<tools>{% for tool in tools %}{{ tool | tojson(indent=2) }}{% endfor %}</tools>
{% endif -%}
{%- if ns.system %}[system: {{ ns.system }}]{% endif -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}
"""

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": 'What is "KV"? 你好'},
    {"role": "assistant", "content": "A cache."},
    {"role": "user", "content": "More?"},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"city": "string"}}}]


def _train(bos_post_processor: bool) -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=280,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 3, trainer)
    tok.add_tokens(["<|im_start|>"])  # an added token that is not special
    if bos_post_processor:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
    return tok


def _write(tmp_path: Path, config: dict, *, bos_post_processor: bool = False, generation: dict | None = None) -> Path:
    _train(bos_post_processor).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return tmp_path


LLAMA_CONFIG = {
    "bos_token": "<s>",
    "eos_token": {"__type": "AddedToken", "content": "</s>"},
    "pad_token": "<pad>",
    "add_bos_token": True,
}


def test_special_tokens_resolve_from_strings_and_added_token_dicts(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(_write(tmp_path, LLAMA_CONFIG, generation={"eos_token_id": [1, 3]}))
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert tok.eos_token_ids == (1, 3)
    assert tok.all_special_ids == frozenset({0, 1, 2})  # <|im_start|> is added but not special
    assert tok.vocab_size == 281


@pytest.mark.parametrize("post_processor_adds_bos", [False, True])
def test_bos_is_added_exactly_once_when_asked(tmp_path: Path, post_processor_adds_bos: bool) -> None:
    tok = Tokenizer.from_dir(_write(tmp_path, LLAMA_CONFIG, bos_post_processor=post_processor_adds_bos))
    plain = tok.encode("the fox", add_special_tokens=False)
    assert tok.encode("the fox") == [0, *plain]
    assert tok.decode(tok.encode("the fox")) == "the fox"
    assert tok.decode(tok.encode("the fox"), skip_special_tokens=False) == "<s>the fox"


def test_no_bos_without_add_bos_token(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(_write(tmp_path, {"bos_token": "<s>", "eos_token": "</s>"}))
    assert tok.encode("the fox") == tok.encode("the fox", add_special_tokens=False)
    assert tok.encode("the fox")[0] != 0


def test_chat_template_matches_transformers(tmp_path: Path) -> None:
    import transformers  # a test extra (the reference implementation); imported here as it is slow to load

    config = {**LLAMA_CONFIG, "chat_template": TEMPLATE}
    tok = Tokenizer.from_dir(_write(tmp_path, config))
    reference = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tmp_path / "tokenizer.json"), bos_token="<s>", eos_token="</s>"
    )
    for add_generation_prompt in (True, False):
        expected = reference.apply_chat_template(
            MESSAGES, tools=TOOLS, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert tok.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, tools=TOOLS) == expected
    assert '"city": "string"' in expected and "你好" in expected and expected.startswith("<s>")


def test_chat_template_jinja_file_is_used_and_explicit_template_wins(tmp_path: Path) -> None:
    _write(tmp_path, {**LLAMA_CONFIG, "chat_template": "config {{ messages[0]['content'] }}"})
    (tmp_path / "chat_template.jinja").write_text("file {{ messages[0]['content'] }}")
    tok = Tokenizer.from_dir(tmp_path)
    messages = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(messages) == "file x"
    assert tok.apply_chat_template(messages, chat_template="arg {{ messages | length }}") == "arg 1"
    template_file = tmp_path / "my.jinja"
    template_file.write_text("path {{ eos_token }}")
    assert tok.apply_chat_template(messages, chat_template=str(template_file)) == "path </s>"
    with pytest.raises(ValueError, match="neither a file"):
        tok.apply_chat_template(messages, chat_template=str(tmp_path / "missing.jinja"))


def test_missing_template_names_the_flag(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(_write(tmp_path, LLAMA_CONFIG))
    with pytest.raises(ValueError, match="--chat-template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_errors_and_sandbox_escapes_raise_value_error(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(_write(tmp_path, {**LLAMA_CONFIG, "chat_template": TEMPLATE}))
    with pytest.raises(ValueError, match="unknown role robot"):
        tok.apply_chat_template([{"role": "robot", "content": "beep"}])
    with pytest.raises(ValueError, match="chat template failed"):  # the immutable sandbox forbids mutation
        tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template="{{ messages.append(1) }}")
    with pytest.raises(ValueError, match="chat template failed"):
        tok.apply_chat_template([], chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}")


def test_digest_is_sha256_of_tokenizer_json(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(_write(tmp_path, LLAMA_CONFIG))
    assert tok.tokenizer_digest() == hashlib.sha256((tmp_path / "tokenizer.json").read_bytes()).hexdigest()
    (tmp_path / "tokenizer.json").write_text((tmp_path / "tokenizer.json").read_text() + "\n")
    assert Tokenizer.from_dir(tmp_path).tokenizer_digest() != tok.tokenizer_digest()


def test_missing_or_malformed_files_raise_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": 42')
    with pytest.raises(ValueError, match="not a valid tokenizers file"):
        Tokenizer.from_dir(tmp_path)
    _write(tmp_path, {})
    (tmp_path / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(ValueError, match="tokenizer_config.json is not valid JSON"):
        Tokenizer.from_dir(tmp_path)
