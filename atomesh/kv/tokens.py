"""The engine's token ids for a request, computed in the gateway: the one tokenizer stack of placement.

kv_aware keys the prompt's KV blocks by them and prefix_hash hashes the first `--prefix-token-count` of
them. The ids must be exactly the engine's, or block keys stop matching at the first differing token:
the same tokenizer, the same chat template rendered the same way (Jinja sandbox, `trim_blocks`,
`lstrip_blocks`, `add_generation_prompt`, the engine's BOS / EOS strings), the same special-token
handling (the engine encodes the rendered text without adding specials). Two sources:

- `--tokenizer-path` (else `--model-path`): a `tokenizer.json` file, or a folder with `tokenizer.json`
  (and `tokenizer_config.json` for the chat template and BOS / EOS, as Hugging Face lays them out);
  `--chat-template` overrides the template found there. Loaded once at start-up
  (`load_prompt_tokenizer`); a path that does not hold a usable tokenizer stops start-up with one line
  saying why. Nothing is downloaded: a Hugging Face model id that is not a local path is refused.
- a worker's `GET /tokenizer_info` (the atomesh engine serves its tokenizer and template there;
  kv_aware asks for it when no path is given).

Rendered text is cut before every special token and each piece is encoded on its own, through a
bounded LRU cache: special tokens split the text inside the tokenizer anyway, so the ids are
identical, and a conversation's earlier messages (or a shared system prompt) are encoded once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from atomesh.kv.index import Tokens
from atomesh.request import RequestView, Route
from atomesh.transport import Upstream
from atomesh.workers.registry import WorkerRegistry
from atomesh.workers.worker import Worker, WorkerRole, WorkerState

log = structlog.get_logger("atomesh.policies")

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
MAX_PREFIX_CHARS = 64 * 1024  # characters of a prompt tokenized to find its first tokens (`first`)

_CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MAX_PIECE_CACHE = 4096
MIN_CACHED_PIECE = 64  # characters; shorter pieces are cheaper to encode than to look up and keep


class TokenizerError(ValueError):
    """The gateway cannot tokenize like the engine: the message names the flag (or the source) and why."""


class PromptTokenizer:
    """Request -> the engine's prompt token ids (a uint64 array), or None when it cannot say."""

    def __init__(
        self,
        encode: Callable[[list[str]], list[list[int]]],
        specials: list[str],
        template: str,
        bos_token: str = "",
        eos_token: str = "",
        vocab_size: int | None = None,
    ) -> None:
        import jinja2
        import jinja2.sandbox

        self._encode = encode
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        try:
            self._template = env.from_string(template)
        except jinja2.TemplateError as e:
            raise ValueError(str(e)) from None
        self._bos, self._eos = bos_token, eos_token
        self._split = (re.compile("(?=" + "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True))
                                  + ")") if specials else None)  # fmt: skip
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self.vocab_size = vocab_size
        self.template_found = True  # False: none configured or found, ChatML stands in
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
                    rest = p[len(head) :] if head else p
                    out.append(([ids[head]] if head else []) + list(rest.encode()))
                return out

            return cls(encode, specials, template, bos, eos, 256 + len(specials))
        raise TokenizerError(f"unknown tokenizer kind {kind!r} in /tokenizer_info")

    @classmethod
    def from_files(
        cls, model_path: str | None, tokenizer_path: str | None, chat_template: Path | None = None
    ) -> PromptTokenizer:
        """From `--tokenizer-path` (else `--model-path`) and `--chat-template`; TokenizerError names the flag."""
        file = tokenizer_file(model_path, tokenizer_path)
        config: dict[str, Any] = {}
        config_file = file.parent / TOKENIZER_CONFIG
        if config_file.is_file():
            try:
                loaded = json.loads(config_file.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                loaded = None
            config = loaded if isinstance(loaded, dict) else {}
        if chat_template is not None:
            try:
                template = chat_template.expanduser().read_text(encoding="utf-8")
            except OSError as e:
                raise TokenizerError(f"--chat-template {str(chat_template)!r}: cannot read it: {e.strerror}") from None
        else:  # a list of named templates (some Hugging Face configs) is not one the engine renders
            found = config.get("chat_template")
            template = found if isinstance(found, str) else _CHATML

        def text(v: Any) -> str:
            return str(v.get("content", "")) if isinstance(v, dict) else str(v or "")

        try:
            source = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"{file}: cannot read it: {e}") from None
        core = _core_from_str(source, str(file))
        try:
            tokens = cls._from_core(core, template, text(config.get("bos_token")), text(config.get("eos_token")))
        except ValueError as e:  # the template does not compile
            where = f"--chat-template {str(chat_template)!r}" if chat_template is not None else str(config_file)
            raise TokenizerError(f"{where}: not a valid Jinja template: {e}") from None
        tokens.template_found = template is not _CHATML
        return tokens

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
            return str(
                self._template.render(
                    messages=messages, add_generation_prompt=True, bos_token=self._bos, eos_token=self._eos
                )
            )
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

    def first(self, view: RequestView, n: int) -> list[int]:
        """The first `n` prompt tokens (prefix_hash's key): given ids as they are, else the head of the
        rendered prompt (at most MAX_PREFIX_CHARS of it is encoded)."""
        body = view.body
        given = body.get("input_ids") if view.route is Route.GENERATE else body.get("prompt")
        if isinstance(given, list) and given and isinstance(given[0], int):
            return [int(t) for t in given[:n]]
        text = view.locality_text
        messages = body.get("messages")
        if view.route is Route.CHAT and isinstance(messages, list) and all(isinstance(m, dict) for m in messages):
            try:
                text = self.render([{"role": m.get("role"), "content": _content(m.get("content"))} for m in messages])
            except ValueError:  # a template that fails on this conversation: the engine will say so
                pass
        return self.encode(text[: max(MAX_PREFIX_CHARS, n * 8)])[:n]


