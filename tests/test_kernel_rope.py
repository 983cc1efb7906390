"""The fused rope kernel equals the torch path: RMSNorm of each head (optional), then RotaryEmbedding.

Without CUDA the kernel runs under Triton's interpreter, so shapes are tiny and dtypes are fp32 and
fp16 (the interpreter computes bf16 wrongly); the `gpu` tests add bf16 at Qwen3's and DeepSeek's shapes.
"""

import pytest
import torch

from moeplex.kernels import rope as rope_kernel
from moeplex.kernels.rope import KVWrite, rope_
from moeplex.models.base import RMSNorm
from moeplex.models.rope import RotaryEmbedding
from triton_guard import DEVICE, skip_unless_runnable

skip_unless_runnable(rope_kernel._rope_kernel)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DEFAULT = {"rope_type": "default", "rope_theta": 10000.0}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
                 "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
EPS = 1e-6


def random_norms(head_dim, dtype, gen):
    """q_norm and k_norm as the model holds them, with weights away from 1 so that they matter."""
    norms = []
    for _ in range(2):
        norm = RMSNorm(head_dim, EPS).to(DEVICE, dtype)
        norm.weight.data = (1 + 0.3 * torch.randn(head_dim, generator=gen)).to(DEVICE, dtype)
        norms.append(norm)
    return norms


def positions_up_to(limit, num_tokens, gen, dtype=torch.int64):
    """Unsorted positions with repeats, the largest ones far from 0 where float error in the angle grows."""
    return torch.randint(0, limit, (num_tokens,), generator=gen).to(DEVICE, dtype)


def reference(q, k, positions, rotary, norms=None):
    if norms is not None:
        q, k = norms[0](q), norms[1](k)
    return rotary(positions, q, k)


def rotate(q, k, positions, rotary, norms=None):
    """rope_ with the model's own inv_freq, scale and norm weights."""
    q_norm, k_norm = (norms[0].weight, norms[1].weight) if norms is not None else (None, None)
    rope_(q, k, positions, rotary.inv_freq.to(DEVICE), rotary.scale, rotary.interleaved, q_norm, k_norm, EPS)


