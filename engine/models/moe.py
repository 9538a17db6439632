"""Sparse mixture-of-experts feed-forward block (Qwen3-MoE, Mixtral): a router and SwiGLU experts.

Each token's router logits pick its ``top_k`` experts; the token's output is the sum of those
experts' SwiGLU outputs, each scaled by its routing weight. Two backends compute the experts:

- ``"torch"``: the reference, a loop over the experts that were hit, in the order and dtypes of
  transformers 5.24's eager ``Qwen3MoeExperts`` / ``MixtralExperts`` (fp32 results equal theirs).
- ``"triton"``: ``engine.kernels.fused_moe`` (sort the (token, expert) pairs by expert, two grouped
  GEMMs), which never synchronises with the host and so can run inside a captured CUDA graph.

Expert weights are stacked: ``w13 [E, 2 * I, H]`` holds each expert's gate_proj rows then its
up_proj rows, ``w2 [E, H, I]`` its down_proj. Checkpoints store one tensor per expert and part;
``load_expert`` copies each into its slice and ``HUB_EXPERT_PARTS`` names the parts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# The per-expert tensor names of Hub checkpoints (what transformers' save_pretrained writes) and the
# part each fills: Qwen2/3-MoE ``mlp.experts.{e}.gate_proj.weight``, Mixtral
# ``block_sparse_moe.experts.{e}.w1.weight`` (w1 = gate, w3 = up, w2 = down).
HUB_EXPERT_PARTS: dict[str, str] = {
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
    "w1": "gate",
    "w3": "up",
    "w2": "down",
}

KERNELS = ("torch", "triton")


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, keep_float32: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights and expert ids ``([tokens, top_k], [tokens, top_k])`` from router logits.

    Softmax in float32 over all experts, the ``top_k`` largest, divided by their sum when
    ``renormalize`` (Qwen3-MoE's ``norm_topk_prob``; Mixtral always). Qwen3-MoE then casts the weights
    to the logits' dtype; Mixtral (transformers 5.24) keeps them in float32, which makes its
    weighting of each expert's output a float32 multiply: ``keep_float32`` reproduces that.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if not keep_float32:
        weights = weights.to(router_logits.dtype)
    return weights, ids


def experts_torch(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    first_expert: int = 0,
) -> torch.Tensor:
    """The reference expert computation: ``sum_k weights[t, k] * expert_{ids[t, k]}(x[t])``.

    Experts in ascending id, each over the tokens that picked it, accumulated into an output of
    ``x``'s dtype: transformers' eager loop, so its roundings (and fp32 results) are the same.
    Synchronises with the host (which experts were hit): the CPU path, not for CUDA graphs.
    ``w13``/``w2`` may hold a contiguous share of the experts from ``first_expert`` (expert parallel):
    the (token, expert) pairs of the others are left out.
    """
    out = torch.zeros_like(x)
    num_experts = w13.shape[0]
    with torch.no_grad():
        local = ids - first_expert
        local = torch.where((local >= 0) & (local < num_experts), local, num_experts)  # others: one extra class
        hit_mask = F.one_hot(local, num_classes=num_experts + 1).permute(2, 1, 0)[:num_experts]  # [E, top_k, tokens]
        hit = torch.greater(hit_mask.sum(dim=(-1, -2)), 0).nonzero()
    for e in hit[:, 0].tolist():
        slot, tok = torch.where(hit_mask[e])
        gate, up = F.linear(x[tok], w13[e]).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, w2[e]) * weights[tok, slot, None]
        out.index_add_(0, tok, h.to(out.dtype))
    return out


# Whether a decode step's router runs in parts along K (``gemv.parts_for``) that the routing program sums.
ROUTER_PARTS = True
# Whether one token's router and routing run in one launch on the CUDA one-token kernel where its experts run on it.
ROUTER_TOKEN = True


def sum_parts(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A layer's output ``[tokens, hidden]``, or ``[tokens, parts, hidden]`` left unsummed for the next residual add
    to sum (by the fused MoE kernels, ``SparseMoE.forward(..., sum_experts=False)``, or a skinny matmul split along
    K, ``ModelOps.linear_parts``): then summed in float32 and rounded once, as the kernels sum, to ``dtype`` (the
    residual stream's; the parts' own by default)."""
    if x.dim() != 3:
        return x
    return x.sum(dim=1, dtype=torch.float32).to(dtype or x.dtype)


