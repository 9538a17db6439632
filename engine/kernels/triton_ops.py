"""Triton kernels of the decoder's hot path: fused norms, SwiGLU, RoPE + KV store, paged attention.

Each kernel reproduces the rounding of the torch code it replaces (``engine.models.decoder`` and
``engine.attention``): intermediate results are rounded to the model dtype where torch rounds them,
so greedy outputs agree token for token (tested against the torch path under ``TRITON_INTERPRET=1``
on CPU, and on CUDA). None of them synchronises with the host or sizes anything from device data,
so a decode step built from them can be captured in a CUDA graph.

Paged attention is one kernel for every step kind: each program takes one sequence, one KV head
and a tile of query rows (query tokens x the query heads sharing that KV head), and walks the
sequence's KV through its block table with an online softmax, causal with the cached context as
offset. A decode batch too small to fill the GPU splits each sequence's context over several
programs (flash-decoding) and merges their partial results in a second kernel.
"""

# Triton kernels take pointers and constexprs, which have no Python types; the host code is typed.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from engine.kernels import (
    DECODE_BLOCK_N,
    PDL_EARLY,
    DecodeTile,
    decode_tile,
    fp8_decode,
    interpret_mode,
    nvrtc,
    pdl_launch,
    prefill_block_m,
    token_norm,
)  # fmt: skip
from engine.kernels.merge import merge_splits
from engine.kernels.pdl import enter, leave_loop

if TYPE_CHECKING:
    from engine.kernels.ops import QKNorm

_INTERPRET = interpret_mode()

