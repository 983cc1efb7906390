"""moeplex's C++ paged decode attention (kernels/csrc/paged_decode.cpp) reads each request's KV in place and
equals the fp64 softmax reference and the torch path it competes with: scattered pages, ragged lengths, GQA,
MHA and MLA's latent (values the keys' leading columns), fp32 KV and bf16 KV; the model decodes the same with it.
Its tile-unit form (Intel AMX, bf16) equals the same reference where the processor has AMX."""

import pytest
import torch

from moeplex.attention.in_place import decode_in_place, in_place_takes, tiles_take
from moeplex.attention.torch_ref import PagedGather, decode_per_request
from moeplex.kernels import cpu_ext
from moeplex.kv_cache import KVPool
from test_torch_attention import decode_batch, reference_decode

pytestmark = pytest.mark.skipif(
    cpu_ext.why_not("paged_decode") is not None, reason=f"the C++ kernel does not build here: {cpu_ext.why_not('paged_decode')}"
)

PAGE = 4
CASES = {
    # name: (q heads, kv heads, key dim, value dim, values are the keys' leading columns)
    "gqa-4": (8, 2, 64, 64, False),
    "mha": (3, 3, 32, 32, False),
    "mla-latent": (8, 1, 80, 64, True),
    "gqa-ragged-width": (4, 1, 56, 20, False),  # widths not whole 16-lane vectors: the tails in scalar code
}


def filled_pool(shapes, dtype, pages=200, seed=0, page=PAGE):
    kv = KVPool(pages, page, shapes, dtype, "cpu")
    gen = torch.Generator().manual_seed(seed)
    for buffer in kv.layer(0):
        buffer.copy_(torch.randn(buffer.shape, generator=gen))
    return kv, gen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_in_place_decode_matches_reference(case, dtype):
    q_heads, kv_heads, dk, dv, shared = CASES[case]
    kv, gen = filled_pool([[(kv_heads, dk)]] if shared else [[(kv_heads, dk), (kv_heads, dv)]], dtype)
    keys = kv.layer(0)[0]
    values = keys[..., :dv] if shared else kv.layer(0)[1]
    lengths = [1, 2, 31, 32, 33, 97, 5, 64, 150]  # across the kernel's 32-token softmax blocks
    batch = decode_batch(kv, lengths)
    q = torch.randn(len(lengths), q_heads, dk, generator=gen).to(dtype)
    assert in_place_takes(q, keys, values)
    ours = decode_in_place(q, keys, values, batch, 0.3)
    assert ours.dtype == dtype and ours.shape == (len(lengths), q_heads, dv)
    reference = reference_decode(q, keys, values, batch, 0.3)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding (the sums stay fp32)
    assert (ours.double() - reference).abs().max() <= tol * reference.abs().max()
    torch.testing.assert_close(ours, decode_per_request(q, keys, values, batch, 0.3), rtol=2 * tol, atol=2 * tol)


TILE_CASES = {
    # name: (q heads, kv heads, key dim, value dim, values are the keys' leading columns)
    "mla-576": (8, 1, 576, 512, True),  # DeepSeek-V3's latent (512) and rope (64) columns
    "gqa-4": (8, 2, 64, 64, False),
    "group-16": (16, 1, 32, 32, False),  # a full tile of query heads
}