def local_pairs(weights: torch.Tensor, ids: torch.Tensor, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing for a block holding experts ``first .. first + count - 1`` only (expert parallel), without a host
    sync (the fused kernel's path, graph-capturable): ids made local, another rank's pairs weighted 0 on local
    expert 0. Their compute is spent and adds exact zeros; the torch path skips them instead."""
    local = ids - first
    mine = (local >= 0) & (local < count)
    return weights * mine, torch.where(mine, local, 0)


class SparseMoE(nn.Module):
    """A sparse MoE feed-forward block: router ``gate`` plus ``num_experts`` SwiGLU experts.

    Built on the meta device and materialised with ``to_empty`` like the rest of the model: the
    constructor allocates and initialises nothing of its own. ``kernels`` picks the backend
    (``"torch"`` or ``"triton"``, see the module docstring); the runner sets it.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        *,
        float32_routing: bool = False,
        kernels: str = "torch",
        total_experts: int = 0,
        first_expert: int = 0,
    ) -> None:
        super().__init__()
        # Expert parallel: this block holds experts [first_expert, first_expert + num_experts) of total_experts.
        total_experts = total_experts or num_experts
        if not 0 < top_k <= total_experts:
            raise ValueError(f"top_k must be in 1..{total_experts} (the number of experts), not {top_k}")
        if not 0 <= first_expert <= total_experts - num_experts:
            raise ValueError(f"experts {first_expert}..{first_expert + num_experts - 1} are not among {total_experts}")
        self.total_experts = total_experts
        self.first_expert = first_expert
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        # Mixtral keeps its routing weights in float32 (see ``route``); Qwen3-MoE does not.
        self.float32_routing = float32_routing
        self.kernels = kernels
        self.gate = nn.Linear(hidden_size, total_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    @property
    def kernels(self) -> str:
        """The experts' backend: ``"torch"`` (reference) or ``"triton"`` (fused kernel)."""
        return self._kernels

    @kernels.setter
    def kernels(self, value: str) -> None:
        if value not in KERNELS:
            raise ValueError(f"unknown MoE kernels {value!r}: expected one of {KERNELS}")
        self._kernels = value

    def forward(self, x: torch.Tensor, sum_experts: bool = True) -> torch.Tensor:
        """``x [tokens, hidden]`` -> ``[tokens, hidden]``. Without ``sum_experts`` the fused kernels leave each
        token's ``top_k`` weighted expert outputs, ``[tokens, top_k, hidden]``, for the caller to sum
        (``sum_parts``); the torch path always sums (in the model dtype, as transformers does)."""
        if self._kernels == "triton":
            from engine.kernels import fused_moe as k  # imported only where Triton is wanted
            from engine.kernels import gemv, token_gemv

            whole = self.num_experts == self.total_experts  # expert parallel routes with route(), unsplit
            if (
                ROUTER_TOKEN and whole and k.one_token(x, self.w13, self.w2)
                and token_gemv.supports_router(x, self.gate.weight, self.top_k)
            ):  # fmt: skip
                # One token: router and routing in one launch, then each routed expert's rows (no alignment).
                weights, ids = token_gemv.token_route(x, self.gate.weight, self.top_k, self.renormalize,
                                                      self.float32_routing)  # fmt: skip
                return k.fused_moe(x, self.w13, self.w2, weights, ids, sum_experts=sum_experts)
            # Decode-sized batches: the router on the skinny-matmul kernel (in float32 parts along K, which the
            # routing program sums: its few row tiles would leave most SMs idle), routing and alignment in one launch.
            small = 0 < x.shape[0] <= gemv.MAX_TOKENS
            parts = gemv.parts_for(self.gate.weight, x.shape[0]) if small and whole and ROUTER_PARTS else 1
            logits = gemv.gemv(x, self.gate.weight, parts=parts) if small else self.gate(x)
            if not whole:
                weights, ids = k.route(logits, self.top_k, self.renormalize, self.float32_routing)
                weights, ids = local_pairs(weights, ids, self.first_expert, self.num_experts)
                return k.fused_moe(x, self.w13, self.w2, weights, ids, sum_experts=sum_experts)
            weights, ids, alignment = k.route_and_align(logits, self.top_k, self.renormalize, self.float32_routing,
                                                        dtype=x.dtype if parts > 1 else None)  # fmt: skip
            return k.fused_moe(x, self.w13, self.w2, weights, ids, alignment, sum_experts)
        weights, ids = route(self.gate(x), self.top_k, self.renormalize, self.float32_routing)
        return experts_torch(x, self.w13, self.w2, weights, ids, self.first_expert)

    def norm_forward(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
        """``forward`` (without ``sum_experts``) of ``weight * rmsnorm(residual + x)``, and ``residual + x``, with the
        add and the norm in the router's launch (``token_gemv.token_norm_route``): one token on the CUDA one-token
        kernels. None where that does not apply; the caller then norms and calls ``forward``."""
        if self._kernels != "triton" or not ROUTER_TOKEN or self.num_experts != self.total_experts:
            return None
        from engine.kernels import fused_moe as k  # imported only where Triton is wanted
        from engine.kernels import token_gemv

        gate = self.gate.weight
        if not (k.one_token(residual, self.w13, self.w2)
                and token_gemv.fuses_norm_route(x, residual, weight, gate, self.top_k)):  # fmt: skip
            return None
        weights, ids, h, residual = token_gemv.token_norm_route(x, residual, weight, eps, gate, self.top_k,
                                                                self.renormalize, self.float32_routing)  # fmt: skip
        return k.fused_moe(h, self.w13, self.w2, weights, ids, sum_experts=False), residual

    def load_expert(self, expert: int, part: str, tensor: torch.Tensor) -> None:
        """Copy one checkpoint tensor of expert ``expert`` into its slice of ``w13`` / ``w2``.

        ``part``: ``"gate"`` (gate_proj / w1, ``[I, H]``), ``"up"`` (up_proj / w3, ``[I, H]``) or
        ``"down"`` (down_proj / w2, ``[H, I]``). ``copy_`` converts dtype and device in place.
        """
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range: this block has {self.num_experts} experts")
        i = self.intermediate_size
        if part == "gate":
            dst = self.w13[expert, :i]
        elif part == "up":
            dst = self.w13[expert, i:]
        elif part == "down":
            dst = self.w2[expert]
        else:
            raise ValueError(f"unknown expert part {part!r}: expected 'gate', 'up' or 'down'")
        if tuple(tensor.shape) != tuple(dst.shape):
            raise ValueError(f"expert {expert} {part}: expected shape {tuple(dst.shape)}, got {tuple(tensor.shape)}")
        with torch.no_grad():
            dst.copy_(tensor)
