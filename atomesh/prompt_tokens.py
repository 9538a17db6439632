"""The engine's token ids for a request, computed in the gateway (for KV-aware placement).

The ids must be exactly the engine's, or block keys stop matching at the first differing token:
the same tokenizer, the same chat template rendered the same way (Jinja sandbox, `trim_blocks`,
`lstrip_blocks`, `add_generation_prompt`, the engine's BOS / EOS strings), the same special-token
handling (the engine encodes the rendered text without adding specials). Two sources:

- `--tokenizer-path`: a `tokenizer.json` file, or a folder with `tokenizer.json` (and
  `tokenizer_config.json` for the chat template and BOS / EOS, as Hugging Face lays them out);
- a worker's `GET /tokenizer_info` (the atomesh engine serves its tokenizer and template there).

Rendered text is cut before every special token and each piece is encoded on its own, through a
bounded LRU cache: special tokens split the text inside the tokenizer anyway, so the ids are
identical, and a conversation's earlier messages (or a shared system prompt) are encoded once.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from atomesh.kv_index import Tokens
from atomesh.request import RequestView, Route

_CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MAX_PIECE_CACHE = 4096
MIN_CACHED_PIECE = 64  # characters; shorter pieces are cheaper to encode than to look up and keep


class TokenizerUnavailable(RuntimeError):
    """The gateway cannot tokenize like the engine (no tokenizer configured or served)."""


class PromptTokenizer:
    """Request -> the engine's prompt token ids (a uint64 array), or None when it cannot say."""

    def __init__(self, encode: Callable[[list[str]], list[list[int]]], specials: list[str], template: str,
                 bos_token: str = "", eos_token: str = "", vocab_size: int | None = None) -> None:
        import jinja2
        import jinja2.sandbox

        self._encode = encode
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(template)
        self._bos, self._eos = bos_token, eos_token
        self._split = (re.compile("(?=" + "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True))
                                  + ")") if specials else None)  # fmt: skip
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self.vocab_size = vocab_size
        self.encoded_pieces = 0
        self.cached_pieces = 0

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_info(cls, info: dict[str, Any]) -> PromptTokenizer:
        """From a worker's `/tokenizer_info`."""
        kind = info.get("kind")
        template = str(info.get("chat_template") or _CHATML)
        bos, eos = str(info.get("bos_token") or ""), str(info.get("eos_token") or "")
        if kind == "tokenizers":
            return cls._from_core(_core_from_str(str(info["tokenizer_json"])), template, bos, eos)
        if kind == "bytes":
            specials = [str(s) for s in info.get("special_tokens", [])]
            ids = {s: 256 + i for i, s in enumerate(specials)}

            def encode(pieces: list[str]) -> list[list[int]]:
                out = []
                for p in pieces:
                    head = next((s for s in specials if p.startswith(s)), None)
                    rest = p[len(head):] if head else p
                    out.append(([ids[head]] if head else []) + list(rest.encode()))
                return out

            return cls(encode, specials, template, bos, eos, 256 + len(specials))
        raise TokenizerUnavailable(f"unknown tokenizer kind {kind!r} in /tokenizer_info")

    @classmethod
    def from_path(cls, path: str, template: str | None = None) -> PromptTokenizer:
        """tokenizer.json, or a folder holding it (+ tokenizer_config.json); `template` overrides the chat
        template found there."""
        p = Path(path)
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise TokenizerUnavailable(f"--tokenizer-path {path}: no tokenizer.json there")
        cfg: dict[str, Any] = {}
        cfg_file = file.parent / "tokenizer_config.json"
        if cfg_file.is_file():
            cfg = json.loads(cfg_file.read_text())

        def text(v: Any) -> str:
            return str(v.get("content", "")) if isinstance(v, dict) else str(v or "")

        return cls._from_core(_core_from_str(file.read_text()), template or str(cfg.get("chat_template") or _CHATML),
                              text(cfg.get("bos_token")), text(cfg.get("eos_token")))

    @classmethod
    def _from_core(cls, core: Any, template: str, bos: str, eos: str) -> PromptTokenizer:
        specials = [t.content for t in core.get_added_tokens_decoder().values() if t.special]

        def encode(pieces: list[str]) -> list[list[int]]:
            return [e.ids for e in core.encode_batch(pieces, add_special_tokens=False)]

        return cls(encode, specials, template, bos, eos, int(core.get_vocab_size(with_added_tokens=True)))

    # ------------------------------------------------------------------ use
    def render(self, messages: list[dict[str, Any]]) -> str:
        """The prompt text the engine renders for these chat messages."""
        import jinja2

        try:
            return str(self._template.render(messages=messages, add_generation_prompt=True, bos_token=self._bos,
                                             eos_token=self._eos))
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template failed: {exc}") from exc

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, piece by piece (cut before special tokens), through the piece cache."""
        pieces = [p for p in self._split.split(text) if p] if self._split is not None else [text]
        cache = self._cache
        out: list[int] = []
        todo: list[tuple[int, str]] = []
        parts: list[list[int] | None] = []
        for p in pieces:
            hit = cache.get(p) if len(p) >= MIN_CACHED_PIECE else None
            if hit is not None:
                cache.move_to_end(p)
                self.cached_pieces += 1
            else:
                todo.append((len(parts), p))
            parts.append(hit)
        if todo:
            encoded = self._encode([p for _, p in todo])
            self.encoded_pieces += len(todo)
            for (i, p), ids in zip(todo, encoded, strict=True):
                parts[i] = ids
                if len(p) >= MIN_CACHED_PIECE:
                    cache[p] = ids
            while len(cache) > MAX_PIECE_CACHE:
                cache.popitem(last=False)
        for part in parts:
            assert part is not None
            out += part
        return out

    def ids(self, view: RequestView) -> Tokens | None:
        """The request's prompt token ids as the engine will see them; None when it cannot tell."""
        body = view.body
        if view.route is Route.CHAT:
            messages = body.get("messages")
            if not isinstance(messages, list):
                return None
            norm = []
            for m in messages:
                if not isinstance(m, dict):
                    return None
                norm.append({"role": m.get("role"), "content": _content(m.get("content"))})
            try:
                return np.asarray(self.encode(self.render(norm)), dtype=np.uint64)
            except ValueError:
                return None
        prompt = body.get("prompt", body.get("text"))
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return np.asarray(self.encode(prompt), dtype=np.uint64)
        if prompt is None:
            prompt = body.get("input_ids")
        if isinstance(prompt, list) and all(isinstance(t, int) and t >= 0 for t in prompt):
            return np.asarray(prompt, dtype=np.uint64)
        return None


def _content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def _core_from_str(text: str) -> Any:
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:  # pragma: no cover - a base dependency
        raise TokenizerUnavailable("the 'tokenizers' package is needed for --policy kv_aware") from exc
    return Tokenizer.from_str(text)


def _raise(message: str) -> None:
    import jinja2

    raise jinja2.TemplateError(message)
