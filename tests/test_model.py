"""The Decoder's silent traps: RoPE, grouped-query attention, cache positions and masks, fp16 safety."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from octlm.cache import KVCache
from octlm.config import DecoderConfig
from octlm.model import Decoder, apply_rope, attention_mask, linear, rope_angles


def tiny(**overrides) -> DecoderConfig:
    values = dict(vocab_size=101, context_length=64, d_model=64, n_heads=4, kv_heads=2, n_layers=2)
    values.update(overrides)
    return DecoderConfig(**values)


def tiny_model(seed: int = 0, **overrides) -> Decoder:
    torch.manual_seed(seed)
    return Decoder(tiny(**overrides)).eval()


def tokens(batch: int, length: int, seed: int = 1, vocab: int = 101) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


class OpOutputs(TorchDispatchMode):
    """Records the op name and element count of every tensor produced inside the block."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor):
                self.seen.append((str(func), t.numel()))
        return out


# 1. RoPE layout -------------------------------------------------------------------------------


def complex_rope_reference(
    x: torch.Tensor, position: int, split: bool, base: float = 10000.0
) -> torch.Tensor:
    """RoPE as complex multiplication in float64: pairs are (2i, 2i+1) or (i, i + hd/2)."""
    hd = x.shape[-1]
    freqs = base ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    rotation = torch.polar(torch.ones_like(freqs), position * freqs)
    x = x.double()
    if split:
        pairs = torch.complex(x[..., : hd // 2], x[..., hd // 2 :]) * rotation
        return torch.cat((pairs.real, pairs.imag), -1)
    pairs = torch.complex(x[..., 0::2], x[..., 1::2]) * rotation
    return torch.stack((pairs.real, pairs.imag), -1).flatten(-2)


@pytest.mark.parametrize("split", [False, True])
def test_rope_pairs_dimensions_as_its_layout_says(split):
    x = torch.randn(1, 1, 1, 16)
    cos, sin = rope_angles(torch.tensor([7]), 16, 10000.0, split)
    want = complex_rope_reference(x, 7, split)
    torch.testing.assert_close(apply_rope(x, cos, sin, split).double(), want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("split", [False, True])
def test_rope_score_depends_only_on_distance(split):
    q, k = torch.randn(1, 1, 1, 32), torch.randn(1, 1, 1, 32)

    def score(m: int, n: int) -> torch.Tensor:
        cos_m, sin_m = rope_angles(torch.tensor([m]), 32, 10000.0, split)
        cos_n, sin_n = rope_angles(torch.tensor([n]), 32, 10000.0, split)
        return (apply_rope(q, cos_m, sin_m, split) * apply_rope(k, cos_n, sin_n, split)).sum()

    torch.testing.assert_close(score(5, 2), score(105, 102), atol=1e-4, rtol=0)
    assert not torch.allclose(score(5, 2), score(5, 4), atol=1e-3)


def test_rope_layouts_are_different_functions():
    adjacent = tiny_model(rope_split=False)
    split = tiny_model(rope_split=True)
    split.load_state_dict(adjacent.state_dict())
    x = tokens(1, 12)
    assert not torch.allclose(adjacent(x), split(x), atol=1e-3)


# 2. RoPE precision ----------------------------------------------------------------------------


def test_rope_angles_are_float32_for_half_models():
    model = tiny_model(context_length=40_000).to(torch.bfloat16)
    assert list(model.buffers()) == []  # nothing for .to() to cast
    cos, sin = rope_angles(torch.tensor([30_000]), 64, 10000.0, True)
    assert cos.dtype == sin.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rope_far_positions_in_half_precision_match_float64(dtype):
    x = torch.randn(1, 2, 4, 64).to(dtype)
    positions = torch.arange(30_000, 30_004)
    cos, sin = rope_angles(positions, 64, 10000.0, True)
    got = apply_rope(x, cos, sin, split=True).double()
    want = torch.cat(
        [complex_rope_reference(x[:, :, i], int(p), split=True)[:, :, None] for i, p in enumerate(positions)],
        2,
    )
    # One rounding to the half dtype at the end: an angle taken in bf16 would be off by radians.
    eps = torch.finfo(dtype).eps
    assert (got - want).abs().max() <= 2 * eps * want.abs().max()


# 3. Grouped-query attention -------------------------------------------------------------------


def test_grouped_query_attention_equals_multi_head_with_repeated_kv():
    gqa = tiny_model(kv_heads=2, n_heads=4)
    mha = tiny_model(kv_heads=4, n_heads=4)
    state = gqa.state_dict()
    hd = gqa.config.dim_per_head
    for name in list(state):
        if name.endswith("qkv.weight"):
            q, *kv = state[name].split([4 * hd, 2 * hd, 2 * hd])
            # (kv_heads, hd, d_model) -> head h uses kv head h // 2
            repeated = [part.view(2, hd, -1).repeat_interleave(2, dim=0).reshape(4 * hd, -1) for part in kv]
            state[name] = torch.cat([q, *repeated])
    mha.load_state_dict(state)
    x = tokens(2, 10)
    torch.testing.assert_close(gqa(x), mha(x), atol=1e-5, rtol=0)
    cache_gqa, cache_mha = gqa.new_cache(2, 16), mha.new_cache(2, 16)
    gqa(x, cache=cache_gqa)
    mha(x, cache=cache_mha)
    step = tokens(2, 1, seed=5)
    torch.testing.assert_close(gqa(step, cache=cache_gqa), mha(step, cache=cache_mha), atol=1e-5, rtol=0)


@pytest.mark.parametrize("attention", ["sdpa", "manual"])
def test_grouped_query_attention_makes_no_copy_of_repeated_keys(attention):
    model = tiny_model(attention=attention, n_heads=8, kv_heads=2, d_model=128)
    batch, cached, hd = 1, 40, model.config.dim_per_head
    cache = model.new_cache(batch, 48)
    model(tokens(batch, cached), cache=cache)
    with OpOutputs() as ops:
        model(tokens(batch, 3, seed=2), cache=cache)
    sizes = {numel for _, numel in ops.seen}
    keys = cached + 3
    assert batch * 2 * keys * hd in sizes or attention == "sdpa"  # the detector does see K-sized tensors
    assert batch * 8 * keys * hd not in sizes, "keys or values were copied once per query head"


# 4. KV cache size -----------------------------------------------------------------------------


def test_cache_stores_kv_heads_only_qwen3_bytes_per_token():
    qwen3 = DecoderConfig(
        vocab_size=151936, context_length=40960, d_model=1024, n_heads=16, n_layers=28, kv_heads=8,
        head_dim=128, ff_hidden=3072, rope_base=1e6, rope_split=True, qk_norm=True, norm_eps=1e-6,
    )  # fmt: skip
    cache = KVCache(qwen3, batch_size=1, max_len=256, dtype=torch.bfloat16, device="meta")
    assert cache.bytes_per_token == 114_688 == qwen3.kv_bytes_per_token(2)


def test_cache_measured_bytes_follow_kv_heads():
    model = tiny_model(n_heads=4, kv_heads=1)
    cache = model.new_cache(3, 32)
    assert cache.nbytes == 3 * 32 * 2 * 2 * 1 * 16 * 4  # batch * len * (k, v) * layers * kv_heads * hd * fp32


# 5, 6, 7. Cache positions, bottom-right mask, cached == uncached ------------------------------


def test_new_token_position_is_the_cache_length():
    model = tiny_model()
    x = tokens(1, 9)
    full = model(x)
    cache = model.new_cache(1, 16)
    model(x[:, :8], cache=cache)
    assert cache.length == 8
    torch.testing.assert_close(model(x[:, 8:], cache=cache), full[:, 8:], atol=1e-5, rtol=0)


def test_bottom_right_mask_four_cached_three_new():
    mask = attention_mask(3, 7, None, torch.device("cpu"))[0, 0]
    assert mask.tolist() == [
        [True, True, True, True, True, False, False],
        [True, True, True, True, True, True, False],
        [True, True, True, True, True, True, True],
    ]


@pytest.mark.parametrize("attention", ["sdpa", "manual"])
@pytest.mark.parametrize("chunks", [(4, 3), (1, 1, 5), (2, 2, 2, 1)])
def test_chunked_prefill_equals_one_pass(attention, chunks):
    model = tiny_model(attention=attention)
    x = tokens(2, sum(chunks))
    full = model(x)
    cache, start, pieces = model.new_cache(2, 16), 0, []
    for size in chunks:
        pieces.append(model(x[:, start : start + size], cache=cache))
        start += size
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-5, rtol=0)


def greedy(model: Decoder, prompt: torch.Tensor, steps: int, use_cache: bool) -> tuple[list[int], list]:
    ids, all_logits = prompt.clone(), []
    cache = model.new_cache(1, prompt.shape[1] + steps) if use_cache else None
    step_input = ids
    for _ in range(steps):
        logits = model(step_input, cache=cache)[:, -1] if use_cache else model(ids)[:, -1]
        all_logits.append(logits)
        nxt = logits.argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], 1)
        step_input = nxt
    return ids[0, prompt.shape[1] :].tolist(), all_logits


