"""Small models whose saved-for-backward lists hold FP8 tensors. Thunder saves a fake-FP8 linear's float8 copies only
when it is recomputed in backward, hence ``checkpoint``; the gradient goes straight through, as a float8 cotangent would
underflow and prove nothing. Torch functions replace methods, operators and submodule calls, which Thunder's interpreter
traces more slowly."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _dequantized_linear(x, xq, x_scale, x_plain, w, wq, w_scale, w_plain, b):
    # values: dequant(xq) @ dequant(wq).T + b; gradients straight through (x - x_plain is exactly 0)
    x_eff = torch.add(x, torch.sub(torch.mul(xq.to(x.dtype), x_scale), x_plain))
    w_eff = torch.add(w, torch.sub(torch.mul(wq.to(w.dtype), w_scale), w_plain))
    return F.linear(x_eff, w_eff, b)


def fake_fp8_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` on float8_e4m3fn copies of ``x`` and ``w`` with per-tensor scales, recomputed in backward."""
    with torch.no_grad():
        # x_scale is per-rank, w_scale replicated (from the gathered weight)
        x_scale = torch.true_divide(torch.clamp(torch.amax(torch.abs(x)), min=1e-12), FP8_MAX)
        w_scale = torch.true_divide(torch.clamp(torch.amax(torch.abs(w)), min=1e-12), FP8_MAX)
        xq = torch.true_divide(x, x_scale).to(torch.float8_e4m3fn)
        wq = torch.true_divide(w, w_scale).to(torch.float8_e4m3fn)
        x_plain = torch.mul(x, 1.0)
        w_plain = torch.mul(w, 1.0)
    return checkpoint(_dequantized_linear, x, xq, x_scale, x_plain, w, wq, w_scale, w_plain, b, use_reentrant=False)


