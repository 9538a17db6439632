"""The tokenizer and chat template the gateway loads for `--model-path` / `--tokenizer-path` /
`--chat-template` (ATOMesh and SMG spellings).

Loaded once at start-up; a path that does not hold a usable tokenizer stops start-up with one line
saying why. Nothing is downloaded: a Hugging Face model id that is not a local path is refused.
Policies that hash token prefixes use `PromptTokens` (prefix_hash: the first `--prefix-token-count`
tokens as the engine sees them, instead of four characters a token).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from atomesh.request import RequestView, Route

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
MAX_PREFIX_CHARS = 64 * 1024  # characters of a prompt tokenized to find its first tokens


class TokenizerError(ValueError):
    """The tokenizer or chat template cannot be loaded; the message names the flag and the reason."""


def tokenizer_file(model_path: str | None, tokenizer_path: str | None) -> Path:
    """The tokenizer.json that `--tokenizer-path` (else `--model-path`) names: the file, or one in the folder."""
    flag, given = ("--tokenizer-path", tokenizer_path) if tokenizer_path else ("--model-path", model_path)
    if not given:
        raise TokenizerError("--model-path or --tokenizer-path is needed to load a tokenizer")
    path = Path(given).expanduser()
    if not path.exists():
        raise TokenizerError(f"{flag} {given!r}: no such file or folder (a Hugging Face model id is not fetched: "
                             f"download the model and give its folder)")
    if path.is_dir():
        path = path / TOKENIZER_FILE
        if not path.is_file():
            raise TokenizerError(f"{flag} {given!r}: the folder holds no {TOKENIZER_FILE}")
    return path


def load_tokenizer(model_path: str | None, tokenizer_path: str | None) -> Any:
    """A `tokenizers.Tokenizer` from `--tokenizer-path` (else `--model-path`), or TokenizerError."""
    path = tokenizer_file(model_path, tokenizer_path)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise TokenizerError("--model-path/--tokenizer-path need the `tokenizers` package "
                             "(pip install tokenizers, or atomesh[engine])") from None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the library raises plain Exceptions for unreadable files
        raise TokenizerError(f"{path} is not a tokenizer.json the `tokenizers` library can load: {e}") from None


def load_chat_template(template_path: Path | None, model_path: str | None, tokenizer_path: str | None) -> Any:
    """The chat template (a compiled Jinja template) of `--chat-template`, else the one in the tokenizer
    folder's tokenizer_config.json; None when there is neither."""
    source: str | None = None
    where = ""
    if template_path is not None:
        where = f"--chat-template {str(template_path)!r}"
        try:
            source = template_path.expanduser().read_text(encoding="utf-8")
        except OSError as e:
            raise TokenizerError(f"{where}: cannot read it: {e.strerror}") from None
    else:
        folder = tokenizer_file(model_path, tokenizer_path).parent
        config = folder / TOKENIZER_CONFIG
        if config.is_file():
            try:
                loaded = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
            except (OSError, ValueError, AttributeError):
                loaded = None
            if isinstance(loaded, str):
                source, where = loaded, str(config)
    if source is None:
        return None
    try:
        import jinja2.sandbox
    except ImportError:
        raise TokenizerError("a chat template needs the `jinja2` package (pip install jinja2)") from None
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise TokenizerError(f"{where}: not a valid Jinja template: {e}") from None


class PromptTokens:
    """The token ids a request's prompt starts with, as the engine will see them."""

    def __init__(self, tokenizer: Any, chat_template: Any = None) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template

    def first(self, view: RequestView, n: int) -> list[int]:
        """The first `n` prompt tokens (given ids are taken as they are)."""
        body = view.body
        ids = body.get("input_ids") if view.route is Route.GENERATE else body.get("prompt")
        if isinstance(ids, list) and ids and isinstance(ids[0], int):
            return [int(t) for t in ids[:n]]
        text = self._text(view)
        encoded: Sequence[int] = self.tokenizer.encode(text[: max(MAX_PREFIX_CHARS, n * 8)],
                                                       add_special_tokens=False).ids
        return list(encoded[:n])

    def _text(self, view: RequestView) -> str:
        messages = view.body.get("messages")
        if view.route is Route.CHAT and self.chat_template is not None and isinstance(messages, list):
            try:
                return str(self.chat_template.render(messages=messages, add_generation_prompt=True))
            except Exception:  # a template that fails on this conversation: the engine will say so
                return view.locality_text
        return view.locality_text
