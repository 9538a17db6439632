"""Speculative decoding: the ``--speculative-config`` settings, draft proposers and the acceptance of drafts.

A decoding sequence that has drafts computes its last token and its ``k`` drafts in one target step
(a verify row: ``1 + k`` query tokens over its cached context, like a prefill chunk). The target's
logits at those ``1 + k`` places decide how many drafts stand: under greedy sampling a draft stands
while it equals the target's argmax, so the output is the target's own, token for token; under
sampling the rejection sampler (Leviathan et al. 2023, Chen et al. 2023) keeps the target's
distribution. Either way one more token (the correction or the bonus) follows the accepted drafts.
The KV written for rejected drafts is past the sequence's new length: the next step overwrites it,
and blocks held only for it go back to the pool (``BlockManager.trim``).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from engine.flags import json_object_flag
from engine.sequence import Sequence

_CONFIG_KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}
METHODS = ("ngram",)
# Methods known from vLLM / ATOM that are not built here: method -> why.
_REFUSED_METHODS = {
    "eagle3": "EAGLE-3 draft heads are not implemented in this engine yet (n-gram drafts are: method 'ngram')",
    "eagle": "EAGLE (1/2) draft heads are not implemented in this engine (n-gram drafts are: method 'ngram')",
    "mtp": "multi-token-prediction (MTP) drafts are not implemented in this engine (method 'ngram' is)",
    "dspark": "dspark drafts are not implemented in this engine (method 'ngram' is)",
    "medusa": "Medusa heads are not implemented in this engine (method 'ngram' is)",
    "draft_model": "a separate draft model is not implemented in this engine (method 'ngram' is)",
}
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Validated speculative-decoding settings (vLLM's ``--speculative-config`` keys)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5


def refusal(method: str) -> str | None:
    """Why ``method`` is refused, or None when it is built."""
    if method in METHODS:
        return None
    return _REFUSED_METHODS.get(method, f"unknown method {method!r} (built: {list(METHODS)})")


def speculative_config(method: str, num_speculative_tokens: object, lookup_min: object = None,
                       lookup_max: object = None, flag: str = "--speculative-config") -> SpeculativeConfig:  # fmt: skip
    """Validate one spelling of the settings; ValueError naming ``flag`` for what cannot run."""
    why = refusal(method)
    if why is not None:
        raise ValueError(f"{flag}: method {method!r}: {why}")
    k = num_speculative_tokens
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"{flag}: num_speculative_tokens {k!r} must be an integer in 1..{MAX_SPECULATIVE_TOKENS}")
    # vLLM's defaults: neither given: 5 and 5; one given: the other takes its value.
    if lookup_min is None and lookup_max is None:
        lookup_min = lookup_max = 5
    lookup_min = lookup_max if lookup_min is None else lookup_min
    lookup_max = lookup_min if lookup_max is None else lookup_max
    for name, v in (("prompt_lookup_min", lookup_min), ("prompt_lookup_max", lookup_max)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{flag}: {name} {v!r} must be a positive integer")
    assert isinstance(lookup_min, int) and isinstance(lookup_max, int)
    if lookup_min > lookup_max:
        raise ValueError(f"{flag}: prompt_lookup_min {lookup_min} is above prompt_lookup_max {lookup_max}")
    return SpeculativeConfig(method, k, lookup_min, lookup_max)


def parse_speculative_config(text: str) -> SpeculativeConfig | None:
    """``--speculative-config`` JSON (vLLM's); ``{}`` or empty: no speculation."""
    raw = json_object_flag("--speculative-config", text, _CONFIG_KEYS)
    if not raw:
        return None
    method = raw.get("method")
    if method is None:
        raise ValueError("--speculative-config: 'method' is required (built: 'ngram')")
    if raw.get("model") is not None:
        raise ValueError("--speculative-config: 'model' (a draft checkpoint) is not supported: EAGLE-3 draft heads "
                         "are not implemented in this engine yet; method 'ngram' needs no model")  # fmt: skip
    return speculative_config(str(method), raw.get("num_speculative_tokens"), raw.get("prompt_lookup_min"),
                              raw.get("prompt_lookup_max"))  # fmt: skip


class DraftProposer(Protocol):
    """Proposes draft tokens to follow a sequence's tokens so far (before the step that verifies them)."""

    def propose(self, seq: Sequence, max_drafts: int) -> list[int]: ...


class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's last n tokens
    (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``), over the prompt and the output so far."""

    def __init__(self, num_speculative_tokens: int, lookup_min: int, lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max

    def propose(self, seq: Sequence, max_drafts: int) -> list[int]:
        return ngram_drafts(seq.token_ids, min(self.k, max_drafts), self.lookup_min, self.lookup_max)


def ngram_drafts(tokens: Seq[int], k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Up to ``k`` tokens following the latest earlier match of the longest suffix of ``tokens`` that has one."""
    if k <= 0 or len(tokens) < lookup_min + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(lookup_max, len(arr) - 1), lookup_min - 1, -1):
        # Windows that end before the last token: the suffix itself is no match.
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
        hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start : start + k].tolist()  # type: ignore[no-any-return]
    return []


