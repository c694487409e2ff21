"""Tokenizer: HF `tokenizers` + tokenizer_config.json, chat templates, and a digest for the fingerprint.

Torch-free. The incremental detokenizer and stop-string checker live in `kvpager/text/detokenizer.py`
and are re-exported here.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from kvpager.text.detokenizer import IncrementalDetokenizer, StopChecker

__all__ = ["Tokenizer", "IncrementalDetokenizer", "StopChecker", "render_chat_template"]

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


@dataclass(frozen=True)
class _Specials:
    """Special-token strings named in tokenizer_config.json (None when absent)."""

    bos_token: str | None
    eos_token: str | None
    unk_token: str | None
    pad_token: str | None


class Tokenizer:
    """A HF fast tokenizer (tokenizer.json) with the settings of tokenizer_config.json applied."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        config: dict[str, Any],
        *,
        chat_template: str | None = None,
        generation_eos_ids: list[int] | None = None,
        digest: str = "",
    ) -> None:
        self._tok = tokenizer
        self._tok.no_padding()
        self._tok.no_truncation()
        self._config = config
        self._digest = digest
        self.chat_template = chat_template
        self.specials = _Specials(**{key: _token_content(config.get(key)) for key in SPECIAL_TOKEN_KEYS})
        self.bos_token_id = self._token_id(self.specials.bos_token)
        self.eos_token_id = self._token_id(self.specials.eos_token)
        self.pad_token_id = self._token_id(self.specials.pad_token)
        eos_ids = [self.eos_token_id] if self.eos_token_id is not None else []
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_ids + list(generation_eos_ids or [])))
        self.all_special_ids: frozenset[int] = frozenset(
            token_id for token_id, token in tokenizer.get_added_tokens_decoder().items() if token.special
        )
        self._prepend_bos = bool(config.get("add_bos_token")) and self.bos_token_id is not None and not self._adds_bos()

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json, chat_template.jinja and generation_config.json."""
        root = Path(path)
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(
                f"no tokenizer.json in {root}; kvpager needs a HF fast tokenizer (save it with tokenizer.save_pretrained)"
            )
        data = tokenizer_file.read_bytes()
        try:
            tokenizer = HFTokenizer.from_str(data.decode("utf-8"))
        except Exception as exc:  # tokenizers raises plain Exception subclasses for bad JSON
            raise ValueError(f"{tokenizer_file} is not a valid tokenizers file: {exc}; re-save the tokenizer") from exc
        config = _read_json(root / "tokenizer_config.json")
        generation = _read_json(root / "generation_config.json")
        return cls(
            tokenizer,
            config,
            chat_template=_find_chat_template(root, config),
            generation_eos_ids=_as_id_list(generation.get("eos_token_id")),
            digest=hashlib.sha256(data).hexdigest(),
        )

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def tokenizer_digest(self) -> str:
        """sha256 hex digest of the tokenizer.json bytes (part of the model fingerprint)."""
        return self._digest

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; adds BOS when tokenizer_config says add_bos_token and tokenizer.json does not."""
        ids = list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)
        if add_special_tokens and self._prepend_bos and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids` (special tokens dropped unless skip_special_tokens is False)."""
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def backend_json(self) -> str:
        """The tokenizer.json text of the backend tokenizer (what grammar engines load)."""
        return str(self._tok.to_str())

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary entry, or None."""
        token_id = self._tok.token_to_id(token)
        return None if token_id is None else int(token_id)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render `messages` with the model's chat template (or `chat_template`: a template or a file path).

        The output already holds any BOS the template writes: encode it with add_special_tokens=False.
        """
        template = _load_template_arg(chat_template) if chat_template is not None else self.chat_template
        if template is None:
            raise ValueError("this tokenizer has no chat template; pass --chat-template (a Jinja2 file or string)")
        return render_chat_template(
            template, messages, add_generation_prompt=add_generation_prompt, specials=self.specials, **kwargs
        )

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self.token_to_id(token)

    def _adds_bos(self) -> bool:
        probe = self._tok.encode("a", add_special_tokens=True).ids
        return bool(probe) and probe[0] == self.bos_token_id


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    specials: _Specials | None = None,
    **kwargs: Any,
) -> str:
    """Render a HF-style chat template in a sandboxed Jinja2 environment (HF's globals and filters)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    variables = {key: getattr(specials, key) or "" for key in SPECIAL_TOKEN_KEYS} if specials else {}
    try:
        compiled = env.from_string(template)
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables, **kwargs)
    except jinja2.TemplateError as exc:
        raise ValueError(f"chat template failed: {exc}") from exc


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _token_content(value: Any) -> str | None:
    """tokenizer_config stores special tokens as a string or an AddedToken dict with "content"."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); fix or remove it") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _find_chat_template(root: Path, config: dict[str, Any]) -> str | None:
    """chat_template.jinja (transformers 5) wins over tokenizer_config's "chat_template"."""
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _load_template_arg(chat_template: str) -> str:
    """A --chat-template value is a template string or the path of a file holding one."""
    if "{" in chat_template:
        return chat_template
    if not Path(chat_template).is_file():
        raise ValueError(
            f"chat template {chat_template!r} is neither a file nor a Jinja2 template; pass a path or the template text"
        )
    return Path(chat_template).read_text(encoding="utf-8")
