"""The Decoder: one pre-norm transformer for the TinyStories model and Qwen3."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from octlm.cache import KVCache
from octlm.config import DecoderConfig


class RMSNorm(nn.Module):
    """RMSNorm whose statistics are taken in float32 whatever the input dtype (fp16 safety)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(self.weight.dtype)


class LayerNorm(nn.LayerNorm):
    """LayerNorm computed in float32, returned in the parameters' dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.layer_norm(x.float(), self.normalized_shape, self.weight.float(), self.bias.float(), self.eps)
        return out.to(self.weight.dtype)


# A decode step multiplies one row by every weight matrix, so it is bound by how fast the weights
# are read. For float32 on the CPU, torch's default (MKL) kernel reads them at about half the memory
# bandwidth and oneDNN's at nearly all of it; from about 64 rows on MKL is as fast or faster.
FEW_ROWS = 16
ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear(x: torch.Tensor, weight: torch.Tensor, kernels: str = "fast") -> torch.Tensor:
    """x @ weight.T; with kernels="fast", a few float32 rows on the CPU outside autograd go to oneDNN."""
    few_rows = x.numel() <= FEW_ROWS * x.shape[-1]
    on_cpu = x.is_cpu and x.dtype == weight.dtype == torch.float32
    if kernels == "fast" and ONEDNN and few_rows and on_cpu and not torch.is_grad_enabled():
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return F.linear(x, weight)


class Linear(nn.Linear):
    """A bias-free nn.Linear whose product follows config.kernels, read at every call.

    `parts` lists the output rows of each matrix stacked in it (q, k and v; gate and up): one product
    then serves them all, which reads the same bytes in fewer, larger kernels.
    """

    def __init__(self, in_features: int, parts: int | tuple[int, ...], config: DecoderConfig) -> None:
        parts = (parts,) if isinstance(parts, int) else parts
        super().__init__(in_features, sum(parts), bias=False)
        self.parts = parts
        self.config = config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.config.kernels)


def make_norm(config: DecoderConfig, dim: int) -> nn.Module:
    if config.norm == "rmsnorm":
        return RMSNorm(dim, config.norm_eps)
    return LayerNorm(dim, eps=config.norm_eps)


def rope_angles(
    positions: torch.Tensor, head_dim: int, base: float, split: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin tables of shape positions.shape + (head_dim,), always float32.

    Each dimension gets the angle of its pair, and the sin its sign in the rotation, so that
    `apply_rope` is two products and a sum. The tables are recomputed from integer positions on
    every forward rather than kept as a buffer, so `model.to(torch.bfloat16)` has nothing to cast: a
    bf16 angle at position 30,000 would be off by up to 64 radians.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (base**exponents)
    angles = positions.float()[..., None] * inv_freq
    cos, sin = angles.cos(), angles.sin()
    if split:
        return torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)
    return cos.repeat_interleave(2, -1), torch.stack((-sin, sin), -1).flatten(-2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, split: bool) -> torch.Tensor:
    """Rotate x (B, heads, T, hd) by tables (T or B x T, hd) from `rope_angles`; float32 inside.

    Two layouts pair the dimensions differently: adjacent (0,1), (2,3), ... as in the RoPE paper and
    Meta's Llama code, or split (i, i + hd/2) as in Hugging Face's Llama and Qwen ports. Both are
    rotations; weights trained with one are wrong under the other. Each dimension is multiplied by
    cos and its pair partner by the signed sin: x1 cos - x2 sin, x2 cos + x1 sin.
    """
    if cos.dim() == 3:  # per-row positions: (B, T, hd) -> (B, 1, T, hd)
        cos, sin = cos[:, None], sin[:, None]
    x32 = x.float()
    if split:
        partners = x32.roll(x.shape[-1] // 2, -1)
    else:  # odd, even for each pair; a stack of the two strided halves is faster than a flip
        partners = torch.stack((x32[..., 1::2], x32[..., 0::2]), -1).flatten(-2)
    return (x32 * cos + partners * sin).to(x.dtype)


def attention_mask(
    queries: int, keys: int, key_valid: torch.Tensor | None, device: torch.device
) -> torch.Tensor | None:
    """Boolean mask (B or 1, 1, T, S) for T new queries over S keys, or None when nothing is hidden.

    The causal part is aligned to the bottom right: the new queries are the last T of S positions,
    so query i sees keys 0 .. S - T + i. Every query also sees its own key, which keeps rows made of
    left padding finite (their outputs are never attended to by real tokens).
    """
    if queries == 1 and key_valid is None:
        return None
    query_pos = torch.arange(keys - queries, keys, device=device)[:, None]
    key_pos = torch.arange(keys, device=device)[None, :]
    mask = (key_pos <= query_pos)[None, None]
    if key_valid is not None:
        mask = (mask & key_valid[:, None, None, :]) | (key_pos == query_pos)
    return mask


class Attention(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        hd, heads, kv = config.dim_per_head, config.n_heads, config.n_kv_heads
        self.qkv = Linear(config.d_model, (heads * hd, kv * hd, kv * hd), config)
        self.o_proj = Linear(heads * hd, config.d_model, config)
        self.q_norm = RMSNorm(hd, config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(hd, config.norm_eps) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor | None,
        cache: KVCache | None,
        layer: int,
    ) -> torch.Tensor:
        """x (B, T, d_model) -> (B, T, d_model); keys/values go through the cache when one is given."""
        cfg = self.config
        batch, length, _ = x.shape
        q, k, v = self.qkv(x).split(self.qkv.parts, -1)
        q = q.view(batch, length, cfg.n_heads, cfg.dim_per_head)
        k = k.view(batch, length, cfg.n_kv_heads, cfg.dim_per_head)
        v = v.view(batch, length, cfg.n_kv_heads, cfg.dim_per_head)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, hd)
        if rope is not None:
            q = apply_rope(q, *rope, split=cfg.rope_split)
            k = apply_rope(k, *rope, split=cfg.rope_split)
        if cache is not None:
            k, v = cache.write(layer, k, v)
        causal = mask is None and length > 1  # with a cache, only a first prefill comes without a mask
        dropout = cfg.dropout if self.training else 0.0
        grouped = cfg.n_kv_heads != cfg.n_heads
        scale = cfg.dim_per_head**-0.5
        if cfg.attention == "manual":
            out = manual_attention(q, k, v, mask, causal)
        elif cfg.kernels == "fast" and grouped and length == 1 and mask is None:
            # One new token sees every cached key, so each group's query heads can stand in for its
            # query length: SDPA then reads each K/V head once, not once per query head (about 5%
            # of a decode step at a 2048-token context on the CPU). It rounds unlike enable_gqa.
            folded = q.reshape(batch, cfg.n_kv_heads, -1, cfg.dim_per_head)
            out = F.scaled_dot_product_attention(folded, k, v, dropout_p=dropout, scale=scale).view_as(q)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=scale, enable_gqa=grouped
            )
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


def manual_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool
) -> torch.Tensor:
    """Reference attention, q (B, H, T, hd) over k/v (B, KV, S, hd) with H = G * KV.

    The G query heads that share a K/V head are folded into the query length, (B, KV, G * T, hd),
    so one matmul per K/V head serves the whole group: no copy of the keys or values is made.
    Softmax runs in float32.
    """
    batch, heads, length, hd = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    folded = q.reshape(batch, kv_heads, groups * length, hd).float()
    scores = (folded @ k.float().transpose(-1, -2) * hd**-0.5).view(batch, kv_heads, groups, length, keys)
    if causal:
        mask = attention_mask(length, keys, None, q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    weights = scores.softmax(-1).view(batch, kv_heads, groups * length, keys)
    out = weights @ v.float()  # (B, KV, G * T, hd)
    return out.view(batch, heads, length, hd).to(q.dtype)


class FeedForward(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.swiglu = config.feed_forward == "swiglu"
        if self.swiglu:
            self.gate_up = Linear(config.d_model, (config.ff_dim, config.ff_dim), config)
        else:
            self.up_proj = Linear(config.d_model, config.ff_dim, config)
        self.down_proj = Linear(config.ff_dim, config.d_model, config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            gate, up = self.gate_up(x).chunk(2, -1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.gelu(self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.attn_norm = make_norm(config, config.d_model)
        self.attn = Attention(config)
        self.ff_norm = make_norm(config, config.d_model)
        self.ff = FeedForward(config)
        self.dropout = config.dropout

    def forward(self, h: torch.Tensor, rope, mask, cache, layer: int) -> torch.Tensor:
        """h is the float32 residual stream; each branch's output is added to it in float32."""
        # F.dropout, not an nn.Dropout module: a decode step would pay a module call per branch.
        attended = self.attn(self.attn_norm(h), rope, mask, cache, layer)
        h = h + F.dropout(attended, self.dropout, self.training).float()
        return h + F.dropout(self.ff(self.ff_norm(h)), self.dropout, self.training).float()


