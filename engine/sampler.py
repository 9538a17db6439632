"""Sampling of one step's batch: logit shaping, temperature, top-k / top-p / min-p, draws and logprobs.

Everything is vectorised over the batch: a step's rows share one pass per operation whatever mix of
settings they carry, and a batch of plain greedy requests costs one argmax, as before. The sampler
runs outside any captured CUDA graph (it reads the graph's logits) because its work depends on each
request's settings.

Seeded draws are counter-based: the noise of a draw comes from a generator seeded with
(seed, stream, step), where step is how many tokens the sequence already generated. A sequence
preempted and recomputed, one of n samples, or the decode side of a P/D pair (which holds the
prefill's first token) therefore draws exactly what a colocated run draws, with no generator state
to carry around.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch
import xxhash

from engine.kernels import triton_importable
from engine.sequence import SamplingParams, Sequence, TokenLogprob

# Rows from which the top-p cut is bisected on the GPU rather than sorted: a program per row makes 31 passes over
# it, about 0.7 ms for a 152k vocabulary whatever the number of rows up to one per SM, where sorting grows with the
# rows (H200: 0.57 ms at 1 row, 1.7 at 64; the crossing near 13).
BISECT_MIN_ROWS = 16

# What a -inf logprob (a token masked out) is reported as: JSON has no infinity; OpenAI and vLLM send this.
MASKED_LOGPROB = -9999.0


def _to(values: Seq[int] | Seq[float], dev: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A small tensor of ``values`` on ``dev`` without waiting for the device: on CUDA it crosses from pinned memory
    behind the work already queued (a tensor made on the device from a list waits for that work to finish, which
    would stall a step scheduled ahead)."""
    host = torch.tensor(values, dtype=dtype, pin_memory=dev.type == "cuda")
    return host.to(dev, non_blocking=True)


@dataclass(frozen=True, slots=True)
class SampleRow:
    """What sampling one row needs besides its logits; built from the sequence before the step."""

    params: SamplingParams
    seed_key: int | None = None  # the draw's generator seed (seeded requests only)
    output_ids: tuple[int, ...] = ()  # generated so far: penalties, min_tokens (only when needed)
    prompt_ids: tuple[int, ...] = ()  # only for a repetition penalty
    num_output: int = 0


@dataclass(frozen=True, slots=True)
class SampleOutput:
    """One token per row, and its logprobs where the request asked for them."""

    tokens: list[int]
    logprobs: list[TokenLogprob | None]
    prompt_logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)  # by seq_id
    # A step with verify rows (speculative decoding): every token each row produces, in order (its first is
    # ``tokens[i]``); None in any other step.
    token_lists: list[list[int]] | None = None


def seed_key(seed: int, stream: int, step: int) -> int:
    """The generator seed of draw ``step`` of a seeded request's stream ``stream``."""
    raw = (seed % (1 << 64)).to_bytes(8, "little") + stream.to_bytes(4, "little") + step.to_bytes(8, "little")
    return xxhash.xxh64_intdigest(raw) & ((1 << 63) - 1)


def sample_row(seq: Sequence) -> SampleRow:
    """The SampleRow of a sequence about to draw its next token (the token history only when needed)."""
    p = seq.params
    if p.plain:  # the same row every step: made once per sequence
        row = seq.plain_row
        if row is None:
            row = seq.plain_row = SampleRow(p)
        return row  # type: ignore[no-any-return]
    step = seq.num_completion_tokens
    key = seed_key(p.seed, seq.stream_index, step) if p.seed is not None and not p.greedy else None
    if not (p.penalized or p.min_tokens > 0):
        return SampleRow(p, key, num_output=step)
    prompt = tuple(seq.token_ids[: seq.num_prompt_tokens]) if p.repetition_penalty != 1.0 else ()
    return SampleRow(p, key, tuple(seq.token_ids[seq.num_prompt_tokens :]), prompt, step)


