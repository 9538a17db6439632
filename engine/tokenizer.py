"""Tokenizers (from GGUF metadata, tokenizer.json, or raw bytes), chat templates and streaming detokenization."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizerCore

# GGUF token types (llama.cpp's LLAMA_TOKEN_TYPE_*).
_GGUF_CONTROL = 3
_GGUF_USER_DEFINED = 4

# The pre-tokenizer split of GPT-2 style BPE vocabularies.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

_CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class Tokenizer(Protocol):
    """What the engine needs from a tokenizer."""

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str: ...

    def token_text(self, token_id: int) -> str: ...

    def grammar_vocab(self, vocab_size: int) -> tuple[list[str] | list[bytes], bool]: ...

    @property
    def template_uses_tools(self) -> bool: ...

    def describe(self) -> dict[str, Any]: ...


class ChatTemplate:
    """A Jinja chat template rendered in a sandbox, the way Hugging Face renders them."""

    def __init__(self, source: str, bos_token: str, eos_token: str) -> None:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        self._template = env.from_string(source)
        self.source = source
        self._bos = bos_token
        self._eos = eos_token
        self.uses_tools = "tools" in source

    def describe(self) -> dict[str, Any]:
        """How this template renders, for a router that must produce the same prompt text."""
        return {"chat_template": self.source, "bos_token": self._bos, "eos_token": self._eos,
                "add_generation_prompt": True, "trim_blocks": True, "lstrip_blocks": True}  # fmt: skip

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               continue_final_message: bool = False, **kwargs: Any) -> str:  # fmt: skip
        """The prompt text for ``messages``: ending with the assistant's turn opener, or, with
        ``continue_final_message``, with the last message left open so the model continues it.
        ``kwargs`` reach the template too (``tools``, a request's ``chat_template_kwargs``)."""
        if add_generation_prompt and continue_final_message:
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        context = {**kwargs, "messages": messages, "add_generation_prompt": add_generation_prompt,
                   "bos_token": self._bos, "eos_token": self._eos}  # fmt: skip
        try:
            text = str(self._template.render(**context))
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template failed: {exc}") from exc
        return _open_final_message(text, messages) if continue_final_message else text


def _open_final_message(rendered: str, messages: list[dict[str, Any]]) -> str:
    """Cut the rendered chat right after the last message's text (its end-of-turn markers dropped),
    the way Hugging Face's ``continue_final_message`` does."""
    final = messages[-1].get("content") if messages else None
    if not isinstance(final, str) or not final.strip():
        raise ValueError("continue_final_message needs a final message with text to continue")
    at = rendered.rfind(final.strip())
    if at < 0:
        raise ValueError("continue_final_message: the chat template does not show the final message as given")
    kept = final.lstrip()
    if rendered[at : at + len(kept)] == kept:
        return rendered[: at + len(kept)]  # the template kept the message's trailing spaces
    return rendered[: at + len(final.strip())]


def _raise_template_error(message: str) -> None:
    raise jinja2.TemplateError(message)


class _Templated:
    """The chat rendering every tokenizer here shares: its ChatTemplate."""

    _chat: ChatTemplate

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        return self._chat.render(messages, add_generation_prompt, continue_final_message, **kwargs)


class HFTokenizer(_Templated):
    """A Hugging Face ``tokenizers`` BPE tokenizer plus its chat template."""

    def __init__(
        self,
        core: HFTokenizerCore,
        eos_token_ids: frozenset[int],
        bos_token_id: int | None,
        chat_template: ChatTemplate,
    ) -> None:
        self._core = core
        self._eos = eos_token_ids
        self.bos_token_id = bos_token_id
        self._chat = chat_template

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    @property
    def vocab_size(self) -> int:
        return int(self._core.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return list(self._core.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._core.decode(list(ids), skip_special_tokens=True))

    @property
    def template_uses_tools(self) -> bool:
        return self._chat.uses_tools

    def token_text(self, token_id: int) -> str:
        """One token's own text (special tokens too), for logprobs."""
        return str(self._core.decode([token_id], skip_special_tokens=False))

    def grammar_vocab(self, vocab_size: int) -> tuple[list[str], bool]:
        """Every token id's byte-level string, special tokens as "" (how xgrammar recognises them)."""
        added = {t.content for t in self._core.get_added_tokens_decoder().values()}
        encoded = [""] * vocab_size
        for token, i in self._core.get_vocab(with_added_tokens=True).items():
            if i < vocab_size:
                encoded[i] = "" if token in added else token
        return encoded, True

    def describe(self) -> dict[str, Any]:
        """GET /tokenizer_info: the whole tokenizer (tokenizer.json) and its chat template."""
        return {"kind": "tokenizers", "tokenizer_json": self._core.to_str(), "add_special_tokens": False,
                **self._chat.describe()}  # fmt: skip


def tokenizer_from_gguf_fields(fields: dict[str, Any]) -> HFTokenizer:
    """Build the tokenizer a GGUF file describes (``tokenizer.ggml.*``, ``tokenizer.chat_template``).

    Only GPT-2 style byte-level BPE (``tokenizer.ggml.model == "gpt2"``) is supported: that is
    what SmolLM2, Llama 3, Qwen and most recent Llama-family GGUFs use.
    """
    kind = fields.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only 'gpt2' byte-level BPE)")
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    merges_raw: list[str] = fields["tokenizer.ggml.merges"]
    token_types: list[int] = fields.get("tokenizer.ggml.token_type", [1] * len(tokens))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges: list[tuple[str, str]] = []
    for m in merges_raw:
        left, _, right = m.partition(" ")
        merges.append((left, right))
    core = HFTokenizerCore(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    split = pre_tokenizers.Split(Regex(_GPT2_SPLIT), behavior="isolated")
    parts: list[Any] = []
    if fields.get("tokenizer.ggml.pre") in ("smollm", "llama-bpe", "llama3", "qwen2", "starcoder"):
        # These vocabularies split numbers into single digits before byte-level BPE.
        parts.append(pre_tokenizers.Digits(individual_digits=True))
    parts += [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    core.pre_tokenizer = pre_tokenizers.Sequence(parts)
    core.decoder = decoders.ByteLevel()
    specials = [
        AddedToken(tok, special=True, normalized=False)
        for tok, kind_ in zip(tokens, token_types, strict=True)
        if kind_ in (_GGUF_CONTROL, _GGUF_USER_DEFINED)
    ]
    core.add_special_tokens(specials)
    eos_id = fields.get("tokenizer.ggml.eos_token_id")
    bos_id = fields.get("tokenizer.ggml.bos_token_id")
    eos: set[int] = set()
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        value = fields.get(key)
        if value is not None:
            eos.add(int(value))
    template = fields.get("tokenizer.chat_template") or _CHATML_TEMPLATE
    chat = ChatTemplate(
        template,
        bos_token=tokens[bos_id] if bos_id is not None else "",
        eos_token=tokens[eos_id] if eos_id is not None else "",
    )
    return HFTokenizer(core, frozenset(eos), bos_id, chat)


def tokenizer_from_folder(folder: Path, eos_from_config: list[int]) -> HFTokenizer:
    """Load ``tokenizer.json`` (+ ``tokenizer_config.json`` for the chat template) from a model folder."""
    tok_file = folder / "tokenizer.json"
    if not tok_file.is_file():
        raise ValueError(f"{folder} has no tokenizer.json")
    core = HFTokenizerCore.from_file(str(tok_file))
    cfg: dict[str, Any] = {}
    if (folder / "tokenizer_config.json").is_file():
        cfg = json.loads((folder / "tokenizer_config.json").read_text())

    def token_text(value: Any) -> str:
        if isinstance(value, dict):
            return str(value.get("content", ""))
        return str(value or "")

    bos, eos = token_text(cfg.get("bos_token")), token_text(cfg.get("eos_token"))
    eos_ids = set(eos_from_config)
    eos_id = core.token_to_id(eos) if eos else None
    if eos_id is not None:
        eos_ids.add(int(eos_id))
    template = cfg.get("chat_template") or _CHATML_TEMPLATE
    bos_id = core.token_to_id(bos) if bos else None
    return HFTokenizer(core, frozenset(eos_ids), bos_id, ChatTemplate(str(template), bos, eos))


class ByteTokenizer(_Templated):
    """One token per UTF-8 byte plus ChatML specials: the tokenizer of the tiny random test model."""

    SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

    def __init__(self) -> None:
        self._special_ids = {s: 256 + i for i, s in enumerate(self.SPECIALS)}
        self._chat = ChatTemplate(_CHATML_TEMPLATE, bos_token="", eos_token="<|im_end|>")

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset({self._special_ids["<|endoftext|>"], self._special_ids["<|im_end|>"]})

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.SPECIALS)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        rest = text
        while rest:
            # Specials are matched atomically so a chat template's markers become single tokens.
            hits = [(rest.find(s), s) for s in self.SPECIALS if s in rest]
            if not hits:
                ids += rest.encode("utf-8")
                break
            pos, special = min(hits)
            ids += rest[:pos].encode("utf-8")
            ids.append(self._special_ids[special])
            rest = rest[pos + len(special) :]
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    @property
    def template_uses_tools(self) -> bool:
        return False

    def token_text(self, token_id: int) -> str:
        if token_id >= 256:
            return self.SPECIALS[token_id - 256] if token_id - 256 < len(self.SPECIALS) else ""
        return bytes([token_id]).decode("utf-8", errors="replace")

    def grammar_vocab(self, vocab_size: int) -> tuple[list[bytes], bool]:
        """Raw bytes per token; the specials as empty (xgrammar's mark of a special token)."""
        return [bytes([i]) if i < 256 else b"" for i in range(vocab_size)], False

    def describe(self) -> dict[str, Any]:
        """GET /tokenizer_info: one id per UTF-8 byte, these specials after 255, and the template."""
        return {"kind": "bytes", "special_tokens": list(self.SPECIALS), **self._chat.describe()}


@dataclass(slots=True)
class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, never splitting a UTF-8 character.

    Decodes a short window (``prefix_offset:``) each time instead of the whole sequence, so the cost
    per token stays constant; a delta is released only once it no longer ends in U+FFFD (an
    incomplete byte sequence).
    """

    tokenizer: Tokenizer
    prefix_offset: int = 0
    read_offset: int = 0

    def step(self, ids: Sequence[int]) -> str:
        """The text that the ids appended since the last call complete."""
        prefix = self.tokenizer.decode(ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(ids)
            return full[len(prefix) :]
        return ""

    def flush(self, ids: Sequence[int]) -> str:
        """Whatever text is still held back (an incomplete character becomes U+FFFD)."""
        prefix = self.tokenizer.decode(ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""