class FakeFP8Linear(nn.Linear):
    """``nn.Linear`` computing with float8_e4m3fn copies of its input and weight (per-tensor scales)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fake_fp8_linear(x, self.weight, self.bias)


class FakeFP8MLP(nn.Module):
    """``FakeFP8Linear`` layers with GELU between; widths need not divide the world size."""

    def __init__(self, widths: tuple[int, ...] = (24, 64, 45, 7)):
        super().__init__()
        self.layers = nn.ModuleList(FakeFP8Linear(i, o) for i, o in zip(widths[:-1], widths[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            # a module call where hooks wait for it (FSDP2), else the layer's function
            x = layer(x) if layer._forward_pre_hooks or layer._forward_hooks else _linear(layer, x)
            if i + 1 < len(self.layers):
                x = F.gelu(x)
        return x


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.mul(torch.mul(x, torch.rsqrt(torch.add(torch.mean(torch.pow(x, 2), -1, keepdim=True), eps))), weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def _linear(m: FakeFP8Linear, x: torch.Tensor) -> torch.Tensor:
    """``m(x)`` without the module call (see the module's docstring)."""
    return fake_fp8_linear(x, m.weight, m.bias)


def _norm(m: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    return rms_norm(x, m.weight, m.eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """LitGPT's rotary embedding: its ``cat`` is what ``torch_compile_cat_ex`` claims."""
    half = x.size(-1) // 2
    rotated = torch.cat((torch.neg(x[..., half:]), x[..., :half]), dim=-1)
    return torch.add(torch.mul(x, cos), torch.mul(rotated, sin))


class LlamaBlock(nn.Module):
    """A litgpt-style Llama block with ``FakeFP8Linear`` layers; with ``rope``, LitGPT's attention, where one
    torch.compile region returns ``v`` as a view of ``qkv``."""

    def __init__(self, n_embd: int, n_head: int, intermediate_size: int, rope: bool = False):
        super().__init__()
        self.n_head, self.rope = n_head, rope
        self.norm_1, self.norm_2 = RMSNorm(n_embd), RMSNorm(n_embd)
        self.qkv = FakeFP8Linear(n_embd, 3 * n_embd, bias=False)
        self.proj = FakeFP8Linear(n_embd, n_embd, bias=False)
        self.fc_1 = FakeFP8Linear(n_embd, intermediate_size, bias=False)
        self.fc_2 = FakeFP8Linear(n_embd, intermediate_size, bias=False)
        self.mlp_proj = FakeFP8Linear(intermediate_size, n_embd, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = torch.split(_linear(self.qkv, _norm(self.norm_1, x)), c, dim=-1)
        shape = (b, t, self.n_head, c // self.n_head)  # no generator expression: each next() is interpreted
        if self.rope:  # LitGPT: q.view(B, T, n_head, head_size).transpose(1, 2)
            q, k, v = torch.transpose(q.view(shape), 1, 2), torch.transpose(k.view(shape), 1, 2), torch.transpose(
                v.view(shape), 1, 2)
        else:
            q = torch.transpose(torch.reshape(q, shape), 1, 2)
            k = torch.transpose(torch.reshape(k, shape), 1, 2)
            v = torch.transpose(torch.reshape(v, shape), 1, 2)
        if self.rope:
            n = cos.shape[-1]  # the roped part, as LitGPT's rope_n_elem
            q = torch.cat((apply_rope(q[..., :n], cos, sin), q[..., n:]), dim=-1)
            k = torch.cat((apply_rope(k[..., :n], cos, sin), k[..., n:]), dim=-1)
        y = torch.reshape(torch.transpose(F.scaled_dot_product_attention(q, k, v, is_causal=True), 1, 2), (b, t, c))
        x = torch.add(x, _linear(self.proj, y))
        h = _norm(self.norm_2, x)
        return torch.add(x, _linear(self.mlp_proj, torch.mul(F.silu(_linear(self.fc_1, h)), _linear(self.fc_2, h))))


class FakeFP8Llama(nn.Module):
    """A litgpt-style Llama (token embedding, ``n_layer`` blocks, final RMSNorm, LM head) with fake-FP8 linears."""

    def __init__(self, n_layer: int, n_embd: int = 64, n_head: int = 4, intermediate_size: int = 172, vocab_size: int = 256,
                 rope: bool = False, block_size: int = 256):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.blocks = nn.ModuleList(LlamaBlock(n_embd, n_head, intermediate_size, rope) for _ in range(n_layer))
        self.norm = RMSNorm(n_embd)
        self.lm_head = FakeFP8Linear(n_embd, vocab_size, bias=False)
        self.rope = rope
        if rope:  # LitGPT's rope cache for the roped half of a head, every position up to block_size
            half = n_embd // n_head // 2
            angles = torch.arange(block_size)[:, None] / (10000 ** (torch.arange(half) / half))
            self.register_buffer("cos", angles.cos(), persistent=False)
            self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = F.embedding(idx, self.wte.weight)
        rope = (self.cos[: idx.shape[1]], self.sin[: idx.shape[1]]) if self.rope else ()
        for block in self.blocks:  # module calls: FSDP2 hooks them
            x = block(x, *rope)
        return _linear(self.lm_head, _norm(self.norm, x))


class PreNormBlock(nn.Module):
    """``x + fc2(gelu(fc1(layer_norm(x))))``: plain ``nn.Linear`` layers, nothing FP8."""

    def __init__(self, d: int):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.layer_norm(x, self.ln.normalized_shape, self.ln.weight, self.ln.bias, self.ln.eps)
        return torch.add(x, F.linear(F.gelu(F.linear(h, self.fc1.weight, self.fc1.bias)), self.fc2.weight, self.fc2.bias))


class PreNormMLP(nn.Module):
    """Pre-norm MLP blocks and a head in full precision: Thunder saves parameter aliases, gathered weights and an
    expanded LayerNorm weight."""

    def __init__(self, d: int = 32, n_blocks: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(PreNormBlock(d) for _ in range(n_blocks))
        self.head = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return F.linear(x, self.head.weight, self.head.bias)


class FP8WeightLinear(torch.autograd.Function):
    """``x @ dequant(quant(w)).T``, saving the float8 ``w`` with a straight-through gradient (docs/fp8_copies.md)."""

    @staticmethod
    def forward(ctx, x, w):
        scale = torch.true_divide(torch.clamp(torch.amax(torch.abs(w)), min=1e-12), FP8_MAX)
        wq = torch.true_divide(w, scale).to(torch.float8_e4m3fn)
        ctx.save_for_backward(x, wq, scale)
        return torch.matmul(x, torch.mul(wq.to(x.dtype), scale).t())

    @staticmethod
    def backward(ctx, g):
        x, wq, scale = ctx.saved_tensors
        w = torch.mul(wq.to(g.dtype), scale)
        return torch.matmul(g, w), torch.matmul(g.reshape(-1, g.shape[-1]).t(), x.reshape(-1, x.shape[-1]))


def _checkpointed_block(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return F.linear(torch.relu(F.linear(x, w1)), w2)


class CheckpointedBlocks(nn.Module):
    """Square linear pairs under ``checkpoint``: the forward saves the gathered weights for the recompute, which
    outweigh the activations, as in a checkpointed LLM."""

    def __init__(self, width: int = 256, blocks: int = 4):
        super().__init__()
        self.w1 = nn.ParameterList(nn.Parameter(torch.randn(width, width) / width ** 0.5) for _ in range(blocks))
        self.w2 = nn.ParameterList(nn.Parameter(torch.randn(width, width) / width ** 0.5) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w1, w2 in zip(self.w1, self.w2):
            x = checkpoint(_checkpointed_block, x, w1, w2, use_reentrant=False)
        return x

