"""The `triton` attention backend equals the `torch` one: kernels, backends over the paged cache, whole models.

Without CUDA the kernels run under Triton's interpreter, so shapes are tiny: 16-token tiles and
4-token pages put page boundaries and several tiles inside short sequences, and split counts up to
more than a sequence has tiles leave some splits empty. The `gpu` tests add serving shapes and bf16.
"""

import json

import pytest
import torch

from moeplex.attention import TorchAttention, make_attention_backend
from moeplex.attention.triton_backend import TritonAttention
from moeplex.attention.triton_decode import _split_kernel, decode_attention, merge_counters_needed
from moeplex.batch_builder import ScheduledSeq, build_forward_batch
from moeplex.cli import main
from moeplex.config import EngineConfig
from moeplex.forward_batch import ForwardMode
from moeplex.kv_cache import KVPool
from moeplex.models.setup import load_model
from moeplex.registry import lookup
from moeplex.selection import resolve

from triton_guard import DEVICE, skip_unless_runnable

skip_unless_runnable(_split_kernel)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
PAGE = 4


def reference_decode(q, key_cache, value_cache, page_table, seq_lens, page_size, scale):
    """Softmax attention written out per request, in fp64: the slots through the page table, KV heads repeated."""
    out = []
    for b, length in enumerate(seq_lens.tolist()):
        pos = torch.arange(length, device=q.device)
        slots = page_table[b, pos // page_size].long() * page_size + pos % page_size
        group = q.shape[1] // key_cache.shape[1]
        k = key_cache[slots].double().repeat_interleave(group, dim=1)
        v = value_cache[slots].double().repeat_interleave(group, dim=1)
        weights = (torch.einsum("hd,nhd->hn", q[b].double(), k) * scale).softmax(-1)
        out.append(torch.einsum("hn,nhd->hd", weights, v))
    return torch.stack(out)


def random_case(lengths, q_heads, kv_heads, dk, dv, dtype, shared=False, seed=0):
    """Queries, caches and scattered pages: pages of different requests interleave and run backwards."""
    gen = torch.Generator().manual_seed(seed)
    pages_each = max(-(-n // PAGE) for n in lengths)
    num_pages = pages_each * len(lengths) + 3
    order = torch.randperm(num_pages, generator=gen)[: pages_each * len(lengths)]
    page_table = order.view(len(lengths), pages_each).flip(1)
    key_cache = torch.randn(num_pages * PAGE, kv_heads, dk, generator=gen)
    value_cache = key_cache[:, :, :dv] if shared else torch.randn(num_pages * PAGE, kv_heads, dv, generator=gen)
    q = torch.randn(len(lengths), q_heads, dk, generator=gen)
    move = dict(device=DEVICE, dtype=dtype)
    key_cache = key_cache.to(**move)
    value_cache = key_cache[:, :, :dv] if shared else value_cache.to(**move)
    return q.to(**move), key_cache, value_cache, page_table.to(DEVICE), torch.tensor(lengths, device=DEVICE)


def assert_close(ours, reference, dtype, what=""):
    error = ((ours.double() - reference).abs().max() / reference.abs().max()).item()
    assert error <= TOLERANCE[dtype], f"{what}: relative error {error:.2e} > {TOLERANCE[dtype]:.0e}"


KERNEL_CASES = {
    # name: (lengths, q heads, kv heads, key dim, value dim, values are the keys' first columns)
    "mha-one-request": ((13,), 2, 2, 16, 16, False),
    "gqa-2-ragged": ((1, 4, 5, 23), 4, 2, 32, 32, False),
    "gqa-4-odd-dim": ((9, 16, 2), 8, 2, 24, 24, False),
    "mla-latent": ((7, 33), 4, 1, 40, 32, True),
    "mla-two-head-blocks": ((20, 3), 20, 1, 24, 16, True),
    # splits of whole tiles: 100 tokens in 3 splits of 16-token tiles are 48 + 48 + 4, 37 are 16 + 16 + 5
    "gqa-multi-tile-splits": ((100, 37), 4, 2, 16, 16, False),
}


def merge_counters(q, kv_heads):
    return torch.zeros(merge_counters_needed(q.shape[0], q.shape[1], kv_heads), dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("splits,merge", [(1, False), (3, False), (3, True)], ids=["1", "3-reduce", "3-merged"])
@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_decode_kernel_matches_reference(case, splits, merge, dtype):
    lengths, q_heads, kv_heads, dk, dv, shared = KERNEL_CASES[case]
    q, keys, values, table, lens = random_case(lengths, q_heads, kv_heads, dk, dv, dtype, shared)
    counters = merge_counters(q, kv_heads) if merge else None
    out = decode_attention(q, keys, values, table, lens, PAGE, scale=dk**-0.5, num_splits=splits, block_n=16,
                           merge_counters=counters)
    assert out.shape == (len(lengths), q_heads, dv) and out.dtype == dtype
    assert_close(out, reference_decode(q, keys, values, table, lens, PAGE, dk**-0.5), dtype, case)
    if merge:
        assert (counters == 0).all(), "the counters are zero again for the next launch"


@pytest.mark.parametrize("merge", [False, True], ids=["reduce", "merged"])
def test_more_splits_than_tiles_leaves_empty_splits_harmless(merge):
    """Eight splits of sequences of 1 and 6 tokens: most splits hold nothing and must weigh nothing."""
    q, keys, values, table, lens = random_case((1, 6), 4, 2, 16, 16, torch.float32)
    out = decode_attention(q, keys, values, table, lens, PAGE, scale=0.25, num_splits=8, block_n=16,
                           merge_counters=merge_counters(q, 2) if merge else None)
    assert torch.isfinite(out).all()
    assert_close(out, reference_decode(q, keys, values, table, lens, PAGE, 0.25), torch.float32)


def test_too_few_merge_counters_are_refused():
    q, keys, values, table, lens = random_case((5, 2), 4, 2, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="counters"):
        decode_attention(q, keys, values, table, lens, PAGE, scale=0.25, num_splits=2,
                         merge_counters=torch.zeros(1, dtype=torch.int32, device=DEVICE))


def test_wider_page_table_than_needed_is_read_only_up_to_each_length():
    """A page table padded with columns of garbage (as a CUDA graph's static table is) changes nothing."""
    q, keys, values, table, lens = random_case((5, 2), 2, 1, 16, 16, torch.float32)
    wide = torch.cat([table, torch.full((2, 3), 10**6, device=DEVICE)], dim=1).to(torch.int32)
    out = decode_attention(q, keys, values, wide, lens, PAGE, scale=0.25, num_splits=2, block_n=16)
    assert_close(out, reference_decode(q, keys, values, table, lens, PAGE, 0.25), torch.float32)


def test_split_count_fills_the_device_but_stays_within_limits():
    backend = TritonAttention(DEVICE, torch.float32, max_splits=16, min_split_tokens=64, target_programs=128)
    assert backend.num_splits(batch_size=1, programs_per_request=4, longest=100_000) == 16  # capped
    assert backend.num_splits(batch_size=1, programs_per_request=4, longest=200) == 4  # >= 64 tokens a split
    assert backend.num_splits(batch_size=32, programs_per_request=4, longest=100_000) == 1  # batch fills it
    assert backend.num_splits(batch_size=8, programs_per_request=4, longest=100_000) == 4
    assert backend.num_splits(batch_size=1, programs_per_request=1, longest=0) == 1


def test_auto_picks_triton_on_cuda_and_torch_elsewhere():
    assert isinstance(make_attention_backend("auto", "cpu", torch.float32), TorchAttention)
    assert isinstance(make_attention_backend("triton", DEVICE, torch.float32), TritonAttention)
    if torch.cuda.is_available():
        assert isinstance(make_attention_backend("auto", "cuda", torch.bfloat16), TritonAttention)
    else:
        with pytest.raises(ValueError, match="bf16"):
            make_attention_backend("triton", "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="one of"):
        EngineConfig(model="x", attention_backend="flash")


# --- the two backends on batches built by the engine's own batch builder -------------------------


def decode_batch(kv: KVPool, lengths, seed=0):
    """A decode batch over scattered pages: each request's last token is new, the rest cached."""
    everything = kv.allocate(kv.num_free_pages)
    kv.release(everything[::-1])
    seqs = [ScheduledSeq([1], n - 1, kv.allocate(kv.pages_for(n))) for n in lengths]
    return build_forward_batch(seqs, kv, DEVICE)


@pytest.mark.parametrize("layout", ["gqa", "mla"])
def test_backends_agree_on_engine_batches(layout):
    dtype = torch.float32
    shapes = [[(2, 16), (2, 16)]] if layout == "gqa" else [[(40,)]]
    kv = KVPool(24, PAGE, shapes, dtype, DEVICE)
    gen = torch.Generator().manual_seed(1)
    for buffer in kv.layer(0):
        buffer.copy_(torch.randn(buffer.shape, generator=gen))
    batch = decode_batch(kv, [3, 17, 8, 2])
    assert batch.mode == ForwardMode.DECODE
    if layout == "gqa":
        keys, values = kv.layer(0)
        q = torch.randn(4, 6, 16, generator=gen).to(DEVICE)
    else:
        (latent,) = kv.layer(0)
        keys, values = latent.unsqueeze(1), latent[:, :32].unsqueeze(1)
        q = torch.randn(4, 3, 40, generator=gen).to(DEVICE)
    triton_backend = TritonAttention(DEVICE, dtype, min_split_tokens=4, target_programs=64, block_n=16)
    ours = triton_backend.decode(q, keys, values, batch, 0.3)
    assert_close(ours, TorchAttention().decode(q, keys, values, batch, 0.3).double(), dtype, layout)


def test_micro_batches_keep_their_requests_page_tables():
    """A decode batch cut into micro-batches (two-batch overlap): each half attends as its rows of the whole."""
    kv = KVPool(24, PAGE, [[(2, 16), (2, 16)]], torch.float32, DEVICE)
    gen = torch.Generator().manual_seed(2)
    for buffer in kv.layer(0):
        buffer.copy_(torch.randn(buffer.shape, generator=gen))
    batch = decode_batch(kv, [6, 2, 13, 9])
    keys, values = kv.layer(0)
    q = torch.randn(4, 4, 16, generator=gen).to(DEVICE)
    backend = TritonAttention(DEVICE, torch.float32, min_split_tokens=4, target_programs=32, block_n=16)
    whole = backend.decode(q, keys, values, batch, 0.25)
    for start, end in ((0, 1), (1, 4)):
        half = batch.slice_tokens(start, end)
        assert half.page_table.shape[0] == end - start and half.page_size == PAGE
        assert_close(backend.decode(q[start:end], keys, values, half, 0.25), whole[start:end].double(), torch.float32)


# --- whole models: the same logits and greedy tokens with either backend -----------------------------


@pytest.fixture(scope="module")
def overlap_none():
    return lookup("overlap", "none")()


def run_steps(model, backend, overlap, prompts, decode_steps):
    """Prefill the prompts in one step, then decode greedily; the logits of every step, and the tokens."""
    model.set_attention_backend(backend)
    kv = KVPool(32, PAGE, model.kv_shapes(), torch.float32, DEVICE)
    pages = [kv.allocate(kv.pages_for(len(p) + decode_steps)) for p in prompts]
    seqs = [list(p) for p in prompts]
    batch = build_forward_batch([ScheduledSeq(s, 0, p) for s, p in zip(seqs, pages)], kv, DEVICE)
    steps = []
    for _ in range(decode_steps + 1):
        with torch.inference_mode():
            logits = model(batch, kv, overlap)
        steps.append((batch.mode, logits))
        for seq, token in zip(seqs, logits.argmax(-1).tolist()):
            seq.append(token)
        batch = build_forward_batch([ScheduledSeq(s[-1:], len(s) - 1, p) for s, p in zip(seqs, pages)], kv, DEVICE)
    return steps, seqs


def test_models_decode_alike_with_either_backend(tiny_model_dir, arch, overlap_none):
    config = EngineConfig(model=tiny_model_dir(arch), dtype="fp32", device=str(DEVICE), show_progress=False)
    model = load_model(config.model, config, resolve(config))
    prompts = [[256, 7, 9, 11, 13, 2], [256, 40, 41], [256] + list(range(60, 73))]
    triton_backend = TritonAttention(DEVICE, torch.float32, min_split_tokens=4, target_programs=16, block_n=16)
    reference, reference_tokens = run_steps(model, TorchAttention(), overlap_none, prompts, decode_steps=3)
    ours, tokens = run_steps(model, triton_backend, overlap_none, prompts, decode_steps=3)
    assert [mode for mode, _ in ours] == [ForwardMode.EXTEND] + [ForwardMode.DECODE] * 3
    for step, ((_, mine), (_, theirs)) in enumerate(zip(ours, reference)):
        assert_close(mine, theirs.double(), torch.float32, f"{arch} step {step}")
    assert tokens == reference_tokens


def test_engine_config_selects_the_backend(tiny_model_dir):
    config = EngineConfig(
        model=tiny_model_dir("qwen3_moe"), attention_backend="triton", device=str(DEVICE), show_progress=False
    )
    model = load_model(config.model, config, resolve(config))
    assert all(layer.self_attn.backend is model.attention_backend for layer in model.model.layers)
    assert isinstance(model.attention_backend, TritonAttention)


def test_generate_command_gives_the_same_tokens_with_either_backend(tiny_model_dir, capsys):
    outputs = []
    for backend in ("torch", "triton"):
        code = main(["generate", "--model", tiny_model_dir("deepseek_v3"), "--input-ids", "256,5,6,7", "256,9",
                     "--max-new-tokens", "6", "--ignore-eos", "--json", "--attention-backend", backend,
                     "--device", str(DEVICE)])
        assert code == 0
        outputs.append([json.loads(line)["output_ids"] for line in capsys.readouterr().out.splitlines()])
    assert outputs[0] == outputs[1] and len(outputs[0]) == 2


# --- serving shapes on the GPU --------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "shape",
    [(32, 4, 128, 128, False), (128, 1, 576, 512, True)],  # Qwen3-30B-A3B GQA; DeepSeek-V3 MLA latent + rope
    ids=["qwen3-gqa", "deepseek-mla"],
)
def test_serving_shapes_on_gpu(shape, dtype):
    q_heads, kv_heads, dk, dv, shared = shape
    lengths = (1, 37, 300, 4100)
    q, keys, values, table, lens = random_case(lengths, q_heads, kv_heads, dk, dv, dtype, shared)
    reference = reference_decode(q, keys, values, table, lens, PAGE, dk**-0.5)
    counters = merge_counters(q, kv_heads)
    for splits in (1, 7, 32):
        for merged in (None, counters):
            out = decode_attention(q, keys, values, table, lens, PAGE, scale=dk**-0.5, num_splits=splits,
                                   merge_counters=merged)
            assert_close(out, reference, dtype, f"{splits} splits{', merged' if merged is not None else ''}")
    assert (counters == 0).all()