def can_speculate(seq: Sequence) -> bool:
    """Whether a sequence may take drafts: its sampling depends on nothing that changes from one place of a
    verify row to the next (penalties, min_tokens, a grammar), it wants no logprobs, and a seeded request
    keeps its seed's own draws (a rejection sampler would draw differently)."""
    p = seq.params
    if p.shapes_logits or p.logprobs is not None or seq.grammar is not None:
        return False
    return p.greedy or p.seed is None


def accept_greedy(target: Seq[int], drafts: Seq[int]) -> list[int]:
    """The tokens a greedy verify row produces: drafts while each equals the target's argmax at its place,
    then the target's own next token (``target``: argmax at the row's ``1 + len(drafts)`` places)."""
    out: list[int] = []
    for i, d in enumerate(drafts):
        if d != target[i]:
            break
        out.append(d)
    out.append(target[len(out)])
    return out


def rejection_sample(probs: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor,
                     draft_probs: torch.Tensor | None, generator: torch.Generator) -> list[list[int]]:  # fmt: skip
    """Speculative sampling that keeps the target distribution, vectorised over rows.

    ``probs [R, K+1, V]``: the target's distribution at each row's places (after temperature and top-k/p);
    ``drafts [R, K]``: draft tokens (padding past ``num_drafts [R]`` is ignored); ``draft_probs [R, K, V]``:
    the draft's distributions, None for a deterministic proposer (n-gram: all mass on the draft). Draft i
    stands with probability min(1, p(d)/q(d)); the first rejected place draws from max(p - q, 0)
    renormalised, and a row whose drafts all stand draws a bonus token from p at the place after them.
    """
    rows, places, _ = probs.shape
    k = places - 1
    dev = probs.device
    r = torch.arange(rows, device=dev)
    if k:
        p_d = probs[:, :k].gather(2, drafts.unsqueeze(2)).squeeze(2)
        q_d = torch.ones_like(p_d) if draft_probs is None else draft_probs.gather(2, drafts.unsqueeze(2)).squeeze(2)
        u = torch.rand(rows, k, device=dev, generator=generator)
        valid = torch.arange(k, device=dev).unsqueeze(0) < num_drafts.unsqueeze(1)
        ok = (u * q_d < p_d) & valid  # u < p/q without dividing by a q that may be 0
        accepted = ok.to(torch.int64).cumprod(dim=1).sum(dim=1)
    else:
        accepted = torch.zeros(rows, dtype=torch.int64, device=dev)
    p_at = probs[r, accepted]
    rejected = accepted < num_drafts
    if k:
        at = accepted.clamp(max=k - 1)
        if draft_probs is None:
            q_at = torch.zeros_like(p_at).scatter_(1, drafts[r, at].unsqueeze(1), 1.0)
        else:
            q_at = draft_probs[r, at]
        residual = (p_at - q_at).clamp_min(0.0)
        # A residual with no mass cannot follow a rejection in exact arithmetic; in floats, fall back to p.
        usable = rejected & (residual.sum(dim=1) > 0)
        dist = torch.where(usable.unsqueeze(1), residual, p_at)
    else:
        dist = p_at
    final = torch.multinomial(dist, 1, generator=generator).squeeze(1)
    out: list[list[int]] = []
    for row, (n, last) in enumerate(zip(accepted.tolist(), final.tolist(), strict=True)):
        out.append([*drafts[row, :n].tolist(), last])
    return out