# -- norms and activations ----------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps,
    HAS_RES: tl.constexpr, PARTS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    if PARTS == 1:
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    else:
        # x is [rows, PARTS, n_cols] (a MoE layer's outputs per expert, or a matmul's float32 parts along K):
        # summed in float32, rounded once to the residual stream's dtype.
        xs = tl.zeros([BLOCK], tl.float32)
        for j in tl.static_range(PARTS):
            xs += tl.load(x_ptr + (row * PARTS + j) * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        x = xs.to(res_ptr.dtype.element_ty)
    if HAS_RES:
        # residual + x, rounded to the model dtype as torch's add is.
        r = tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(r.dtype)
        tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    y = (xf * tl.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = (w.to(tl.float32) * y.to(tl.float32)).to(x.dtype)
    tl.store(out_ptr + row * n_cols + cols, out, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * rmsnorm(x)`` over the last axis of a contiguous ``[rows, hidden]`` tensor."""
    if token_norm.supports(x, None, weight) and token_norm.enabled() and nvrtc.available():
        return token_norm.token_norm(x, None, weight, eps)[0]
    out = torch.empty_like(x)
    n = x.shape[-1]
    _rms_norm_kernel[(x.shape[0],)](
        x, x, weight, out, out, n, eps, HAS_RES=False, PARTS=1, BLOCK=triton.next_power_of_2(n),
        **pdl_launch(x.device, x.shape[0]),
    )  # fmt: skip
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[
        torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(weight * rmsnorm(residual + x), residual + x)`` in one pass. ``x`` may be ``[rows, parts, hidden]``
    (a MoE layer's per-expert outputs, or a skinny matmul's float32 parts along K), summed over ``parts`` in
    float32 and rounded once to the residual's dtype before the add."""
    if token_norm.supports(x, residual, weight) and token_norm.enabled() and nvrtc.available():
        return token_norm.token_norm(x, residual, weight, eps)
    out = torch.empty_like(residual)
    res_out = torch.empty_like(residual)
    n = x.shape[-1]
    _rms_norm_kernel[(residual.shape[0],)](
        x.contiguous(), residual, weight, out, res_out, n, eps, HAS_RES=True, PARTS=x.shape[1] if x.dim() == 3 else 1,
        BLOCK=triton.next_power_of_2(n), **pdl_launch(x.device, residual.shape[0]),
    )  # fmt: skip
    return out, res_out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(x_ptr + row * 2 * n + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * 2 * n + n + cols, mask=mask, other=0.0)
    s = (g / (1.0 + tl.exp(-g))).to(u.dtype)
    tl.store(out_ptr + row * n + cols, (s.to(tl.float32) * u.to(tl.float32)).to(u.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]`` of shape ``[rows, 2 * n]``."""
    rows, n = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(n))
    _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](x, out, n, BLOCK=block, **pdl_launch(x.device, rows))
    return out


# -- rotary positions + KV store ----------------------------------------------------------------


def _check_cache(kv_cache: torch.Tensor) -> None:
    # The kernels address [2, blocks, kv_heads, block_size, head_dim] through its strides; a head's row is dense.
    if kv_cache.dim() != 5 or kv_cache.stride(-1) != 1:
        raise ValueError(f"a KV cache is [2, blocks, kv_heads, block_size, head_dim] with dense rows, got shape "
                         f"{tuple(kv_cache.shape)} strides {kv_cache.stride()}")  # fmt: skip


@triton.jit
def _rope(x, xr, sign, c, s, dt: tl.constexpr):
    # x * cos + rotate_half(x) * sin with torch's three roundings to the model dtype.
    a = (x.to(tl.float32) * c[None, :]).to(dt)
    b = ((xr.to(tl.float32) * sign[None, :]) * s[None, :]).to(dt)
    return (a.to(tl.float32) + b.to(tl.float32)).to(dt)


@triton.jit
def _head_norm(x, xr, w_ptr, d, rot, eps, dt: tl.constexpr, D: tl.constexpr):
    # Per-head RMSNorm of rows x (and of their rotated view xr, the same values permuted), as torch_rms_norm:
    # float32 inside, rounded to the model dtype, then times the weight in the model dtype.
    x32 = x.to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x32 * x32, 1) / D + eps)
    w = tl.load(w_ptr + d).to(tl.float32)
    wr = tl.load(w_ptr + rot).to(tl.float32)
    y = (w[None, :] * (x32 * r[:, None]).to(dt).to(tl.float32)).to(dt)
    yr = (wr[None, :] * (xr.to(tl.float32) * r[:, None]).to(dt).to(tl.float32)).to(dt)
    return y, yr


@triton.jit
def _rope_and_store_kernel(
    qkv_ptr, pos_ptr, cos_ptr, sin_ptr, q_ptr, kv_ptr, slot_ptr, v_offset, qn_ptr, kn_ptr, eps,
    H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, SB: tl.constexpr, SH: tl.constexpr,
    SS: tl.constexpr, HP: tl.constexpr, KVHP: tl.constexpr, QK_NORM: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # One program per token and group of KVH // gridDim.y KV heads (HP query heads, KVHP KV heads in its tile).
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    dt: tl.constexpr = q_ptr.dtype.element_ty
    d = tl.arange(0, D)
    rot = (d + D // 2) % D
    sign = tl.where(d < D // 2, -1.0, 1.0)
    # The tables are float32; torch casts them to the model dtype before multiplying.
    c = tl.load(cos_ptr + pos * D + d).to(dt).to(tl.float32)
    s = tl.load(sin_ptr + pos * D + d).to(dt).to(tl.float32)
    row = qkv_ptr + t * (H + 2 * KVH) * D
    q_per_program = H // tl.num_programs(1)
    h = g * q_per_program + tl.arange(0, HP)
    hm = (tl.arange(0, HP) < q_per_program)[:, None]
    q = tl.load(row + h[:, None] * D + d[None, :], mask=hm, other=0.0)
    qr = tl.load(row + h[:, None] * D + rot[None, :], mask=hm, other=0.0)
    if QK_NORM:
        q, qr = _head_norm(q, qr, qn_ptr, d, rot, eps, dt, D)
    tl.store(q_ptr + t * H * D + h[:, None] * D + d[None, :], _rope(q, qr, sign, c, s, dt), mask=hm)
    kv_per_program = KVH // tl.num_programs(1)
    kh = g * kv_per_program + tl.arange(0, KVHP)
    km = (tl.arange(0, KVHP) < kv_per_program)[:, None]
    k = tl.load(row + H * D + kh[:, None] * D + d[None, :], mask=km, other=0.0)
    kr = tl.load(row + H * D + kh[:, None] * D + rot[None, :], mask=km, other=0.0)
    if QK_NORM:
        k, kr = _head_norm(k, kr, kn_ptr, d, rot, eps, dt, D)
    v = tl.load(row + (H + KVH) * D + kh[:, None] * D + d[None, :], mask=km, other=0.0)
    cdt: tl.constexpr = kv_ptr.dtype.element_ty
    # KV head kh's row of this slot is [block, kh, offset] of the cache's [blocks, KVH, BS, D] (strides SB, SH, SS).
    dst = kv_ptr + (slot // BS) * SB + kh[:, None] * SH + (slot % BS) * SS + d[None, :]
    tl.store(dst, _rope(k, kr, sign, c, s, dt).to(cdt), mask=km)
    tl.store(dst + v_offset, v.to(cdt), mask=km)


def rope_and_store(
    qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, qk_norm: QKNorm | None = None,
) -> torch.Tensor:  # fmt: skip
    """Rotate Q and K of ``qkv [tokens, (H + 2 * KVH) * D]``; write K and V to their cache slots.

    ``qk_norm``: each head's Q and K are RMS-normalised first (Qwen3). Returns the rotated queries
    ``[tokens, H, D]``. ``kv_cache`` is ``[2, blocks, KVH, block_size, D]`` (``engine.attention.kv_cache_shape``).
    """
    n = qkv.shape[0]
    q = torch.empty((n, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    _check_cache(kv_cache)
    qn, kn, eps = (qk_norm.q_weight, qk_norm.k_weight, qk_norm.eps) if qk_norm is not None else (q, q, 0.0)
    # A decode step of a few tokens spreads each token's heads over its KV heads' groups (a program each): one
    # program doing every head of a token is a serial chain of loads, reductions and stores on one SM.
    groups = num_kv_heads if n <= ROPE_GROUPS_TOKENS else 1
    _rope_and_store_kernel[(n, groups)](
        qkv, positions, cos, sin, q, kv_cache, slot_mapping, kv_cache.stride(0), qn, kn, eps,
        H=num_heads, KVH=num_kv_heads, D=head_dim, BS=kv_cache.shape[3],
        SB=kv_cache.stride(1), SH=kv_cache.stride(2), SS=kv_cache.stride(3),
        HP=triton.next_power_of_2(num_heads // groups), KVHP=triton.next_power_of_2(num_kv_heads // groups),
        QK_NORM=qk_norm is not None, **pdl_launch(qkv.device, n),
    )  # fmt: skip
    return q


# Steps of at most this many tokens rotate and store with a program per (token, KV head).
ROPE_GROUPS_TOKENS = 16


# -- paged attention ----------------------------------------------------------------------------


@triton.jit
def _e4m3x4_to_f16(w, INTERPRET: tl.constexpr):
    # The four float8_e4m3fn bytes of each int32 of w, low byte first, as fp16 (exact: fp16 holds every e4m3 value).
    if INTERPRET:
        # Triton's interpreter runs no PTX: the same values by bit arithmetic (e4m3's sign, exponent and mantissa
        # placed in fp16's fields, then times 2^8 for the exponent biases' difference; e4m3's NaN is not kept).
        out = []
        for i in tl.static_range(4):
            b = (w >> (8 * i)) & 0xFF
            h = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.int16)
            out.append((h.to(tl.float16, bitcast=True).to(tl.float32) * 256.0).to(tl.float16))
        return out[0], out[1], out[2], out[3]
    else:
        return tl.inline_asm_elementwise(
            asm="{ .reg .b16 lo, hi; .reg .b32 a, b; mov.b32 {lo, hi}, $4; cvt.rn.f16x2.e4m3x2 a, lo; "
                "cvt.rn.f16x2.e4m3x2 b, hi; mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }",
            constraints="=h,=h,=h,=h,r", args=[w], dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True, pack=1,
        )  # fmt: skip


@triton.jit
def _attend(
    q, kv_ptr, table, n0, hi, qpos, g, d, m_i, l_i, acc, qk_scale, v_offset, window,
    H: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, SB: tl.constexpr, SH: tl.constexpr,
    SS: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, V_REGS: tl.constexpr,
    INTERPRET: tl.constexpr, MASK: tl.constexpr, LAZY: tl.constexpr,
):  # fmt: skip
    # One tile of BLOCK_N keys, read through the block table, folded into the online softmax. Key j of KV head g
    # is [block, g, j % BS] of the cache's [blocks, KVH, BS, D] (strides SB, SH, SS): in the engine's head-major
    # cache, a head's keys of a block are one contiguous run of BS * D.
    # Without MASK the tile is one every query of the program sees whole (the caller's bound): no mask on the
    # loads or the scores.
    j = n0 + tl.arange(0, BLOCK_N)
    jm = j < hi
    rows = jm[:, None] if MASK else None
    blk = tl.load(table + j // BS, mask=jm if MASK else None, other=0 if MASK else None).to(tl.int64)
    off = blk * SB + g * SH + (j % BS) * SS
    k = tl.load(kv_ptr + off[:, None] + d[None, :], mask=rows, other=0.0 if MASK else None).to(q.dtype)
    # Scores in log2 units (qk_scale holds log2(e)): exp2 is the hardware's exponential.
    sc = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if MASK:
        seen = (j[None, :] <= qpos[:, None]) & jm[None, :]
        if window > 0:
            seen = seen & (j[None, :] > qpos[:, None] - window)
        sc = tl.where(seen, sc, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, 1))
    if LAZY:
        # The running maximum (and with it the output and sum) is moved only when some row's grew by more than
        # 2^8: after the first tiles that is rare, and the rescale is a multiply per output element. A stale
        # maximum leaves each probability at most 2^8, which fp16 holds as exactly as one below 1.
        if tl.max(m_new - m_i, 0) > 8.0:
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha
            acc = acc * alpha[:, None]
            m_i = m_new
        p = tl.exp2(sc - m_i[:, None])
        l_i = l_i + tl.sum(p, 1)
        m_new = m_i
    else:
        p = tl.exp2(sc - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
    if V_REGS:
        # An FP8 V tile widened in registers, four values per 32-bit word, before the dot: left to Triton, the FP8
        # tile goes to shared memory as it is and the dot reads each byte back by itself (V is the dot's
        # second operand along keys, across its rows), which bounded the FP8 kernel at bf16's speed.
        vw = (kv_ptr + v_offset + off).to(tl.pointer_type(tl.int32))[:, None] + tl.arange(0, D // 4)[None, :]
        w = tl.load(vw, mask=rows, other=0 if MASK else None)
        e0, e1, e2, e3 = _e4m3x4_to_f16(w, INTERPRET)
        # Word c holds columns 4c..4c+3 (little-endian): interleave the four back into rows of D.
        v = tl.reshape(tl.join(tl.join(e0, e2), tl.join(e1, e3)), (BLOCK_N, D))
    else:
        v = tl.load(kv_ptr + v_offset + off[:, None] + d[None, :], mask=rows, other=0.0 if MASK else None)
        v = v.to(q.dtype)
    acc += tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _rope_in_place(
    qkv_ptr, kv_ptr, out_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, qn_ptr, kn_ptr, eps, t, h, g, d, valid,
    holds_last, v_offset, H: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, SB: tl.constexpr,
    SH: tl.constexpr, SS: tl.constexpr, QK_NORM: tl.constexpr,
):  # fmt: skip
    # The paged attention kernel's ROPE: its rows' queries (token t, heads h) from qkv, rotated as
    # _rope_and_store_kernel rotates them; with holds_last, KV head g's key and value of the token stored in the cache,
    # then a barrier.
    dt: tl.constexpr = out_ptr.dtype.element_ty
    t = t.to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    rot = (d + D // 2) % D
    sign = tl.where(d < D // 2, -1.0, 1.0)
    c = tl.load(cos_ptr + pos * D + d).to(dt).to(tl.float32)
    s = tl.load(sin_ptr + pos * D + d).to(dt).to(tl.float32)
    row = qkv_ptr + t * (H + 2 * (H // GROUP)) * D
    q = tl.load(row + h[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
    qr = tl.load(row + h[:, None] * D + rot[None, :], mask=valid[:, None], other=0.0)
    if QK_NORM:
        q, qr = _head_norm(q, qr, qn_ptr, d, rot, eps, dt, D)
    # The token's key and value of KV head g, one row, read and stored by the program holding the context's last keys.
    one = tl.arange(0, 1)[:, None]
    km = (one == 0) & holds_last
    k_at = row + H * D + g * D + one * 0
    k = tl.load(k_at + d[None, :], mask=km, other=0.0)
    kr = tl.load(k_at + rot[None, :], mask=km, other=0.0)
    if QK_NORM:
        k, kr = _head_norm(k, kr, kn_ptr, d, rot, eps, dt, D)
    v = tl.load(k_at + (H // GROUP) * D + d[None, :], mask=km, other=0.0)
    cdt: tl.constexpr = kv_ptr.dtype.element_ty
    slot = tl.load(slot_ptr + t).to(tl.int64)
    dst = kv_ptr + (slot // BS) * SB + g * SH + (slot % BS) * SS + one * 0 + d[None, :]
    tl.store(dst, _rope(k, kr, sign, c, s, dt).to(cdt), mask=km)
    tl.store(dst + v_offset, v.to(cdt), mask=km)
    tl.debug_barrier()  # the stores before any thread of the program loads the tile they are in
    return _rope(q, qr, sign, c, s, dt)


@triton.jit
def _paged_attention_kernel(
    q_ptr, kv_ptr, out_ptr, tables_ptr, qstart_ptr, ctx_ptr, part_acc_ptr, part_ml_ptr, tile_seq_ptr, tile_q_ptr,
    scale, v_offset, table_stride, num_splits, window, pos_ptr, cos_ptr, sin_ptr, slot_ptr, qn_ptr, kn_ptr, eps,
    H: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, SB: tl.constexpr, SH: tl.constexpr,
    SS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILE_Q: tl.constexpr,
    SPLIT: tl.constexpr, TILED: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
    FP16_DOT: tl.constexpr, V_REGS: tl.constexpr, UNMASKED: tl.constexpr, LAZY: tl.constexpr, PDL: tl.constexpr,
    ROPE: tl.constexpr, QK_NORM: tl.constexpr,
):  # fmt: skip
    # ROPE (decode steps, one query token a sequence): q_ptr is the step's fused projection qkv, and the program does
    # what rope_and_store would have done before it: each query head of its rows normalised (QK_NORM) and rotated;
    # the program whose keys end the context rotates the token's key and stores it and its value in the cache, then
    # a barrier makes them visible to its own loads of that tile.
    enter(PDL)
    g = tl.program_id(2)
    ok = True
    if SPLIT:
        s = tl.program_id(1)
        mt = 0
        sp = tl.program_id(0)
    elif TILED:
        # Program -> (sequence, query tile) through a map the host built; -1: a padding program.
        seq = tl.load(tile_seq_ptr + tl.program_id(0))
        ok = seq >= 0
        s = tl.maximum(seq, 0)
        mt = tl.load(tile_q_ptr + tl.program_id(0))
        sp = 0
    else:
        s = tl.program_id(1)
        mt = tl.program_id(0)
        sp = 0
    q0 = tl.load(qstart_ptr + s)
    qlen = tl.load(qstart_ptr + s + 1) - q0
    ctx = tl.load(ctx_ptr + s)
    r = tl.arange(0, BLOCK_M)
    tq = mt * TILE_Q + r // GROUP  # query token of each row, within the sequence
    h = g * GROUP + r % GROUP  # query head of each row
    valid = (r < TILE_Q * GROUP) & (tq < qlen) & ok
    qpos = ctx - qlen + tq  # absolute position: the cached context comes first
    kv_end = tl.minimum(ctx, ctx - qlen + (mt + 1) * TILE_Q)
    if SPLIT:
        # The keys this sequence's query sees, in num_splits runs of whole tiles sized from its own context: a graph
        # captured for the longest context splits a short one as finely.
        start = 0
        if window > 0:
            start = tl.maximum(kv_end - window, 0)
        split_size = tl.cdiv(tl.cdiv(kv_end - start, num_splits), BLOCK_N) * BLOCK_N
        lo = start + sp * split_size
        hi = tl.minimum(kv_end, lo + split_size)
    else:
        lo = 0
        hi = tl.where(ok, kv_end, 0)
    if window > 0:
        # Keys before the window of the tile's first query are never seen: skip them.
        lo = tl.maximum(lo, ctx - qlen + mt * TILE_Q - window + 1)
    d = tl.arange(0, D)
    q_rows = (q0 + tq).to(tl.int64) * (H * D) + h * D
    if ROPE:
        q = _rope_in_place(q_ptr, kv_ptr, out_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, qn_ptr, kn_ptr, eps, q0, h, g,
                           d, valid, (lo < hi) & (hi == ctx) & ok, v_offset, H, GROUP, D, BS, SB, SH, SS,
                           QK_NORM)  # fmt: skip
    else:
        q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)
    if FP16_DOT:
        # An FP8 cache widens to fp16 natively (e4m3 -> bf16 does not): keys, values, Q and P go through fp16.
        q = q.to(tl.float16)
    m_i = tl.full([BLOCK_M], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    table = tables_ptr + s.to(tl.int64) * table_stride
    qk_scale = scale * 1.4426950408889634  # log2(e): the softmax runs in base 2
    # Tiles every query of the program sees whole run without masks; the rest (the causal diagonal, a context's
    # last partial tile, a sliding window's rows) with them. A decode query sees every key of [lo, hi).
    mid = lo
    if UNMASKED:
        if TILE_Q == 1:
            mid = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
        elif window == 0:
            seen_by_all = tl.minimum(hi, ctx - qlen + mt * TILE_Q + 1)  # keys up to the tile's first query
            mid = lo + tl.maximum(seen_by_all - lo, 0) // BLOCK_N * BLOCK_N
    if INTERPRET:
        # Triton's interpreter cannot run a `for` over a loaded bound; a `while` is the same loop.
        n0 = lo
        while n0 < hi:
            if n0 < mid:
                m_i, l_i, acc = _attend(
                    q, kv_ptr, table, n0, hi, qpos, g, d, m_i, l_i, acc, qk_scale, v_offset, window,
                    H, GROUP, D, BS, SB, SH, SS, BLOCK_N, PRECISION, V_REGS, INTERPRET, False, LAZY,
                )  # fmt: skip
            else:
                m_i, l_i, acc = _attend(
                    q, kv_ptr, table, n0, hi, qpos, g, d, m_i, l_i, acc, qk_scale, v_offset, window,
                    H, GROUP, D, BS, SB, SH, SS, BLOCK_N, PRECISION, V_REGS, INTERPRET, True, LAZY,
                )  # fmt: skip
            n0 += BLOCK_N
    else:
        for n0 in range(lo, mid, BLOCK_N):
            m_i, l_i, acc = _attend(
                q, kv_ptr, table, n0, hi, qpos, g, d, m_i, l_i, acc, qk_scale, v_offset, window,
                H, GROUP, D, BS, SB, SH, SS, BLOCK_N, PRECISION, V_REGS, INTERPRET, False, LAZY,
            )  # fmt: skip
        for n0 in range(mid, hi, BLOCK_N):
            m_i, l_i, acc = _attend(
                q, kv_ptr, table, n0, hi, qpos, g, d, m_i, l_i, acc, qk_scale, v_offset, window,
                H, GROUP, D, BS, SB, SH, SS, BLOCK_N, PRECISION, V_REGS, INTERPRET, True, LAZY,
            )  # fmt: skip
    leave_loop(PDL)
    if SPLIT:
        part = (s * H + h).to(tl.int64) * num_splits + sp
        tl.store(part_acc_ptr + part[:, None] * D + d[None, :], acc, mask=valid[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=valid)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=valid)
    else:
        out = acc / l_i[:, None]
        tl.store(out_ptr + q_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=valid[:, None])


# Programs over prompt rows: masked, eager, uncapped.
PREFILL_TILE = DecodeTile(DECODE_BLOCK_N, 4, 3)

# A decode step's rotary positions and K/V store in its attention kernel (paged_attention's ``rope``), where the
# caller can (engine.kernels.ops.TritonOps.attention): one launch fewer a layer. Measured on the H200 at batch 1
# (docs/engine.md, twenty-first round): qwen3-8b +1.2%, FP8 weights +2.4%, qwen3-30b-a3b +3.0%.
ROPE_IN_ATTENTION = 1
# Where a step's attention kernel lets the next kernel launch under PDL: PDL_EARLY first thing, PDL_LOOP once its
# programs leave their loop. Early, the merge's and then the output projection's blocks are placed while the
# attention runs, and the weight chunks they ask for before their wait stream then. With the rope in the attention
# and a run of each 16-bit row staged (token_gemv.STAGE_RUNS): qwen3-8b 250.5 -> 254.6 tok/s, qwen3-30b-a3b 402.7 ->
# 414.6 (docs/engine.md, twenty-first round).
ATTENTION_TRIGGER = PDL_EARLY


@dataclass(frozen=True, slots=True)
class RopeInAttention:
    """What ``rope_and_store`` takes beside the projection and the cache: the tokens' positions, the float32 rotary
    tables, the cache slots, the query heads and the optional per-head norm."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slot_mapping: torch.Tensor
    heads: int
    qk_norm: QKNorm | None = None

    def args(self, out: torch.Tensor) -> list[object]:
        """The kernel's arguments ``pos_ptr .. eps`` (``out`` stands in for absent norm weights)."""
        qn, kn, eps = (
            (self.qk_norm.q_weight, self.qk_norm.k_weight, self.qk_norm.eps) if self.qk_norm is not None
            else (out, out, 0.0)
        )  # fmt: skip
        return [self.positions, self.cos, self.sin, self.slot_mapping, qn, kn, eps]


def paged_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, query_start: torch.Tensor,
    context_lens: torch.Tensor, scale: float, max_query_len: int, max_context: int, num_splits: int = 1,
    tile_map: tuple[torch.Tensor, torch.Tensor] | None = None, window: int = 0, block_n: int = 0,
    num_warps: int = 0, num_stages: int = 0, v_regs: bool | None = None, unmasked: bool | None = None,
    lazy_rescale: bool | None = None, max_registers: int | None = None, rope: RopeInAttention | None = None,
) -> torch.Tensor:  # fmt: skip
    """Causal attention of ``q [tokens, H, D]`` over each sequence's cached context (this step's K/V included).

    Sequence ``s`` owns query rows ``query_start[s]:query_start[s + 1]`` and ``context_lens[s]`` cached
    tokens, the last of which are its queries' own. ``max_query_len`` and ``max_context`` bound them
    (host values: they size the grid; in a captured graph, the capture's bounds). ``num_splits`` > 1
    (decode only) splits each context over that many programs. ``tile_map`` (sequence, query tile)
    per program, -1 for none, sizes the grid instead of the bounds (see ``engine.kernels.tile_map``):
    a captured graph's grid then fits any batch of up to that many tiles. ``kv_cache`` is
    ``[2, blocks, kv_heads, block_size, head_dim]``, addressed through its strides: the engine's is contiguous
    (head-major), and a permuted view of a slot-major cache reads the same (``bench/device/fp8_tune.py`` times both).
    ``block_n``, ``num_warps``, ``num_stages``: the tile (0: the measured one, ``decode_tile`` for decode steps).
    ``v_regs``: an e4m3 cache's V tiles are widened to fp16 in registers before the dot (the default for such a
    cache); False leaves the widening to Triton (``fp8_tune.py`` times both). ``unmasked``, ``lazy_rescale``,
    ``max_registers``: the loop's form and register cap (``DecodeTile``; None: the measured tile's for decode steps,
    masked, eager and uncapped for prompts). The lazy rescale applies to decode steps only.

    ``rope``: a decode step (``max_query_len`` 1) whose rotary positions and K/V store are done here
    (``RopeInAttention``), ``q`` then being the step's fused projection ``[tokens, (H + 2 * KVH) * D]``; the result is
    what ``rope_and_store`` then this function give, in one launch.
    """
    if rope is not None and max_query_len != 1:
        raise ValueError(
            f"rope in the attention kernel is for decode steps (one query a sequence), not {max_query_len}"
        )
    if (
        rope is None and max_query_len == 1
        and not (block_n or num_warps or num_stages or v_regs is not None or unmasked is not None
                 or lazy_rescale is not None or max_registers is not None)
        and fp8_decode.supports(q, kv_cache, max_query_len, window) and fp8_decode.enabled()
        and nvrtc.available()
    ):  # fmt: skip
        # Decode over an e4m3 cache: the CUDA kernel (engine.kernels.fp8_decode), unless a Triton tile was asked for.
        splits = min(num_splits, triton.cdiv(max_context, fp8_decode.KEYS_PER_TILE))
        return fp8_decode.fp8_decode_attention(q, kv_cache, block_tables, query_start, context_lens, scale, splits)
    _, _, kv_heads, bs, d = kv_cache.shape
    if rope is None:
        heads = q.shape[1]
        out = torch.empty_like(q)
    else:
        heads = rope.heads
        out = torch.empty((q.shape[0], heads, d), dtype=q.dtype, device=q.device)
    rope_args = rope.args(out) if rope is not None else [out] * 6 + [0.0]
    rope_flags = {"ROPE": rope is not None, "QK_NORM": rope is not None and rope.qk_norm is not None}
    group = heads // kv_heads
    seqs = block_tables.shape[0]
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    fp16_dot = kv_cache.element_size() == 1 and q.dtype != torch.float32
    e4m3 = fp16_dot and kv_cache.dtype == torch.float8_e4m3fn and d % 4 == 0
    if v_regs and not e4m3:
        raise ValueError(f"v_regs widens an e4m3 cache with a head size divisible by 4 and 16-bit queries, got a "
                         f"{kv_cache.dtype} cache, head size {d}, {q.dtype} queries")  # fmt: skip
    v_regs = e4m3 if v_regs is None else v_regs
    tile = decode_tile(v_regs) if max_query_len == 1 else PREFILL_TILE
    block_n, num_warps, num_stages = block_n or tile.block_n, num_warps or tile.warps, num_stages or tile.stages
    unmasked = tile.unmasked if unmasked is None else unmasked
    # Decode programs only: a prompt tile's rows span warps, whose check of the maxima would cost a barrier a tile.
    lazy = (tile.lazy_rescale if lazy_rescale is None else lazy_rescale) and max_query_len == 1
    regs = tile.max_registers if max_registers is None else max_registers
    launch = {"num_warps": num_warps, "num_stages": num_stages, **({"maxnreg": regs} if regs else {}),
              **pdl_launch(q.device, q.shape[0], ATTENTION_TRIGGER)}  # fmt: skip
    _check_cache(kv_cache)
    v_offset = kv_cache.stride(0)
    strides = {"SB": kv_cache.stride(1), "SH": kv_cache.stride(2), "SS": kv_cache.stride(3)}
    splits = min(num_splits, triton.cdiv(max_context, block_n))
    if max_query_len == 1 and splits > 1:
        block_m = max(16, triton.next_power_of_2(group))
        part_acc = torch.empty((seqs, heads, splits, d), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((seqs, heads, splits, 2), dtype=torch.float32, device=q.device)
        _paged_attention_kernel[(splits, seqs, kv_heads)](
            q, kv_cache, out, block_tables, query_start, context_lens, part_acc, part_ml, out, out,
            scale, v_offset, block_tables.stride(0), splits, window, *rope_args,
            H=heads, GROUP=group, D=d, BS=bs, **strides, BLOCK_M=block_m, BLOCK_N=block_n, TILE_Q=1,
            SPLIT=True, TILED=False, PRECISION=precision, INTERPRET=_INTERPRET, FP16_DOT=fp16_dot,
            V_REGS=v_regs, UNMASKED=unmasked, LAZY=lazy, **rope_flags, **launch,
        )  # fmt: skip
        return merge_splits(part_acc, part_ml, out, splits)
    if tile_map is not None:
        block_m = prefill_block_m(group)
        tile_seq, tile_idx = tile_map
        grid: tuple[int, int, int] = (tile_seq.shape[0], 1, kv_heads)
    else:
        block_m = max(16, triton.next_power_of_2(group)) if max_query_len == 1 else prefill_block_m(group)
        tile_seq = tile_idx = out
        grid = (triton.cdiv(max_query_len, block_m // group), seqs, kv_heads)
    _paged_attention_kernel[grid](
        q, kv_cache, out, block_tables, query_start, context_lens, out, out, tile_seq, tile_idx,
        scale, v_offset, block_tables.stride(0), 1, window, *rope_args,
        H=heads, GROUP=group, D=d, BS=bs, **strides, BLOCK_M=block_m, BLOCK_N=block_n, TILE_Q=block_m // group,
        SPLIT=False, TILED=tile_map is not None, PRECISION=precision, INTERPRET=_INTERPRET, FP16_DOT=fp16_dot,
        V_REGS=v_regs, UNMASKED=unmasked, LAZY=lazy, **rope_flags, **launch,
    )  # fmt: skip
    return out
