"""Structured output through xgrammar (the grammar engine vLLM and SGLang use).

A request's constraint (JSON schema, any JSON object, regex, choice, EBNF grammar) is compiled once,
off the event loop, through xgrammar's compiler and its bounded cache. Each constrained sequence
holds a matcher; before a step the matchers of the step's constrained rows fill one token bitmask,
the sampler applies it to those rows only (the other rows of the batch are untouched and never
wait), and after the step each matcher accepts its sampled token.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Any

import orjson
import torch

from engine.errors import InvalidRequestError
from engine.protocol import GrammarSpec
from engine.tokenizer import Tokenizer

GRAMMAR_CACHE_BYTES = 64 << 20  # compiled grammars kept for reuse (xgrammar evicts beyond this)


def available() -> bool:
    return importlib.util.find_spec("xgrammar") is not None


class GrammarState:
    """One sequence's place in its grammar."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False when generation must end here (the grammar is complete)."""
        if not self.matcher.accept_token(token):
            return False  # only a bug lets a masked token through: stop rather than emit garbage
        return not self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


class GrammarCompiler:
    """Compiles constraints for one tokenizer; compiled grammars are cached (bounded) by xgrammar."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        if not available():
            raise InvalidRequestError("structured output needs the xgrammar package (pip install xgrammar)")
        import xgrammar as xgr

        encoded, byte_level = tokenizer.grammar_vocab(vocab_size)
        kind = xgr.VocabType.BYTE_LEVEL if byte_level else xgr.VocabType.RAW
        info = xgr.TokenizerInfo(encoded, kind, vocab_size=vocab_size, stop_token_ids=sorted(eos_token_ids))
        self._xgr = xgr
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=GRAMMAR_CACHE_BYTES)
        self.vocab_size = vocab_size

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar of ``spec``; raises InvalidRequestError for one xgrammar refuses."""
        c = self._compiler
        try:
            if spec.kind == "json_schema":
                return c.compile_json_schema(spec.source, any_whitespace=False)
            if spec.kind == "json_object":
                return c.compile_builtin_json_grammar()
            if spec.kind == "regex":
                return c.compile_regex(spec.source)
            if spec.kind == "choice":
                choices = orjson.loads(spec.source)
                return c.compile_grammar("root ::= " + " | ".join(_ebnf_string(s) for s in choices))
            if spec.kind == "grammar":
                return c.compile_grammar(spec.source)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise InvalidRequestError(
                f"the {spec.kind.replace('_', ' ')} constraint cannot be compiled: {str(exc).splitlines()[0][:300]}"
            ) from exc
        raise InvalidRequestError(f"unknown structured-output kind {spec.kind!r}")

    async def state_for(self, spec: GrammarSpec, executor: Executor | None = None) -> GrammarState:
        """A fresh matcher for ``spec`` (compiled in ``executor``, off the event loop)."""
        compiled = await asyncio.get_running_loop().run_in_executor(executor, self.compile, spec)
        return GrammarState(self._xgr.GrammarMatcher(compiled))

    def state_of(self, compiled: Any) -> GrammarState:
        return GrammarState(self._xgr.GrammarMatcher(compiled))


def _ebnf_string(text: str) -> str:
    return orjson.dumps(text).decode()  # a JSON string literal is a valid EBNF string literal


def fill_bitmasks(batch: int, vocab_size: int, states: Sequence[tuple[int, GrammarState]]) -> torch.Tensor:
    """One bitmask for a step's batch: the constrained rows filled by their matchers, the rest all-allowed."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(batch, vocab_size)
    for row, state in states:
        state.fill(bitmask, row)
    return bitmask


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Set the logits of masked-out tokens to -inf in the constrained ``rows``, in place."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=list(rows))
