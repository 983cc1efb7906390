"""Whole models give the same logits with the fused Triton kernels (norms, rope, routing) as with the torch ops.

The torch path is checked against transformers in the architecture tests; here every
architecture's tiny checkpoint runs a batched prefill over scattered pages and decode steps both
ways. Without CUDA the kernels run under Triton's interpreter (fp32).
"""

import torch

from model_helpers import PAGE_SIZE, assert_matches, no_overlap, scattered_pages, token_sequence
from moeplex.batch_builder import ScheduledSeq, build_forward_batch
from moeplex.config import EngineConfig
from moeplex.kernels.norm import _rms_norm_kernel
from moeplex.kv_cache import KVPool
from moeplex.models import base
from moeplex.models.setup import load_model
from moeplex.registry import lookup
from moeplex.selection import resolve
from triton_guard import DEVICE, skip_unless_runnable

skip_unless_runnable(_rms_norm_kernel)



def step(model, kv: KVPool, seqs, strategy=None) -> torch.Tensor:
    batch = build_forward_batch(seqs, kv, DEVICE)
    with torch.inference_mode():
        return model(batch, kv, strategy or no_overlap(), logits_at=torch.arange(batch.num_tokens, device=DEVICE))


def run(model, sequences, decode_steps, strategy=None):
    """Logits of a batched prefill of each sequence but its last `decode_steps` tokens, then of each decode step."""
    kv = KVPool(64, PAGE_SIZE, model.kv_shapes(), torch.float32, DEVICE)
    pages = [scattered_pages(kv, kv.pages_for(len(seq))) for seq in sequences]
    prompt = [len(seq) - decode_steps for seq in sequences]
    steps = [step(model, kv, [ScheduledSeq(seq[:n], 0, p) for seq, n, p in zip(sequences, prompt, pages)], strategy)]
    for i in range(decode_steps):
        steps.append(step(model, kv, [ScheduledSeq(seq[n + i : n + i + 1], n + i, p)
                                      for seq, n, p in zip(sequences, prompt, pages)], strategy))
    return steps


def test_fused_kernels_give_the_torch_logits(tiny_model_dir, arch):
    config = EngineConfig(model=tiny_model_dir(arch), dtype="fp32", device=str(DEVICE), show_progress=False)
    model = load_model(config.model, config, resolve(config))
    model.use_fused_kernels(False)  # on CUDA they are on from the start
    sequences = [token_sequence(n, seed=n) for n in (5, 12, 9)]
    reference = run(model, sequences, decode_steps=2)
    model.use_fused_kernels(True)
    fused = run(model, sequences, decode_steps=2)
    for i, (ours, theirs) in enumerate(zip(fused, reference)):
        assert_matches(ours, theirs, f"{arch} step {i}")


def test_residual_left_for_the_next_norm_gives_the_same_logits(tiny_model_dir, arch):
    """DecoderLayer.fewer_launches alone (torch ops): each layer's MLP output is added by the next layer's norm,
    and the last one's after the stack, whole or cut into two micro-batches."""
    config = EngineConfig(model=tiny_model_dir(arch), dtype="fp32", device=str(DEVICE), show_progress=False)
    model = load_model(config.model, config, resolve(config))
    model.use_fused_kernels(False)
    sequences = [token_sequence(n, seed=n) for n in (5, 12, 9)]
    reference = run(model, sequences, decode_steps=2)
    layers = list(model.model.layers)
    for layer in layers:
        layer.fewer_launches = True
    for strategy in (no_overlap(), lookup("overlap", "tbo")()):
        for i, (ours, theirs) in enumerate(zip(run(model, sequences, 2, strategy), reference)):
            assert_matches(ours, theirs, f"{arch} {type(strategy).__name__} step {i}")


def test_moe_pair_rows_summed_by_the_next_norm_give_the_same_logits(monkeypatch, tiny_model_dir, arch):
    """With the triton MoE kernel and the local dispatcher, an MoE layer without shared experts hands its weighted
    pair rows unsummed to the next layer's norm (MoELayer.fewer_launches, executor.PairRows): the fused norm sums
    them in its kernel; with the torch ops, PairRows.total does, as does the step's end after the last layer."""
    calls = []
    real = base.rms_norm
    monkeypatch.setattr(base, "rms_norm", lambda *args, pairs=1, **kw: calls.append(pairs) or real(*args, pairs=pairs, **kw))
    config = EngineConfig(model=tiny_model_dir(arch), dtype="fp32", device=str(DEVICE), show_progress=False,
                          moe_kernel="triton")
    model = load_model(config.model, config, resolve(config))
    deferring = [m for m in model.moe_layers() if m.shared_experts is None]
    model.use_fused_kernels(False)
    sequences = [token_sequence(n, seed=n) for n in (5, 12, 9)]
    reference = run(model, sequences, decode_steps=2)
    for layer in (*model.model.layers, *deferring):  # torch ops: the pending pair rows are summed by PairRows.total
        layer.fewer_launches = True
    for strategy in (no_overlap(), lookup("overlap", "tbo")()):
        for i, (ours, theirs) in enumerate(zip(run(model, sequences, 2, strategy), reference)):
            assert_matches(ours, theirs, f"{arch} torch ops {type(strategy).__name__} step {i}")
    model.use_fused_kernels(True)
    calls.clear()
    for i, (ours, theirs) in enumerate(zip(run(model, sequences, 2), reference)):
        assert_matches(ours, theirs, f"{arch} fused step {i}")
    top_k = {m.gate.spec.top_k for m in deferring}
    assert (set(calls) - {1}) == (top_k if len(deferring) > 1 else set())  # the last layer's pairs: the step's end