class TokenizerFetch:
    """Asks the first ready worker of `roles` for its `/tokenizer_info` (when no tokenizer was
    configured) and hands the result to `loaded`; one request at a time, the next ready worker after a
    failure. Owns that one task."""

    def __init__(
        self,
        upstream: Upstream,
        registry: WorkerRegistry,
        roles: tuple[WorkerRole, ...],
        loaded: Callable[[PromptTokenizer], None],
        wanted: Callable[[], bool],
    ) -> None:
        self.upstream = upstream
        self.registry = registry
        self.roles = roles
        self._loaded = loaded
        self._wanted = wanted  # False once a tokenizer is there (configured, fetched, or set by a test)
        self._task: asyncio.Task[None] | None = None
        registry.subscribe(self._on_state)

    def start(self) -> None:
        """Ask one of the workers that are ready already (those that turn ready later are asked then)."""
        for w in self.registry:
            if w.state is WorkerState.READY:
                self._on_state(w, None, WorkerState.READY)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _on_state(self, worker: Worker, old: WorkerState | None, new: WorkerState) -> None:
        if (
            new is WorkerState.READY
            and worker.role in self.roles
            and self._wanted()
            and (self._task is None or self._task.done())
        ):
            with contextlib.suppress(RuntimeError):  # no running loop: start() asks later
                self._task = asyncio.get_running_loop().create_task(self._fetch(worker), name="tokenizer-fetch")

    async def _fetch(self, worker: Worker) -> None:
        try:
            info = await self.upstream.get_json(
                worker.url + "/tokenizer_info", 10.0, self.upstream.worker_headers(worker)
            )
            if isinstance(info, dict) and self._wanted():
                tokenizer = await asyncio.to_thread(PromptTokenizer.from_info, info)
                if self._wanted():
                    self._loaded(tokenizer)
                    log.info("kv_aware_tokenizer_loaded", worker=worker.url, kind=info.get("kind"))
        except Exception as e:  # the worker does not serve /tokenizer_info, or not one we read: ask another later
            log.warning("kv_aware_tokenizer_unavailable", worker=worker.url, error=str(e))


def tokenizer_file(model_path: str | None, tokenizer_path: str | None) -> Path:
    """The tokenizer.json that `--tokenizer-path` (else `--model-path`) names: the file, or one in the folder."""
    flag, given = ("--tokenizer-path", tokenizer_path) if tokenizer_path else ("--model-path", model_path)
    if not given:
        raise TokenizerError("--model-path or --tokenizer-path is needed to load a tokenizer")
    path = Path(given).expanduser()
    if not path.exists():
        raise TokenizerError(
            f"{flag} {given!r}: no such file or folder (a Hugging Face model id is not fetched: "
            f"download the model and give its folder)"
        )
    if path.is_dir():
        path = path / TOKENIZER_FILE
        if not path.is_file():
            raise TokenizerError(f"{flag} {given!r}: the folder holds no {TOKENIZER_FILE}")
    return path


def _content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def _core_from_str(text: str, where: str = "/tokenizer_info") -> Any:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise TokenizerError(
            "tokenizing in the gateway needs the `tokenizers` package (pip install tokenizers, or atomesh[engine])"
        ) from None
    try:
        return Tokenizer.from_str(text)
    except Exception as e:  # the library raises plain Exceptions for unreadable files
        raise TokenizerError(f"{where} is not a tokenizer.json the `tokenizers` library can load: {e}") from None


def _raise(message: str) -> None:
    import jinja2

    raise jinja2.TemplateError(message)
