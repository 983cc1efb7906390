"""The `torch` backend's CPU decode (request by request, only each request's own slots) equals the
padded path it replaced and a fp64 reference: on scattered pages, for MHA, GQA and MLA's shared
latent, and in whole models (the same logits within fp32 rounding and the same greedy tokens)."""

import pytest
import torch

from moeplex.attention import TorchAttention
from moeplex.attention.torch_ref import PagedGather, decode_padded, decode_per_request, gather_kv, ragged_attention
from moeplex.batch_builder import ScheduledSeq, build_forward_batch
from moeplex.config import EngineConfig
from moeplex.forward_batch import ForwardMode
from moeplex.kv_cache import KVPool
from moeplex.models.setup import load_model
from moeplex.registry import lookup
from moeplex.selection import resolve

PAGE = 4


def reference_decode(q, key_cache, value_cache, batch, scale):
    """Softmax attention written out per request in fp64, the KV heads repeated for their query heads."""
    out = []
    indptr = batch.kv_indptr.tolist()
    for b in range(q.shape[0]):
        slots = batch.kv_indices[indptr[b] : indptr[b + 1]]
        group = q.shape[1] // key_cache.shape[1]
        k = key_cache[slots].double().repeat_interleave(group, dim=1)
        v = value_cache[slots].double().repeat_interleave(group, dim=1)
        weights = (torch.einsum("hd,nhd->hn", q[b].double(), k) * scale).softmax(-1)
        out.append(torch.einsum("hn,nhd->hd", weights, v))
    return torch.stack(out)


def decode_batch(kv: KVPool, lengths):
    """Decode over scattered pages: the free list reversed, so every request's pages run backwards."""
    everything = kv.allocate(kv.num_free_pages)
    kv.release(everything[::-1])
    seqs = [ScheduledSeq([1], n - 1, kv.allocate(kv.pages_for(n))) for n in lengths]
    return build_forward_batch(seqs, kv, "cpu")