class Decoder(nn.Module):
    """Token ids (B, T) -> logits (B, T, vocab), optionally on top of a KVCache."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config.validate()
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_embed = (
            nn.Embedding(config.context_length, config.d_model) if config.position == "learned" else None
        )
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.final_norm = make_norm(config, config.d_model)
        self.lm_head = None if config.tie_embeddings else Linear(config.d_model, config.vocab_size, config)
        if not any(p.is_meta for p in self.parameters()):
            self.reset_parameters()

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def reset_parameters(self) -> None:
        """GPT-2 style init: N(0, 0.02), residual output projections scaled by 1/sqrt(2 * n_layers)."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, param in self.named_parameters():
            if param.dim() == 1:
                nn.init.ones_(param) if name.endswith("weight") else nn.init.zeros_(param)
            else:
                std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                nn.init.normal_(param, mean=0.0, std=std)

    def new_cache(self, batch_size: int = 1, max_len: int | None = None) -> KVCache:
        """An empty cache in the model's dtype and device (max_len defaults to the context length)."""
        length = self.config.context_length if max_len is None else max_len
        return KVCache(self.config, batch_size, length, dtype=self.dtype, device=self.device)

    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache | None = None,
        valid: torch.Tensor | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Logits (B, T, vocab) in float32, or (B, 1, vocab) with last_only.

        Without a cache this is a training pass (causal attention over the T tokens). With one, the
        tokens continue what the cache holds: their positions start at its length and they attend
        to every cached key. `valid` (B, T) marks real tokens where rows carry left padding.
        """
        batch, length = tokens.shape
        if cache is None:
            if length > self.config.context_length:
                raise ValueError(f"{length} tokens exceed the context length of {self.config.context_length}")
            positions = _positions_without_cache(valid, length, tokens.device)
            mask = attention_mask(length, length, valid, tokens.device) if valid is not None else None
        else:
            cache.check_room(length)
            positions = cache.positions(valid, length)
            key_valid = cache.key_mask(valid, length)
            # A first prefill with no padding is plain causal attention: no mask lets SDPA skip the
            # hidden half instead of computing it and masking it out (1.3x faster at 2048 tokens).
            fresh = cache.length == 0 and key_valid is None
            mask = None if fresh else attention_mask(length, cache.length + length, key_valid, tokens.device)
        h = self.embed(tokens).float()
        if self.pos_embed is not None:
            h = h + self.pos_embed(positions).float()
        h = self.dropout(h)
        rope = None
        if self.config.position == "rope":
            config = self.config
            rope = rope_angles(positions, config.dim_per_head, config.rope_base, config.rope_split)
        for layer, block in enumerate(self.blocks):
            h = block(h, rope, mask, cache, layer)
        if cache is not None:
            cache.advance(length, valid)
        if last_only:
            h = h[:, -1:]
        h = self.final_norm(h)
        head = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return linear(h, head, self.config.kernels).float()


def _positions_without_cache(valid: torch.Tensor | None, length: int, device: torch.device) -> torch.Tensor:
    if valid is None:
        return torch.arange(length, device=device)
    return (valid.long().cumsum(1) - 1).clamp(min=0)