def check_rotation(q_heads, k_heads, head_dim, dtype, params, interleaved, norm, num_tokens=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rotary = RotaryEmbedding(head_dim, params, interleaved=interleaved)
    norms = random_norms(head_dim, dtype, gen) if norm else None
    q = torch.randn(num_tokens, q_heads, head_dim, generator=gen).to(DEVICE, dtype)
    k = torch.randn(num_tokens, k_heads, head_dim, generator=gen).to(DEVICE, dtype)
    positions = positions_up_to(40000, num_tokens, gen)
    want_q, want_k = reference(q, k, positions, rotary, norms)
    rotate(q, k, positions, rotary, norms)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(q, want_q, rtol=tol, atol=tol)
    torch.testing.assert_close(k, want_k, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("params", [DEFAULT, YARN], ids=["default", "yarn"])
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "qk_norm"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half_split", "interleaved"])
def test_matches_norm_then_rotary_embedding(interleaved, norm, params, dtype):
    check_rotation(3, 2, 16, dtype, params, interleaved, norm)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half_split", "interleaved"])
def test_head_dim_that_is_not_a_power_of_two(interleaved):
    check_rotation(2, 1, 12, torch.float32, YARN, interleaved, norm=True)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half_split", "interleaved"])
def test_head_blocks_that_mix_query_and_key_heads(interleaved, monkeypatch):
    # 2 heads a program over 3 query and 2 key heads: blocks [q0 q1], [q2 k0], [k1 -]
    monkeypatch.setattr(rope_kernel, "ELEMENTS_PER_PROGRAM", 16)
    check_rotation(3, 2, 8, torch.float16, YARN, interleaved, norm=True)


def test_int32_positions_rotate_as_int64():
    gen = torch.Generator().manual_seed(1)
    rotary = RotaryEmbedding(8, YARN)
    q = torch.randn(4, 2, 8, generator=gen).to(DEVICE)
    k = torch.randn(4, 1, 8, generator=gen).to(DEVICE)
    positions = positions_up_to(40000, 4, gen)
    want_q, want_k = reference(q, k, positions, rotary)
    rotate(q, k, positions.to(torch.int32), rotary)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, want_k, rtol=1e-5, atol=1e-5)


def check_mla_views(num_tokens, heads, nope, rope, latent, dtype, params, seed=0):
    """DeepSeek's layout: q_rope is the tail of each [nope + rope] query head, and the one rope key head
    the tail of each token's [latent + rope] row; nothing else in either buffer may change."""
    gen = torch.Generator().manual_seed(seed)
    rotary = RotaryEmbedding(rope, params, interleaved=True)
    q_buffer = torch.randn(num_tokens, heads, nope + rope, generator=gen).to(DEVICE, dtype)
    kv_buffer = torch.randn(num_tokens, latent + rope, generator=gen).to(DEVICE, dtype)
    q_before, kv_before = q_buffer.clone(), kv_buffer.clone()
    q_rope = q_buffer.split([nope, rope], dim=-1)[1]
    k_rope = kv_buffer[:, None, latent:]
    positions = positions_up_to(40000, num_tokens, gen)
    want_q, want_k = reference(q_rope.clone(), k_rope.clone(), positions, rotary)
    rotate(q_rope, k_rope, positions, rotary)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(q_rope, want_q, rtol=tol, atol=tol)
    torch.testing.assert_close(k_rope, want_k, rtol=tol, atol=tol)
    assert torch.equal(q_buffer[..., :nope], q_before[..., :nope])
    assert torch.equal(kv_buffer[:, :latent], kv_before[:, :latent])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_non_contiguous_views_of_wider_buffers(dtype):
    check_mla_views(num_tokens=4, heads=3, nope=16, rope=8, latent=24, dtype=dtype, params=YARN)


def test_no_tokens_is_a_no_op():
    rotary = RotaryEmbedding(8, DEFAULT)
    q, k = torch.empty(0, 2, 8, device=DEVICE), torch.empty(0, 1, 8, device=DEVICE)
    rotate(q, k, torch.empty(0, dtype=torch.int64, device=DEVICE), rotary)


def test_one_norm_without_the_other_is_refused():
    q, k = torch.zeros(1, 2, 8, device=DEVICE), torch.zeros(1, 1, 8, device=DEVICE)
    inv_freq = RotaryEmbedding(8, DEFAULT).inv_freq.to(DEVICE)
    with pytest.raises(ValueError, match="together"):
        rope_(q, k, torch.zeros(1, dtype=torch.int64, device=DEVICE), inv_freq, 1.0,
              q_norm=torch.ones(8, device=DEVICE))


def check_kv_write(q_heads, k_heads, head_dim, dtype, norm, interleaved=False, num_tokens=5, slots=40,
                   cache_dtype=None, seed=0):
    """rope_ with a KVWrite: q rotated in place as before; the rotated keys and the values land in the cache
    rows of their slots (what `write_kv` stores after the unfused rope), every other row and k itself untouched."""
    gen = torch.Generator().manual_seed(seed)
    rotary = RotaryEmbedding(head_dim, YARN, interleaved=interleaved)
    norms = random_norms(head_dim, dtype, gen) if norm else None
    # q, k and v as the merged projection's column slices of one [T, (Hq + 2 Hk) D] output
    qkv = torch.randn(num_tokens, (q_heads + 2 * k_heads) * head_dim, generator=gen).to(DEVICE, dtype)
    q, k, v = (part.view(num_tokens, -1, head_dim) for part in
               qkv.split([q_heads * head_dim, k_heads * head_dim, k_heads * head_dim], dim=-1))
    cache_dtype = cache_dtype or dtype
    key_cache = torch.randn(slots, k_heads, head_dim, generator=gen).to(DEVICE, cache_dtype)
    value_cache = torch.randn(slots, k_heads, head_dim, generator=gen).to(DEVICE, cache_dtype)
    slot_ids = torch.randperm(slots, generator=gen)[:num_tokens].to(DEVICE)
    positions = positions_up_to(40000, num_tokens, gen)
    want_q, want_k = reference(q.clone(), k.clone(), positions, rotary, norms)
    want_keys, want_values = key_cache.clone(), value_cache.clone()
    want_keys[slot_ids], want_values[slot_ids] = want_k.to(cache_dtype), v.to(cache_dtype)
    k_before = k.clone()
    q_norm, k_norm = (norms[0].weight, norms[1].weight) if norm else (None, None)
    rope_(q, k, positions, rotary.inv_freq.to(DEVICE), rotary.scale, interleaved, q_norm, k_norm, EPS,
          kv_write=KVWrite(v, key_cache, value_cache, slot_ids))
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(q, want_q, rtol=tol, atol=tol)
    torch.testing.assert_close(key_cache, want_keys, rtol=tol, atol=tol)
    assert torch.equal(value_cache, want_values)
    assert torch.equal(k, k_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "qk_norm"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half_split", "interleaved"])
def test_kv_write_stores_the_rotated_keys_and_the_values(interleaved, norm, dtype):
    check_kv_write(4, 2, 16, dtype, norm, interleaved)


def test_kv_write_in_head_blocks_that_mix_queries_keys_and_values(monkeypatch):
    # 2 heads a program over 3 query, 2 key and 2 value heads: [q0 q1], [q2 k0], [k1 v0], [v1 -]
    monkeypatch.setattr(rope_kernel, "ELEMENTS_PER_PROGRAM", 16)
    check_kv_write(3, 2, 8, torch.float32, norm=True)


def test_kv_write_casts_to_the_cache_dtype():
    check_kv_write(2, 1, 16, torch.float32, norm=True, cache_dtype=torch.float16)


def test_kv_write_of_the_wrong_shape_is_refused():
    q, k = torch.zeros(2, 2, 8, device=DEVICE), torch.zeros(2, 1, 8, device=DEVICE)
    cache = torch.zeros(10, 2, 8, device=DEVICE)  # two heads where the keys have one
    write = KVWrite(torch.zeros_like(k), cache, cache, torch.zeros(2, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="KV write"):
        rope_(q, k, torch.zeros(2, dtype=torch.int64, device=DEVICE), RotaryEmbedding(8, DEFAULT).inv_freq.to(DEVICE),
              1.0, kv_write=write)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_qwen3_serving_shapes(dtype):
    check_rotation(32, 4, 128, dtype, {"rope_type": "default", "rope_theta": 1000000.0}, interleaved=False, norm=True,
                   num_tokens=300)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_deepseek_serving_shapes(dtype):
    check_mla_views(num_tokens=300, heads=16, nope=128, rope=64, latent=512, dtype=dtype, params=DEEPSEEK_YARN)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_qwen3_serving_shapes_with_kv_write(dtype):
    check_kv_write(32, 4, 128, dtype, norm=True, num_tokens=300, slots=4096)