@pytest.mark.parametrize("page", [16, 4], ids=["pages-of-16", "pages-of-4"])  # rows read in place / copied first
@pytest.mark.parametrize("case", list(TILE_CASES))
def test_tiles_decode_matches_reference(case, page):
    q_heads, kv_heads, dk, dv, shared = TILE_CASES[case]
    shapes = [[(kv_heads, dk)]] if shared else [[(kv_heads, dk), (kv_heads, dv)]]
    kv, gen = filled_pool(shapes, torch.bfloat16, pages=800 // page, page=page)
    keys = kv.layer(0)[0]
    values = keys[..., :dv] if shared else kv.layer(0)[1]
    keys.mul_(torch.linspace(0.2, 3, keys.shape[0])[:, None, None].to(keys.dtype))  # later blocks' max jumps
    lengths = [1, 15, 16, 17, 31, 32, 33, 97, 150, 64]  # within and across the 16-token tiles and 32-token blocks
    batch = decode_batch(kv, lengths)
    q = torch.randn(len(lengths), q_heads, dk, generator=gen).bfloat16()
    if not tiles_take(q, keys, values):
        pytest.skip("no AMX tile unit granted on this processor")
    assert "in_place_tiles" in PagedGather.ways(q, keys, values, batch)
    ours = decode_in_place(q, keys, values, batch, 0.3, tiles=True)
    reference = reference_decode(q, keys, values, batch, 0.3)
    assert torch.isfinite(ours).all()
    assert (ours.double() - reference).abs().max() <= 1e-2 * reference.abs().max()
    torch.testing.assert_close(ours, decode_in_place(q, keys, values, batch, 0.3), rtol=2e-2, atol=2e-2)


def test_tiles_are_offered_only_for_bf16_whole_chunks():
    kv, gen = filled_pool([[(1, 40), (1, 40)]], torch.bfloat16)
    keys, values = kv.layer(0)
    q = torch.randn(2, 4, 40, generator=gen).bfloat16()
    assert not tiles_take(q, keys, values)  # 40 columns: not whole 32-column chunks
    kv, gen = filled_pool([[(1, 64), (1, 64)]], torch.float32)
    assert not tiles_take(torch.randn(2, 4, 64), *kv.layer(0))  # fp32: the vector kernel's


def test_in_place_decode_of_large_scores_stays_finite():
    """Scores far apart (the online softmax's rescaling, a block whose max jumps) give the reference's answer."""
    kv, gen = filled_pool([[(1, 16), (1, 16)]], torch.float32)
    keys, values = kv.layer(0)
    batch = decode_batch(kv, [70, 3])
    keys.mul_(torch.linspace(1, 40, keys.shape[0])[:, None, None])  # later rows score ever higher
    q = torch.randn(2, 2, 16, generator=gen) * 5
    ours = decode_in_place(q, keys, values, batch, 1.0)
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours.double(), reference_decode(q, keys, values, batch, 1.0), rtol=1e-4, atol=1e-4)


def test_caches_the_kernel_does_not_take_are_not_offered():
    kv, _ = filled_pool([[(2, 16), (2, 16)]], torch.float16)
    keys, values = kv.layer(0)
    batch = decode_batch(kv, [9, 4])
    q = torch.randn(2, 4, 16).half()
    assert not in_place_takes(q, keys, values)  # fp16 KV: not one of the kernel's dtypes
    assert "in_place" not in PagedGather.ways(q, keys, values, batch)
    assert PagedGather().way(q, keys, values, batch) == "slots"


class InPlace(PagedGather):
    """A gather choice that always reads in place (where the kernel takes the shapes)."""

    def way(self, q, key_cache, value_cache, batch):
        return "in_place" if in_place_takes(q, key_cache, value_cache) else "slots"


def test_models_decode_in_place_as_with_the_padded_path(tiny_model_dir, arch):
    from moeplex.attention import TorchAttention
    from moeplex.config import EngineConfig
    from moeplex.models.setup import load_model
    from moeplex.selection import resolve
    from test_torch_attention import PaddedDecode, run_steps

    config = EngineConfig(model=tiny_model_dir(arch), dtype="fp32", show_progress=False)
    model = load_model(config.model, config, resolve(config))
    prompts = [[256, 7, 9, 11, 13, 2], [256, 40, 41], [256] + list(range(60, 73))]
    reference, reference_tokens = run_steps(model, PaddedDecode(), prompts, decode_steps=4)
    backend = TorchAttention()
    backend.gather = InPlace()
    taken = []
    real_way = backend.gather.way
    backend.gather.way = lambda *args: taken.append(real_way(*args)) or taken[-1]
    ours, tokens = run_steps(model, backend, prompts, decode_steps=4)
    if "in_place" not in taken:
        pytest.skip(f"{arch}'s KV cache is not one the kernel takes")
    for mine, theirs in zip(ours, reference):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    assert tokens == reference_tokens


def test_two_threads_compute_what_one_does():
    """Work split over requests (or (request, KV head) when requests are few): the same result either way."""
    kv, gen = filled_pool([[(2, 32), (2, 32)]], torch.float32)
    keys, values = kv.layer(0)
    for lengths in ([40, 7, 90], [13] * 12):  # fewer requests than 4 per thread, and enough
        batch = decode_batch(kv, lengths)
        q = torch.randn(len(lengths), 8, 32, generator=gen)
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one = decode_in_place(q, keys, values, batch, 0.2)
            torch.set_num_threads(2)
            two = decode_in_place(q, keys, values, batch, 0.2)
        finally:
            torch.set_num_threads(threads)
        torch.testing.assert_close(two, one, rtol=0, atol=0)
        torch.testing.assert_close(one.double(), reference_decode(q, keys, values, batch, 0.2), rtol=1e-5, atol=1e-5)
