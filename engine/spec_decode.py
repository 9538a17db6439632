"""Speculative decoding: the ``--speculative-config`` settings, draft proposers and the acceptance of drafts.

A decoding sequence that has drafts computes its last token and its ``k`` drafts in one target step
(a verify row: ``1 + k`` query tokens over its cached context, like a prefill chunk). The target's
logits at those ``1 + k`` places decide how many drafts stand: under greedy sampling a draft stands
while it equals the target's argmax, so the output is the target's own, token for token; under
sampling the rejection sampler (Leviathan et al. 2023, Chen et al. 2023) keeps the target's
distribution. Either way one more token (the correction or the bonus) follows the accepted drafts.
The KV written for rejected drafts is past the sequence's new length: the next step overwrites it,
and blocks held only for it go back to the pool (``BlockManager.trim``).

Drafts come from prompt lookup (``NgramProposer``: the tokens that followed an earlier occurrence of the
latest n-gram) or from an EAGLE-3 head (``EagleDrafter``). The head drafts inside the model step itself: the
scheduler only reserves room for ``k`` drafts (``EagleProposer`` answers placeholders), and the runner, before
the target's forward, lets the head propose them from what it computed the step before; after the verify it
feeds the head the target's hidden states at the positions that stood, which writes the head's own KV there
and yields the next step's first draft.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from engine.attention import AttentionMetadata, decode_mask, kv_cache_shape, plan_prefill
from engine.flags import json_object_flag
from engine.kernels import decode_splits
from engine.models.eagle3 import Eagle3Draft, LoadedDraft
from engine.sequence import Sequence

_CONFIG_KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}
METHODS = ("ngram", "eagle3")
# Methods known from vLLM / ATOM that are not built here: method -> why.
_REFUSED_METHODS = {
    "eagle": "EAGLE (1/2) draft heads are not implemented in this engine (EAGLE-3 heads are: method 'eagle3')",
    "mtp": "multi-token-prediction (MTP) drafts are not implemented in this engine (methods 'ngram' and 'eagle3' are)",
    "dspark": "dspark drafts are not implemented in this engine (methods 'ngram' and 'eagle3' are)",
    "medusa": "Medusa heads are not implemented in this engine (methods 'ngram' and 'eagle3' are)",
    "draft_model": "a separate draft model is not implemented in this engine (methods 'ngram' and 'eagle3' are)",
}
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Validated speculative-decoding settings (vLLM's ``--speculative-config`` keys)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    model: str | None = None  # the EAGLE-3 head's folder (method eagle3)


def refusal(method: str) -> str | None:
    """Why ``method`` is refused, or None when it is built."""
    if method in METHODS:
        return None
    return _REFUSED_METHODS.get(method, f"unknown method {method!r} (built: {list(METHODS)})")


def speculative_config(method: str, num_speculative_tokens: object, lookup_min: object = None,
                       lookup_max: object = None, flag: str = "--speculative-config",
                       model: object = None) -> SpeculativeConfig:  # fmt: skip
    """Validate one spelling of the settings; ValueError naming ``flag`` for what cannot run."""
    why = refusal(method)
    if why is not None:
        raise ValueError(f"{flag}: method {method!r}: {why}")
    if method == "eagle3" and not (isinstance(model, str) and model):
        raise ValueError(f"{flag}: method 'eagle3' needs the draft head's folder ('model' in --speculative-config, "
                         "or ATOM's --draft-model)")  # fmt: skip
    if method == "eagle3" and (lookup_min is not None or lookup_max is not None):
        raise ValueError(f"{flag}: prompt_lookup_min/max are settings of method 'ngram', not of 'eagle3'")
    if method == "ngram" and model is not None:
        raise ValueError(f"{flag}: method 'ngram' drafts from the text itself and takes no draft model ({model!r})")
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
    return SpeculativeConfig(method, k, lookup_min, lookup_max, model if isinstance(model, str) else None)


def parse_speculative_config(text: str) -> SpeculativeConfig | None:
    """``--speculative-config`` JSON (vLLM's); ``{}`` or empty: no speculation."""
    raw = json_object_flag("--speculative-config", text, _CONFIG_KEYS)
    if not raw:
        return None
    method = raw.get("method")
    if method is None:
        raise ValueError(f"--speculative-config: 'method' is required (built: {list(METHODS)})")
    return speculative_config(str(method), raw.get("num_speculative_tokens"), raw.get("prompt_lookup_min"),
                              raw.get("prompt_lookup_max"), model=raw.get("model"))  # fmt: skip


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


# -- EAGLE-3 ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EagleRows:
    """Where each sequence of a step sits in the flattened batch, for the EAGLE-3 head (built with the step).

    ``sampled[i]``: the index of sequence i's sampled row (-1: a prompt chunk that samples nothing, whose
    ``next_token`` is the prompt token after it); ``num_drafts[i]``: the drafts it verifies (placeholders in the
    inputs until the head proposes them); ``speculate[i]``: whether it takes drafts at all (``can_speculate``).
    """

    seq_ids: tuple[int, ...]
    starts: tuple[int, ...]
    lens: tuple[int, ...]
    ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    tables: tuple[list[int], ...]
    speculate: tuple[bool, ...]
    sampled: tuple[int, ...]
    next_token: tuple[int, ...]
    num_drafts: tuple[int, ...]


def attention_meta(query_lens: list[int], cached_lens: list[int], slots: np.ndarray, tables: Seq[list[int]],
                   block_size: int, triton: bool, kv_heads: int,
                   device: torch.device, fp8: bool = False) -> AttentionMetadata:  # fmt: skip
    """Metadata of a step that reads and writes the paged cache: every sequence decodes (one query each) or
    every one computes a chunk after its cached context. ``fp8``: the cache is float8 (its decode split differs)."""
    n = len(query_lens)
    decodes = n if all(q == 1 for q in query_lens) else 0
    width = max(len(t) for t in tables)
    table = np.zeros((n, width), dtype=np.int64)
    for i, t in enumerate(tables):
        table[i, : len(t)] = t
    idx = torch.int32 if triton else torch.int64
    context_lens = [c + q for c, q in zip(cached_lens, query_lens, strict=True)]
    context = torch.tensor(context_lens, dtype=idx, device=device)
    meta = AttentionMetadata(
        num_decodes=decodes,
        slot_mapping=torch.from_numpy(slots).to(device=device, dtype=idx),
        block_tables=torch.from_numpy(table).to(device=device, dtype=idx),
        context_lens=context,
        query_lens=query_lens,
        cached_lens=cached_lens,
        max_query_len=max(query_lens),
        max_context=max(context_lens),
    )
    if triton:
        starts = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(query_lens, out=starts[1:])
        meta.query_start = torch.from_numpy(starts).to(device)
        if decodes:
            meta.num_splits = decode_splits(n, kv_heads, meta.max_context, device, fp8)
    else:
        meta.prefill_groups, meta.cached_seqs = plan_prefill(query_lens, cached_lens, device, first=decodes)
        if decodes:
            meta.decode_width = -(-max(context_lens) // block_size)
            meta.decode_mask = decode_mask(context, meta.decode_width * block_size)
    return meta


class EagleDrafter:
    """Runs an EAGLE-3 head beside the target: its own one-layer paged KV cache (the target's block ids), and per
    sequence the first draft and hidden state its last pass left for the next step."""

    def __init__(self, head: Eagle3Draft, block_size: int, triton: bool, device: torch.device) -> None:
        self.head = head
        self.block_size = block_size
        self.triton = triton
        self.device = device
        self.kv_cache: torch.Tensor | None = None
        # seq_id -> (first draft, hidden state after the head's last position); only sequences of the last step.
        self.state: dict[int, tuple[int, torch.Tensor]] = {}

    def ready(self, seq_id: int) -> bool:
        """Whether ``seq_id`` has a first draft (it ran in the last step, with a sampled token)."""
        return seq_id in self.state

    def unit_bytes(self, cache_dtype: torch.dtype) -> int:
        """Bytes of one block of the head's K (or V)."""
        layer = self.head.config.layer
        elem = torch.empty((), dtype=cache_dtype).element_size()
        return self.block_size * layer.num_key_value_heads * layer.head_dim * elem

    def allocate(self, num_blocks: int, cache_dtype: torch.dtype) -> None:
        """The head's KV cache: ``num_blocks`` blocks paged like the target's (with its scratch block, if any)."""
        layer = self.head.config.layer
        shape = kv_cache_shape(num_blocks, self.block_size, layer.num_key_value_heads, layer.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=cache_dtype, device=self.device)

    def pick(self, normed: torch.Tensor, seq_ids: list[int], positions: list[int]) -> torch.Tensor:
        """The draft token following each row (the head's greedy choice; rows are at ``positions`` of ``seq_ids``)."""
        return self.head.greedy_tokens(normed)

    def _run(self, ids: torch.Tensor, positions: np.ndarray, hidden: torch.Tensor, query_lens: list[int],
             cached_lens: list[int], slots: np.ndarray,
             tables: Seq[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        assert self.kv_cache is not None, "the head's KV cache is not allocated"
        layer = self.head.config.layer
        meta = attention_meta(query_lens, cached_lens, slots, tables, self.block_size, self.triton,
                              layer.num_key_value_heads, self.device, self.kv_cache.element_size() == 1)  # fmt: skip
        idx = torch.int32 if self.triton else torch.int64
        pos = torch.from_numpy(positions).to(device=self.device, dtype=idx)
        return self.head(ids, pos, hidden, self.kv_cache, meta)  # type: ignore[no-any-return]

    def draft(self, rows: EagleRows) -> list[list[int]]:
        """The drafts of each sequence that verifies some: the first from the last step, then one head pass per
        further draft (sequence i's j-th pass at position ``p + j - 1``, ``p`` its last token's, inside the blocks
        reserved for its verify row)."""
        out: list[list[int]] = [[] for _ in rows.seq_ids]
        active = [i for i, m in enumerate(rows.num_drafts) if m]
        if not active:
            return out
        for i in active:
            out[i].append(self.state[rows.seq_ids[i]][0])
        hidden = torch.stack([self.state[rows.seq_ids[i]][1] for i in active])
        bs = self.block_size
        for j in range(1, max(rows.num_drafts)):
            keep = [n for n, i in enumerate(active) if rows.num_drafts[i] > j]
            if len(keep) < len(active):
                hidden = hidden[keep]
                active = [active[n] for n in keep]
            pos = np.asarray([int(rows.positions[rows.starts[i]]) + j - 1 for i in active], dtype=np.int64)
            slots = np.asarray(
                [rows.tables[i][p // bs] * bs + p % bs for i, p in zip(active, pos.tolist(), strict=True)],
                dtype=np.int64,
            )
            ids = torch.tensor([out[i][-1] for i in active], dtype=torch.int64, device=self.device)
            normed, hidden = self._run(ids, pos, hidden, [1] * len(active), pos.tolist(), slots,
                                       [rows.tables[i] for i in active])  # fmt: skip
            nxt = self.pick(normed, [rows.seq_ids[i] for i in active], pos.tolist()).tolist()
            for i, t in zip(active, nxt, strict=True):
                out[i].append(int(t))
        return out

    def catch_up(self, rows: EagleRows, aux: torch.Tensor, outputs: Seq[Seq[int]]) -> None:
        """After the verify: run the head over every position of the step whose token stands, from the target's
        hidden states there (``aux [tokens, 3 * hidden]``; ``outputs``: the tokens each sampled row produced),
        which writes its KV there; keep the next step's first draft and hidden state of each sequence."""
        src: list[int] = []
        tokens: list[int] = []
        query_lens: list[int] = []
        seqs: list[int] = []
        last_rows: list[int] = []  # per sampled sequence: its last row among the head's rows
        sampled_ids: list[int] = []
        for i, seq_id in enumerate(rows.seq_ids):
            if not rows.speculate[i]:
                continue
            s, n = rows.starts[i], rows.lens[i]
            if rows.sampled[i] >= 0:
                produced = list(outputs[rows.sampled[i]])
                # A verify row: its last token and the drafts that stood; their successors are what it produced.
                m = len(produced) if rows.num_drafts[i] else n
                follow = produced if rows.num_drafts[i] else [*rows.ids[s + 1 : s + n].tolist(), produced[-1]]
            else:
                m, follow = n, [*rows.ids[s + 1 : s + n].tolist(), rows.next_token[i]]
            src.extend(range(s, s + m))
            tokens.extend(follow)
            query_lens.append(m)
            seqs.append(i)
            if rows.sampled[i] >= 0:
                last_rows.append(len(src) - 1)
                sampled_ids.append(seq_id)
        state: dict[int, tuple[int, torch.Tensor]] = {}
        if src:
            at = np.asarray(src, dtype=np.int64)
            index = torch.from_numpy(at).to(self.device)
            hidden = self.head.fuse(aux[index])
            ids = torch.tensor(tokens, dtype=torch.int64, device=self.device)
            cached = [int(rows.positions[rows.starts[i]]) for i in seqs]
            normed, prenorm = self._run(ids, rows.positions[at], hidden, query_lens, cached, rows.slots[at],
                                        [rows.tables[i] for i in seqs])  # fmt: skip
            if last_rows:
                last = torch.tensor(last_rows, dtype=torch.int64, device=self.device)
                firsts = self.pick(normed[last], sampled_ids, rows.positions[at[last_rows]].tolist()).tolist()
                kept = prenorm[last]  # a copy: the pass's other rows are not held until the next step
                state = {sid: (int(t), kept[j]) for j, (sid, t) in enumerate(zip(sampled_ids, firsts, strict=True))}
        self.state = state


class EagleProposer:
    """The scheduler's side of EAGLE-3: room for ``k`` drafts (placeholders) for each sequence whose first draft
    the head left in the last step; the runner fills in the real ones."""

    def __init__(self, drafter: EagleDrafter, num_speculative_tokens: int) -> None:
        self.drafter = drafter
        self.k = num_speculative_tokens

    def propose(self, seq: Sequence, max_drafts: int) -> list[int]:
        return [0] * min(self.k, max_drafts) if self.drafter.ready(seq.seq_id) else []


def build_drafter(draft: LoadedDraft, target_embedding: torch.Tensor, device: torch.device, dtype: torch.dtype,
                  block_size: int, triton: bool, max_len: int) -> EagleDrafter:  # fmt: skip
    """The head of ``draft`` on ``device`` in ``dtype`` (the target's embedding shared when it has none)."""
    with torch.device("meta"):
        head = Eagle3Draft(draft.config)
    head = head.to(dtype).to_empty(device=device)
    head.load_weights(draft.weights(), target_embedding)
    head.init_rope(device, max_len)
    head.eval()
    if triton:
        from engine.kernels.ops import TritonOps

        head.ops = TritonOps()
    return EagleDrafter(head, block_size, triton, device)