class Sampler:
    """Turns a step's logits into tokens for its rows (one per sequence that reached its end)."""

    def __init__(self, eos_token_ids: frozenset[int], seed: int) -> None:
        self.eos_token_ids = tuple(sorted(eos_token_ids))
        self.seed = seed
        # Unseeded draws come from one generator per device, made on first use (no noise crosses PCIe).
        self._generators: dict[torch.device, torch.Generator] = {}

    def generator(self, device: torch.device) -> torch.Generator:
        """The generator of unseeded draws on ``device`` (the rejection sampler's too)."""
        return self._generator(device)

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return gen

    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor,
        rows: Seq[SampleRow],
        greedy: torch.Tensor | None = None,
        bitmask: torch.Tensor | None = None,
        bitmask_rows: Seq[int] = (),
    ) -> SampleOutput:
        """Tokens for ``logits [rows, vocab]``; ``greedy``: the argmax, already taken (a graph's);
        ``bitmask``: structured-output token masks (xgrammar's layout) for ``bitmask_rows``."""
        if bitmask is None and all(r.params.plain for r in rows):
            return SampleOutput((logits.argmax(dim=-1) if greedy is None else greedy).tolist(), [None] * len(rows))
        tokens, scaled = self._sample(logits, rows, greedy, bitmask, bitmask_rows)
        token_list: list[int] = tokens.tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(rows)
        params = [r.params for r in rows]
        if any(p.logprobs is not None for p in params):
            wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
            logprobs_of = token_logprobs(scaled[wanted], tokens[wanted], [params[i].logprobs or 0 for i in wanted])
            for i, lp in zip(wanted, logprobs_of, strict=True):
                logprobs[i] = lp
        return SampleOutput(token_list, logprobs)

    @torch.inference_mode()
    def tokens(self, logits: torch.Tensor, rows: Seq[SampleRow], greedy: torch.Tensor | None = None) -> torch.Tensor:
        """The tokens ``sample`` would draw, left on the device in a tensor of their own (no wait for the step, which
        may still run; no logprobs, no grammar masks): what a step scheduled ahead reads its input ids from."""
        if all(r.params.plain for r in rows):
            return (logits.argmax(dim=-1) if greedy is None else greedy).clone()
        return self._sample(logits, rows, greedy, None, ())[0]  # a new tensor (greedy is cloned there)

    def _sample(
        self, logits: torch.Tensor, rows: Seq[SampleRow], greedy: torch.Tensor | None, bitmask: torch.Tensor | None,
        bitmask_rows: Seq[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The drawn tokens of ``rows`` on the device, and the logits they were drawn from (scaled, shaped)."""
        params = [r.params for r in rows]
        shaped = bitmask is not None or any(p.shapes_logits for p in params)
        all_greedy = all(p.greedy for p in params)
        logits = logits.float()
        if shaped:
            logits = logits.clone()  # a graph's logits live in its static output buffer
            self._shape(logits, rows, bitmask, bitmask_rows)
        dev = logits.device
        if all_greedy:
            scaled = logits
        else:
            temps = _to([1.0 if p.greedy else p.temperature for p in params], dev, torch.float32)
            scaled = logits / temps.unsqueeze(1)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if len(sampled) == len(rows):
            tokens = self._draw(scaled, rows)
        else:
            tokens = scaled.argmax(dim=-1) if shaped or greedy is None else greedy.clone()
            if sampled:
                at = _to(sampled, dev, torch.int64)
                tokens.index_copy_(0, at, self._draw(scaled.index_select(0, at), [rows[i] for i in sampled]))
        return tokens, scaled

    def _shape(self, logits: torch.Tensor, rows: Seq[SampleRow], bitmask: torch.Tensor | None,
               bitmask_rows: Seq[int]) -> None:  # fmt: skip
        """Penalties, logit bias, min_tokens and grammar masks, in place, one pass each over the batch."""
        dev = logits.device
        batch, vocab = logits.shape
        params = [r.params for r in rows]
        if any(p.penalized for p in params):
            r_idx = [i for i, r in enumerate(rows) for _ in r.output_ids]
            t_idx = [t for r in rows for t in r.output_ids]
            counts = torch.zeros(batch, vocab, device=dev)
            if t_idx:
                counts.index_put_((torch.tensor(r_idx, device=dev), torch.tensor(t_idx, device=dev)),
                                  torch.ones(len(t_idx), device=dev), accumulate=True)  # fmt: skip
            freq = torch.tensor([p.frequency_penalty for p in params], device=dev).unsqueeze(1)
            presence = torch.tensor([p.presence_penalty for p in params], device=dev).unsqueeze(1)
            seen = counts > 0
            logits -= freq * counts + presence * seen
            if any(p.repetition_penalty != 1.0 for p in params):
                # As vLLM (and the CTRL paper): tokens of the prompt or the output so far are made less
                # likely by dividing a positive logit, multiplying a negative one.
                pr_rows = [i for i, r in enumerate(rows) for _ in r.prompt_ids]
                pr_toks = [t for r in rows for t in r.prompt_ids]
                if pr_toks:
                    seen[torch.tensor(pr_rows, device=dev), torch.tensor(pr_toks, device=dev)] = True
                rep = torch.tensor([p.repetition_penalty for p in params], device=dev).unsqueeze(1)
                penalized = torch.where(logits > 0, logits / rep, logits * rep)
                logits.copy_(torch.where(seen, penalized, logits))
        bias = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias]
        if bias:
            where = (_to([i for i, _, _ in bias], dev, torch.int64), _to([t for _, t, _ in bias], dev, torch.int64))
            logits.index_put_(where, _to([b for _, _, b in bias], dev, torch.float32), accumulate=True)
        banned = [
            (i, t)
            for i, r in enumerate(rows)
            if r.num_output < r.params.min_tokens
            for t in (*r.params.stop_token_ids, *(() if r.params.ignore_eos else self.eos_token_ids))
        ]
        if banned:
            where = (_to([i for i, _ in banned], dev, torch.int64), _to([t for _, t in banned], dev, torch.int64))
            logits.index_put_(where, torch.full((len(banned),), float("-inf"), device=dev))
        if bitmask is not None:
            from engine.structured import apply_bitmask

            apply_bitmask(logits, bitmask, bitmask_rows)

    def target_probs(self, logits: torch.Tensor, rows: Seq[SampleRow]) -> torch.Tensor:
        """The distribution each row draws from ``[rows, vocab]``: temperature, top-k, top-p and min-p applied
        (what the rejection sampler must keep). Rows are sampled ones (no greedy row) that shape no logits."""
        temps = torch.tensor([r.params.temperature for r in rows], device=logits.device)
        probs, ids = self._probs(logits.float() / temps.unsqueeze(1), rows)
        probs = probs / probs.sum(dim=-1, keepdim=True)  # min-p leaves the kept mass below 1
        if ids is None:
            return probs
        return torch.zeros_like(logits, dtype=probs.dtype).scatter_(1, ids, probs)

    def _draw(self, scaled: torch.Tensor, rows: Seq[SampleRow]) -> torch.Tensor:
        """One token per row of ``scaled`` (logits already divided by the temperature)."""
        probs, ids = self._probs(scaled, rows)
        # Exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p. The noise is drawn per
        # vocabulary id, so a draw does not depend on which columns were kept.
        noise = self._noise(rows, scaled.shape[-1], scaled.device)
        if ids is None:
            return (probs / noise).argmax(dim=-1)
        choice = (probs / noise.gather(1, ids)).argmax(dim=-1, keepdim=True)
        return ids.gather(1, choice).squeeze(1)

    def _probs(self, scaled: torch.Tensor, rows: Seq[SampleRow]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's probabilities after top-k / top-p / min-p (not renormalised), and the vocabulary ids of the
        columns they cover when every row has a top-k (its best ``max(k)``, sorted by logit); None: every column, in
        vocabulary order."""
        dev = scaled.device
        params = [r.params for r in rows]
        vocab = scaled.shape[-1]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_p = _to([p.top_p for p in params], dev, torch.float32).unsqueeze(1)
        ids: torch.Tensor | None = None  # the vocabulary ids of the columns kept (top-k), else all
        if max(top_k) < vocab:
            # Every row has a top-k: work on the best max(k) columns only (a full sort costs 20x more).
            scaled, ids = scaled.topk(max(top_k), dim=-1)
        probs = scaled.softmax(-1)
        cut_k = [k for k in top_k if k < vocab]
        if cut_k or any(p.top_p < 1.0 for p in params):
            # Top-k and top-p cut each row at one probability: its k-th largest (the floor; 0 without top-k), then
            # the least one top-p keeps of what is left.
            floor = torch.zeros_like(top_p)
            if cut_k:
                most = max(cut_k)
                best = probs if ids is not None else probs.topk(most, dim=-1).values
                kth = _to([min(k, most) - 1 for k in top_k], dev, torch.int64).unsqueeze(1)
                has_k = _to([k < vocab for k in top_k], dev, torch.bool).unsqueeze(1)
                floor = torch.where(has_k, best.gather(1, kth), floor)
            cut = cut_sorted(probs, floor, top_p) if ids is not None else top_p_threshold(probs, floor, top_p)
            probs = probs.masked_fill(probs < cut, 0.0)
        if any(p.min_p > 0 for p in params):
            floor = _to([p.min_p for p in params], dev, torch.float32).unsqueeze(1) * probs.amax(-1, keepdim=True)
            probs = probs.masked_fill(probs < floor, 0.0)
        return probs, ids

    def _noise(self, rows: Seq[SampleRow], vocab: int, dev: torch.device) -> torch.Tensor:
        """Exp(1) noise ``[rows, vocab]``: a seeded row's from its own counter-based generator."""
        unseeded = [i for i, r in enumerate(rows) if r.seed_key is None]
        if len(unseeded) == len(rows):
            return torch.empty(len(rows), vocab, device=dev).exponential_(1.0, generator=self._generator(dev))
        noise = torch.empty(len(rows), vocab, device=dev)
        if unseeded:
            drawn = torch.empty(len(unseeded), vocab, device=dev).exponential_(1.0, generator=self._generator(dev))
            noise.index_copy_(0, _to(unseeded, dev, torch.int64), drawn)
        for i, r in enumerate(rows):
            if r.seed_key is not None:  # on the CPU: the same draws whatever the device
                row = torch.empty(vocab, pin_memory=dev.type == "cuda")
                row.exponential_(1.0, generator=torch.Generator().manual_seed(r.seed_key))
                noise[i].copy_(row, non_blocking=True)
        return noise


def top_p_threshold(probs: torch.Tensor, floor: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row of ``probs [rows, vocab]``, the least probability top-p keeps (``top_p [rows, 1]``) of what top-k
    kept (``floor [rows, 1]``: the k-th largest probability, 0 without top-k), at least ``floor``: ``[rows, 1]``.
    Top-p keeps a token when the tokens above it hold at most ``top_p`` of the kept mass. On CUDA, from
    ``BISECT_MIN_ROWS`` rows, a Triton kernel bisects the cut without sorting (engine/kernels/sampling.py);
    otherwise the rows are sorted (on the GPU, no wait for the host either way)."""
    if probs.is_cuda and probs.shape[0] >= BISECT_MIN_ROWS and triton_importable():
        from engine.kernels.sampling import top_p_threshold as on_gpu

        return on_gpu(probs, floor, top_p)
    return cut_sorted(torch.sort(probs, dim=-1, descending=True).values, floor, top_p)


def cut_sorted(ordered: torch.Tensor, floor: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``top_p_threshold`` of rows already sorted in descending order."""
    ordered = ordered.masked_fill(ordered < floor, 0.0)
    above = ordered.cumsum(-1) - ordered  # the mass ranked above each
    kept = (above <= top_p * ordered.sum(-1, keepdim=True)) & (ordered > 0)
    last = (kept.sum(-1, keepdim=True) - 1).clamp(min=0)
    cut = torch.where(top_p < 1.0, ordered.gather(1, last), 0.0)  # top-p 1: no cut (not one left to rounding)
    return torch.maximum(cut, floor)


def token_logprobs(scaled: torch.Tensor, tokens: torch.Tensor, top: Seq[int]) -> list[TokenLogprob]:
    """The log-softmax of ``scaled`` at ``tokens`` with each row's rank and ``top[i]`` best alternatives."""
    lp = scaled.log_softmax(dim=-1)
    chosen = lp.gather(1, tokens.unsqueeze(1)).squeeze(1)
    ranks = (lp > chosen.unsqueeze(1)).sum(dim=-1) + 1
    k = max(top, default=0)
    best_lp, best_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], tokens[:0].unsqueeze(0).expand(len(tokens), 0))
    out = []
    for i, (c, r, tok) in enumerate(zip(chosen.tolist(), ranks.tolist(), tokens.tolist(), strict=True)):
        pairs = tuple((t, _finite(v)) for t, v in zip(best_ids[i, : top[i]].tolist(), best_lp[i, : top[i]].tolist(),
                                                       strict=True))  # fmt: skip
        out.append(TokenLogprob(tok, _finite(c), r, pairs))
    return out


def _finite(value: float) -> float:
    return value if value > MASKED_LOGPROB else MASKED_LOGPROB