def test_cached_generation_equals_recomputation():
    model = tiny_model(context_length=64)
    cached_ids, cached_logits = greedy(model, tokens(1, 5), 30, use_cache=True)
    full_ids, full_logits = greedy(model, tokens(1, 5), 30, use_cache=False)
    assert cached_ids == full_ids
    torch.testing.assert_close(torch.stack(cached_logits), torch.stack(full_logits), atol=1e-5, rtol=0)


def test_left_padded_rows_equal_their_unpadded_selves():
    model = tiny_model()
    short, long = tokens(1, 4, seed=3), tokens(1, 7, seed=4)
    batch = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1), long])
    valid = batch != -1
    valid[0, :3] = False
    cache = model.new_cache(2, 12)
    batched = model(batch, cache=cache, valid=valid)
    step = tokens(2, 1, seed=6)
    next_batched = model(step, cache=cache)
    for row, alone in enumerate([short, long]):
        single_cache = model.new_cache(1, 12)
        logits = model(alone, cache=single_cache)
        torch.testing.assert_close(batched[row, -1], logits[0, -1], atol=1e-5, rtol=0)
        torch.testing.assert_close(
            next_batched[row], model(step[row : row + 1], cache=single_cache)[0], atol=1e-5, rtol=0
        )


def test_truncate_rolls_back_to_an_earlier_state():
    model = tiny_model()
    x, other = tokens(1, 10), tokens(1, 4, seed=9)
    cache = model.new_cache(1, 16)
    model(x[:, :6], cache=cache)
    model(other, cache=cache)
    cache.truncate(6)
    torch.testing.assert_close(model(x[:, 6:], cache=cache), model(x)[:, 6:], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(11)


def test_cache_overflow_is_a_clear_error():
    model = tiny_model()
    cache = model.new_cache(1, 8)
    model(tokens(1, 6), cache=cache)
    with pytest.raises(ValueError, match="6 of 8 positions; 3 more do not fit"):
        model(tokens(1, 3), cache=cache)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        model.new_cache(1, 65)


# 8. No square mask at the full context --------------------------------------------------------


def test_no_mask_buffer_at_full_context():
    context = 40_960
    with torch.device("meta"):
        qwen_shaped = Decoder(tiny(context_length=context, qk_norm=True, rope_split=True))
    assert list(qwen_shaped.buffers()) == []
    model = tiny_model(context_length=2048)
    with OpOutputs() as ops:
        model(tokens(1, 8))
        model(tokens(1, 8), cache=model.new_cache(1, 16))
    assert max(numel for _, numel in ops.seen) < 2048 * 2048


# 9. manual == sdpa ----------------------------------------------------------------------------


def test_manual_and_sdpa_attention_agree():
    sdpa = tiny_model(attention="sdpa")
    manual = tiny_model(attention="manual")
    manual.load_state_dict(sdpa.state_dict())
    x = tokens(2, 12)
    torch.testing.assert_close(manual(x), sdpa(x), atol=1e-5, rtol=0)
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[0, :5] = False
    caches = [model.new_cache(2, 16) for model in (manual, sdpa)]
    torch.testing.assert_close(
        manual(x, cache=caches[0], valid=valid), sdpa(x, cache=caches[1], valid=valid), atol=1e-5, rtol=0
    )


# fp16 numerics --------------------------------------------------------------------------------


def test_float16_stays_finite_and_close_to_float32_with_large_activations():
    """Activations near 300 overflow fp16 when squared (RMSNorm) or summed over layers (residual)."""
    model = tiny_model(n_layers=4)
    with torch.no_grad():
        model.embed.weight.normal_(0, 300.0)
        for block in model.blocks:
            block.ff.down_proj.weight.mul_(2000.0)
    x = tokens(1, 16)
    want = model(x)
    got = model.to(torch.float16)(x)
    assert torch.isfinite(got).all()
    assert (got - want).abs().max() <= 0.02 * want.abs().max(), "fp16 drifted from fp32"


def test_half_model_rotates_a_far_position_like_float32():
    """A bf16 model at position 30,000 must rotate queries by float32 angles: bf16 spaces 30,000 by 128."""
    reference = tiny_model(context_length=40_000, rope_split=True)
    half = tiny_model(context_length=40_000, rope_split=True).to(torch.bfloat16)
    length = 30_000
    caches = [reference.new_cache(1, length + 1), half.new_cache(1, length + 1)]
    filler = torch.Generator().manual_seed(0)
    keys, values = (
        torch.randn(caches[0].keys.shape, generator=filler),
        torch.randn(caches[0].values.shape, generator=filler),
    )
    for cache in caches:
        cache.keys.copy_(keys)
        cache.values.copy_(values)
        cache.length = length
    x = tokens(1, 1)
    want, got = reference(x, cache=caches[0]), half(x, cache=caches[1])
    assert (got - want).abs().max() <= 0.05 * want.abs().max()


def test_float16_residual_sum_may_exceed_the_float16_range():
    """Each feed-forward adds ~25,000 to one channel: four layers sum past fp16's 65,504."""
    model = tiny_model(n_layers=4)
    x = tokens(1, 8)
    for block in model.blocks:
        with torch.no_grad():
            gate, up = block.ff.gate_up.weight.chunk(2)
            gate.copy_(up)  # silu(z) * z >= -0.28: mostly positive
            block.ff.down_proj.weight.zero_()
            block.ff.down_proj.weight[0] = 1.0
        seen = []
        handle = block.ff.register_forward_hook(
            lambda mod, args, out, seen=seen: seen.append(out[..., 0].min())
        )
        model(x)
        handle.remove()
        with torch.no_grad():
            block.ff.down_proj.weight[0] *= 25_000 / seen[0]
    residual = []
    handle = model.final_norm.register_forward_hook(lambda mod, args, out: residual.append(args[0]))
    want = model(x)
    handle.remove()
    assert residual[0][..., 0].min() > 65_504  # the precondition this test is about
    got = model.to(torch.float16)(x)
    assert torch.isfinite(got).all()
    assert (got - want).abs().max() <= 0.02 * want.abs().max()


# Fast kernels ----------------------------------------------------------------------------------


def test_fast_kernels_send_only_few_float32_rows_at_inference_to_onednn():
    """oneDNN rounds differently from torch's default kernel: the route shows in the bits."""
    weight = torch.randn(96, 64)
    onednn = lambda x: torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")  # noqa: E731
    few, many = torch.randn(1, 3, 64), torch.randn(4, 16, 64)
    with torch.no_grad():
        assert torch.equal(linear(few, weight, "fast"), onednn(few))
        assert not torch.equal(onednn(few), F.linear(few, weight))  # else this test could not fail
        assert torch.equal(linear(few, weight, "reference"), F.linear(few, weight))
        assert torch.equal(linear(many, weight, "fast"), F.linear(many, weight))
    assert torch.equal(linear(few, weight, "fast"), F.linear(few, weight))  # autograd: the default kernel


def test_model_follows_its_config_kernels_at_every_call():
    """Every product of a decode step (4 per layer and the head) takes the route config.kernels names."""
    model, x = tiny_model(), tokens(1, 4)

    def onednn_products() -> int:
        with torch.no_grad(), OpOutputs() as ops:
            model(x[:, :1], cache=model.new_cache(1, 4))
        return sum("_linear_pointwise" in name for name, _ in ops.seen)

    assert onednn_products() == 4 * model.config.n_layers + 1
    model.config.kernels = "reference"
    assert onednn_products() == 0


def test_fast_kernels_fold_a_single_new_token_into_each_kv_group(monkeypatch):
    """kernels=fast gives SDPA a new token's query heads as each K/V head's query length (one read of
    each K/V head); the logits equal enable_gqa's up to rounding."""
    model, x = tiny_model(), tokens(1, 6)
    real_sdpa, shapes, seen, logits = F.scaled_dot_product_attention, [], {}, {}

    def spy(q, *args, **kwargs):
        shapes.append(tuple(q.shape))
        return real_sdpa(q, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    for kernels in ("fast", "reference"):
        model.config.kernels = kernels
        cache = model.new_cache(1, 8)
        with torch.no_grad():
            model(x[:, :5], cache=cache)
            shapes.clear()
            logits[kernels] = model(x[:, 5:], cache=cache)
        seen[kernels] = set(shapes)
    hd = model.config.dim_per_head
    assert seen == {"fast": {(1, 2, 2, hd)}, "reference": {(1, 4, 1, hd)}}
    torch.testing.assert_close(logits["fast"], logits["reference"], atol=1e-5, rtol=0)