CASES = {
    # name: (q heads, kv heads, key dim, value dim, values are the keys' leading columns)
    "mha": (3, 3, 16, 16, False),
    "gqa-4": (8, 2, 24, 24, False),
    "mla-latent": (5, 1, 40, 32, True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_per_request_decode_matches_reference_and_padded_path(case, dtype):
    q_heads, kv_heads, dk, dv, shared = CASES[case]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    shapes = [[(kv_heads, dk)]] if shared else [[(kv_heads, dk), (kv_heads, dv)]]
    kv = KVPool(40, PAGE, shapes, dtype, "cpu")
    gen = torch.Generator().manual_seed(0)
    for buffer in kv.layer(0):
        buffer.copy_(torch.randn(buffer.shape, generator=gen))
    keys = kv.layer(0)[0]
    values = keys[..., :dv] if shared else kv.layer(0)[1]
    batch = decode_batch(kv, [2, 9, 23, 4, 16])
    assert batch.mode == ForwardMode.DECODE
    q = torch.randn(5, q_heads, dk, generator=gen).to(dtype)
    ours = decode_per_request(q, keys, values, batch, 0.2)
    reference = reference_decode(q, keys, values, batch, 0.2)
    assert (ours.double() - reference).abs().max() <= tol * reference.abs().max()
    torch.testing.assert_close(ours, decode_padded(q, keys, values, batch, 0.2), rtol=tol, atol=tol)
    torch.testing.assert_close(TorchAttention().decode(q, keys, values, batch, 0.2), ours, rtol=0, atol=0)
    # whole pages gathered and cut to each request's length: the same rows, so the same result to the bit
    torch.testing.assert_close(decode_per_request(q, keys, values, batch, 0.2, by_pages=True), ours, rtol=0, atol=0)
    # the extend entry point given a decode batch (keys already gathered) takes the same path
    gathered = ragged_attention(q, gather_kv(keys, batch), gather_kv(values, batch), batch, 0.2)
    same = 1e-6 if dtype == torch.float32 else tol  # bf16: one rounding apart where the widths differ
    torch.testing.assert_close(gathered, ours, rtol=same, atol=same)


class PaddedDecode(TorchAttention):
    """The decode path before per-request decode: one padded block for all requests."""

    def decode(self, q, key_cache, value_cache, batch, scale):
        return decode_padded(q, key_cache, value_cache, batch, scale)


def run_steps(model, backend, prompts, decode_steps):
    """Prefill the prompts in one step, then decode greedily: every step's logits, and the tokens."""
    model.set_attention_backend(backend)
    overlap = lookup("overlap", "none")()
    kv = KVPool(32, PAGE, model.kv_shapes(), torch.float32, "cpu")
    pages = [kv.allocate(kv.pages_for(len(p) + decode_steps)) for p in prompts]
    seqs = [list(p) for p in prompts]
    batch = build_forward_batch([ScheduledSeq(s, 0, p) for s, p in zip(seqs, pages)], kv, "cpu")
    logits_per_step = []
    for _ in range(decode_steps + 1):
        with torch.inference_mode():
            logits = model(batch, kv, overlap)
        logits_per_step.append(logits)
        for seq, token in zip(seqs, logits.argmax(-1).tolist()):
            seq.append(token)
        batch = build_forward_batch([ScheduledSeq(s[-1:], len(s) - 1, p) for s, p in zip(seqs, pages)], kv, "cpu")
    return logits_per_step, seqs


def test_models_decode_as_with_the_padded_path(tiny_model_dir, arch):
    config = EngineConfig(model=tiny_model_dir(arch), dtype="fp32", show_progress=False)
    model = load_model(config.model, config, resolve(config))
    prompts = [[256, 7, 9, 11, 13, 2], [256, 40, 41], [256] + list(range(60, 73))]
    reference, reference_tokens = run_steps(model, PaddedDecode(), prompts, decode_steps=4)
    ours, tokens = run_steps(model, TorchAttention(), prompts, decode_steps=4)
    for mine, theirs in zip(ours, reference):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    assert tokens == reference_tokens


def test_paged_gather_is_measured_once_per_cache_shape_on_a_batch_big_enough(monkeypatch, tmp_path):
    """The first decode batch with MIN_ROWS cached rows times every way on its own requests and the fastest is
    kept for that cache shape (a clock that makes pages cheapest chooses pages); a smaller batch before it
    gathers by slots and decides nothing."""
    kv = KVPool(600, PAGE, [[(2, 16), (2, 16)]], torch.float32, "cpu")
    keys, values = kv.layer(0)
    from moeplex.kernels.cpu import MeasuredChoices

    store = MeasuredChoices(str(tmp_path / "c.json"))
    monkeypatch.setattr("moeplex.kernels.cpu.measured_choice", store.get)
    monkeypatch.setattr("moeplex.kernels.cpu.stored_choice", store.stored)
    gather = PagedGather()  # nothing measured yet on this 'machine'
    q = torch.randn(4, 4, 16)

    small = decode_batch(kv, [5, 9])
    assert gather.way(q[:2], keys, values, small) == "slots" and not gather.choices
    kv = KVPool(600, PAGE, [[(2, 16), (2, 16)]], torch.float32, "cpu")
    keys, values = kv.layer(0)
    big = decode_batch(kv, [300] * 4)
    now, calls = [0.0], []
    cost = {"slots": 2.0, "pages": 1.0, "in_place": 3.0}
    real = __import__("moeplex.attention.torch_ref", fromlist=["decode_by"]).decode_by

    def decode_by(way, *args):
        calls.append(way)
        now[0] += cost[way]
        return real(way, *args)

    monkeypatch.setattr("moeplex.attention.torch_ref.decode_by", decode_by)
    monkeypatch.setattr("moeplex.kernels.cpu.measuring_clock", lambda: lambda: now[0])
    ways = set(PagedGather.ways(q, keys, values, big))
    assert gather.way(q, keys, values, big) == "pages" and set(calls) == ways
    measured = len(calls)
    assert gather.way(q, keys, values, big) == "pages" and len(calls) == measured  # decided: no second measurement
    # another process on this machine (its own store object, the same file): a small first batch takes the
    # stored choice without timing anything
    monkeypatch.setattr("moeplex.kernels.cpu.stored_choice", MeasuredChoices(str(tmp_path / "c.json")).stored)
    calls.clear()
    assert PagedGather().way(q[:2], keys, values, decode_batch(kv, [5, 9])) == "pages" and not calls


@pytest.mark.gpu
def test_gpu_extends_and_padded_decode_never_run_cudnn_attention():
    """cuDNN's SDPA kernel builds a graph for every new shape (hundreds of ms each): extends and eager decodes of
    new lengths must take the other kernels, with the same values as on the CPU."""
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    gen = torch.Generator().manual_seed(0)
    for mode, spans in (("extend", ((0, 37), (5, 11), (20, 3))), ("decode", ((13, 1), (40, 1), (7, 1)))):
        kv = KVPool(64, PAGE, [[(2, 64), (2, 64)]], torch.bfloat16, "cpu")
        seqs = [ScheduledSeq([1] * n, prefix, kv.allocate(kv.pages_for(prefix + n))) for prefix, n in spans]
        batch = build_forward_batch(seqs, kv, "cpu")
        q = torch.randn(sum(n for _, n in spans), 8, 64, generator=gen)
        k, v = (torch.randn(sum(p + n for p, n in spans), 2, 64, generator=gen) for _ in range(2))
        expected = ragged_attention(q, k, v, batch, 0.125)
        on_gpu = build_forward_batch(seqs, kv, "cuda")
        assert on_gpu.mode == (ForwardMode.EXTEND if mode == "extend" else ForwardMode.DECODE)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = ragged_attention(*(x.to("cuda", torch.bfloat16) for x in (q, k, v)), on_gpu, 0.125)
            torch.cuda.synchronize()
        assert not [e.key for e in prof.key_averages() if "cudnn" in e.key.lower()], mode
        torch.testing.assert_close(out.float().cpu(), expected, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
def test_gpu_mla_prompts_take_the_flash_kernel():
    """MLA's prompt attention (192-wide queries and keys, 128-wide values) runs SDPA's flash kernel, its values widened
    with zero columns that are cut from the output, with the same values as on the CPU."""
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    gen = torch.Generator().manual_seed(0)
    spans = ((0, 37), (0, 11))
    kv = KVPool(64, PAGE, [[(2, 192), (2, 128)]], torch.bfloat16, "cpu")
    seqs = [ScheduledSeq([1] * n, prefix, kv.allocate(kv.pages_for(prefix + n))) for prefix, n in spans]
    q = torch.randn(48, 2, 192, generator=gen)
    k, v = torch.randn(48, 2, 192, generator=gen), torch.randn(48, 2, 128, generator=gen)
    expected = ragged_attention(q, k, v, build_forward_batch(seqs, kv, "cpu"), 0.1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = ragged_attention(*(x.to("cuda", torch.bfloat16) for x in (q, k, v)), build_forward_batch(seqs, kv, "cuda"), 0.1)
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages()]
    assert any("flash" in n.lower() for n in names) and not any("efficient_attention" in n for n in names), names
    assert out.shape == (48, 2, 128)
    torch.testing.assert_close(out.float().cpu(), expected, atol=3e-2, rtol=3e-2)
