"""CUDA-graph decode: which sizes are captured, how a batch is padded into the static inputs, when graphs are off.

On the CPU every part but the capture itself runs: DecodeGraphs takes a `capture` that here just
calls the step again, so a replay reads the static inputs exactly as a CUDA graph would. The `gpu`
tests capture real graphs and check that replay equals eager decode.
"""

from types import SimpleNamespace

import pytest
import torch

from moeplex.attention import TorchAttention
from moeplex.attention.triton_backend import INTERPRETED, TritonAttention
from moeplex.batch_builder import ScheduledSeq, build_forward_batch
from moeplex.cli import build_parser
from moeplex.cli.flags import engine_config
from moeplex.config import EngineConfig
from moeplex.cuda_graph import (
    DecodeGraphs,
    DecodeInputs,
    capture_sizes,
    max_pages_per_request,
    padded_size,
    why_no_graphs,
)
from moeplex.engine import Engine
from moeplex.forward_batch import ForwardMode
from moeplex.kv_cache import KVPool
from moeplex.model_runner import ModelRunner
from moeplex.models.setup import load_model
from moeplex.registry import lookup
from moeplex.sampling import SamplingParams
from moeplex.selection import resolve

PAGE = 4


def test_capture_sizes_double_then_step_by_eight_up_to_the_maximum():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    with pytest.raises(ValueError):
        capture_sizes(0)


def test_a_batch_pads_to_the_next_captured_size():
    sizes = capture_sizes(20)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 20)] == [1, 2, 4, 8, 8, 16, 20, 20]
    assert padded_size(21, sizes) is None


def plugins(dispatcher_safe=True, kernel_safe=True):
    caps = SimpleNamespace  # a plugin declaring nothing about graphs counts as unsafe
    return SimpleNamespace(
        dispatcher=SimpleNamespace(caps=caps(graph_safe=True) if dispatcher_safe else caps()),
        moe_kernel=SimpleNamespace(caps=caps(graph_safe=kernel_safe)),
    )


def test_graphs_are_off_unless_everything_in_the_step_can_be_captured():
    config = EngineConfig(model="m", device="cuda", dispatcher="local", moe_kernel="triton")
    cuda, triton_attention = torch.device("cuda"), SimpleNamespace(name="triton", graph_safe=True)
    assert why_no_graphs(config, cuda, plugins(), triton_attention) is None
    off = EngineConfig(model="m", device="cuda", disable_cuda_graph=True)
    assert "--disable-cuda-graph" in why_no_graphs(off, cuda, plugins(), triton_attention)
    assert "cpu" in why_no_graphs(config, torch.device("cpu"), plugins(), triton_attention)
    assert "torch attention" in why_no_graphs(config, cuda, plugins(), TorchAttention())
    assert "dispatcher 'local'" in why_no_graphs(config, cuda, plugins(dispatcher_safe=False), triton_attention)
    assert "moe_kernel 'triton'" in why_no_graphs(config, cuda, plugins(kernel_safe=False), triton_attention)


def test_the_page_table_is_as_wide_as_the_longest_sequence_the_pool_or_model_allows():
    kv = KVPool(50, PAGE, [[(1,)]], torch.float32, "cpu")
    assert max_pages_per_request(kv, None) == 50
    assert max_pages_per_request(kv, 4096) == 50
    assert max_pages_per_request(kv, 30) == 8


def small_batch(kv, lengths):
    seqs = [ScheduledSeq([5 + i], n - 1, kv.allocate(kv.pages_for(n))) for i, n in enumerate(lengths)]
    return build_forward_batch(seqs, kv, "cpu")


def test_inputs_hold_the_batch_then_padding_that_only_touches_the_scratch_page():
    kv = KVPool(32, PAGE, [[(1,)]], torch.float32, "cpu")
    inputs = DecodeInputs.allocate(max_bs=8, max_pages=6, kv=kv, device="cpu")
    scratch = kv.scratch_page
    assert scratch == 32 and kv.buffers[0][0].shape[0] == 33 * PAGE  # one page beyond the pool, never handed out
    big = small_batch(kv, [9, 3, 14, 2, 6])
    inputs.load(big, 8)
    small = small_batch(kv, [5, 7])
    inputs.load(small, 4)  # rows 2, 3 held requests of the big batch: now they are padding
    assert inputs.input_ids[:4].tolist() == [5, 6, 0, 0]
    assert inputs.positions[:4].tolist() == [4, 6, 0, 0]
    assert inputs.seq_lens[:4].tolist() == [5, 7, 1, 1]
    assert inputs.out_cache_loc[:2].tolist() == small.out_cache_loc.tolist()
    assert inputs.out_cache_loc[2:4].tolist() == [scratch * PAGE] * 2
    assert inputs.page_table[:2, :2].tolist() == small.page_table.tolist()
    assert inputs.page_table[2:4, 0].tolist() == [scratch] * 2
    view = inputs.batch(4)
    assert view.mode == ForwardMode.DECODE and view.batch_size == 4 and view.page_size == PAGE
    assert max(view.seq_lens_cpu) == 6 * PAGE  # host-side choices see the longest sequence a row can hold
    assert view.seq_lens.data_ptr() == inputs.seq_lens.data_ptr()  # a view of the static tensors, not a copy
    assert inputs.fits(small) and not inputs.fits(small_batch(kv, [30]))  # 8 pages > 6


def test_engine_on_cpu_runs_without_graphs_and_says_nothing(tiny_model_dir, caplog):
    engine = Engine(EngineConfig(model=tiny_model_dir("mixtral"), show_progress=False, max_total_tokens=256))
    assert engine.runner.graphs is None
    assert "CUDA graphs" not in caplog.text


@pytest.mark.parametrize("command", ["generate", "serve", "bench-one-batch"])
def test_every_engine_command_takes_the_graph_and_attention_flags(command, capsys, tiny_model_dir):
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args([command, "--help"])
    help_text = capsys.readouterr().out
    for flag in ("--attention-backend", "--disable-cuda-graph", "--cuda-graph-max-bs"):
        assert flag in help_text
    extra = ["--input-ids", "1,2"] if command == "generate" else []
    folder = tiny_model_dir("deepseek_v3")
    args = parser.parse_args([command, "--model", folder, *extra, "--attention-backend", "triton",
                              "--disable-cuda-graph", "--cuda-graph-max-bs", "48"])
    config = engine_config(args)
    assert (config.attention_backend, config.disable_cuda_graph, config.cuda_graph_max_bs) == ("triton", True, 48)
    defaults = engine_config(parser.parse_args([command, "--model", folder, *extra]))
    assert (defaults.attention_backend, defaults.disable_cuda_graph, defaults.cuda_graph_max_bs) == ("auto", False, 256)


def cache_buffers(kv: KVPool) -> list[torch.Tensor]:
    return [buffer for layer in kv.buffers for buffer in layer]


@pytest.mark.skipif(
    not INTERPRETED, reason="the CPU check of replay through the static inputs; on a GPU the gpu tests capture for real"
)
def test_replaying_through_the_static_inputs_equals_eager_decode(tiny_model_dir, arch):
    """Everything but the capture: a batch of 5 padded to 8, then one of 3 padded to 4 over rows the first used."""
    graphs = replay_and_compare(tiny_model_dir(arch), "none")
    assert graphs.cuts == {1: None, 2: None, 4: None, 8: None}


@pytest.mark.skipif(not INTERPRETED, reason="the CPU check of replay through the static inputs")
def test_graphs_captured_for_a_drafter_that_reads_hidden_states_return_them_too(tiny_model_dir):
    graphs = replay_and_compare(tiny_model_dir("deepseek_v3"), "none", with_hidden=True)
    assert graphs.with_hidden


@pytest.mark.skipif(not INTERPRETED, reason="the CPU check of replay through the static inputs")
def test_tbo_replays_the_split_fixed_at_capture_and_equals_eager_decode(tiny_model_dir):
    """Every size of two or more is captured as two micro-batches cut at half its padded rows; padding rows may
    fill the second micro-batch (3 requests padded to 4 cut at 2) and the logits still equal the eager step."""
    graphs = replay_and_compare(tiny_model_dir("deepseek_v3"), "tbo")
    assert graphs.cuts == {1: None, 2: [1], 4: [2], 8: [4]}


def test_a_micro_batch_of_a_captured_batch_reads_the_static_inputs():
    """A decode cut falls between requests: the micro-batches' tensors are views of the graph's static inputs
    (a copy made at capture would freeze the lengths and pages of that moment), with nothing read on the host."""
    kv = KVPool(32, PAGE, [[(1,)]], torch.float32, "cpu")
    inputs = DecodeInputs.allocate(max_bs=8, max_pages=6, kv=kv, device="cpu")
    view = inputs.batch(8)
    first, second = view.slice_tokens(0, 4), view.slice_tokens(4, 8)
    assert second.seq_lens.data_ptr() == inputs.seq_lens[4:].data_ptr()
    assert second.page_table.data_ptr() == inputs.page_table[4:].data_ptr()
    assert second.input_ids.data_ptr() == inputs.input_ids[4:].data_ptr()
    assert first.seq_lens.data_ptr() == inputs.seq_lens.data_ptr() and first.batch_size == second.batch_size == 4
    assert second.kv_indices.numel() == 0 and second.kv_indptr.tolist() == [0] * 5
    # an eager batch cut inside a request still gets that request's own lengths
    prompt = build_forward_batch([ScheduledSeq([1, 2, 3, 4, 5], 0, kv.allocate(2))], kv, "cpu")
    cut = prompt.slice_tokens(1, 3)
    assert (cut.prefix_lens, cut.extend_lens, cut.seq_lens.tolist(), cut.kv_indices.numel()) == ((1,), (2,), [3], 3)


def replay_and_compare(folder, overlap_name: str, with_hidden: bool = False) -> DecodeGraphs:
    config = EngineConfig(model=folder, show_progress=False)
    model = load_model(config.model, config, resolve(config))
    model.set_attention_backend(TritonAttention("cpu", torch.float32, min_split_tokens=4, target_programs=8, block_n=16))
    overlap = lookup("overlap", overlap_name)()
    kv = KVPool(24, PAGE, model.kv_shapes(), torch.float32, "cpu")
    inputs = DecodeInputs.allocate(max_bs=8, max_pages=8, kv=kv, device="cpu")
    graphs = DecodeGraphs(model, kv, overlap, inputs, capture_sizes(8), capture=lambda step: step,
                          with_hidden=with_hidden)
    runner = ModelRunner(model, kv, overlap, torch.device("cpu"), graphs=graphs)
    prompts = [[256, 3, 4, 5, 6], [256, 9], [256] + list(range(20, 29)), [256, 1, 2], [256, 50, 51, 52]]
    pages = [kv.allocate(kv.pages_for(len(p) + 1)) for p in prompts]
    runner.forward(build_forward_batch([ScheduledSeq(p, 0, pg) for p, pg in zip(prompts, pages)], kv, "cpu"))
    real_slots = slice(0, kv.scratch_page * PAGE)
    for step, rows in enumerate(([0, 1, 2, 3, 4], [4, 2, 0])):
        if step == 1:  # request 3 finished and a new request owns its pages: replaying must leave them alone
            for buffer in cache_buffers(kv):
                buffer[kv.slots(pages[3], 0, len(pages[3]) * PAGE)] = 0
        batch = build_forward_batch([ScheduledSeq([7], len(prompts[r]), pages[r]) for r in rows], kv, "cpu")
        assert graphs.can_run(batch)
        before = [b.clone() for b in cache_buffers(kv)]
        if with_hidden:  # a verify step of a drafter that reads hidden states
            replayed, hidden = runner.verify_forward(batch, torch.arange(batch.batch_size), True)
        else:
            replayed = runner.forward(batch)
        after_replay = [b.clone() for b in cache_buffers(kv)]
        for buffer, saved in zip(cache_buffers(kv), before):
            buffer.copy_(saved)
        with torch.inference_mode():
            eager = model(batch, kv, overlap, return_hidden=with_hidden)
        if with_hidden:
            eager, eager_hidden = eager
            assert hidden.shape == eager_hidden.shape
            assert ((hidden - eager_hidden).abs().max() / eager_hidden.abs().max()).item() < 1e-5
        assert replayed.shape == eager.shape
        assert ((replayed - eager).abs().max() / eager.abs().max()).item() < 1e-5
        for buffer, replayed_buffer in zip(cache_buffers(kv), after_replay):
            assert torch.allclose(buffer[real_slots], replayed_buffer[real_slots], rtol=1e-5, atol=1e-6)
    return graphs


def test_no_replay_while_expert_load_is_recorded(tiny_model_dir):
    config = EngineConfig(model=tiny_model_dir("qwen3_moe"), show_progress=False, max_total_tokens=256, page_size=PAGE)
    engine = Engine(config)
    kv, model = engine.kv, engine.model
    inputs = DecodeInputs.allocate(max_bs=2, max_pages=4, kv=kv, device="cpu")
    graphs = DecodeGraphs(model, kv, engine.runner.strategy, inputs, [1, 2], capture=lambda step: (lambda: None))
    batch = small_batch(kv, [3, 6])
    assert graphs.can_run(batch)
    engine.start_recording()
    assert model.moe_runtime.records_load and not graphs.can_run(batch)
    engine.stop_recording()
    assert graphs.can_run(batch)
    extend = build_forward_batch([ScheduledSeq([1, 2], 0, kv.allocate(1))], kv, "cpu")
    assert not graphs.can_run(extend) and not graphs.can_run(small_batch(kv, [2, 3, 4]))  # extend; 3 > 2


# --- on the GPU: real graphs -------------------------------------------------------------------------


def gpu_engine(folder, dtype, **overrides):
    settings = dict(
        model=folder, dtype=dtype, device="cuda", moe_kernel="triton", attention_backend="triton",
        show_progress=False, max_total_tokens=4096, max_running_requests=16, cuda_graph_max_bs=16,
    )
    settings.update(overrides)
    return Engine(EngineConfig(**settings))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_graph_replay_equals_eager_on_gpu(tiny_model_dir, arch, dtype):
    engine = gpu_engine(tiny_model_dir(arch), dtype)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.sizes == capture_sizes(16)
    model, kv, overlap = engine.model, engine.kv, engine.runner.strategy
    prompts = [[256, 3, 4, 5, 6], [256, 9], [256] + list(range(20, 49))]
    pages = [kv.allocate(kv.pages_for(len(p) + 1)) for p in prompts]
    with torch.inference_mode():
        model(build_forward_batch([ScheduledSeq(p, 0, pg) for p, pg in zip(prompts, pages)], kv, "cuda"), kv, overlap)
        batch = build_forward_batch([ScheduledSeq([7], len(p), pg) for p, pg in zip(prompts, pages)], kv, "cuda")
        replayed = graphs.run(batch)  # padded to 4; writes the new token's KV, as eager does again below
        eager = model(batch, kv, overlap)
    tolerance = 1e-4 if dtype == "fp32" else 3e-2
    assert ((replayed - eager).abs().max() / eager.abs().max()).item() < tolerance


@pytest.mark.gpu
def test_greedy_generation_is_the_same_with_and_without_graphs_on_gpu(tiny_model_dir, arch):
    prompts = [[256] + list(range(30, 30 + n)) for n in (3, 11, 6)]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    with_graphs = gpu_engine(tiny_model_dir(arch), "fp32")
    eager = gpu_engine(tiny_model_dir(arch), "fp32", disable_cuda_graph=True)
    assert with_graphs.runner.graphs is not None and eager.runner.graphs is None
    tokens = [r.output_ids for r in with_graphs.generate(prompts, params)]
    assert tokens == [r.output_ids for r in eager.generate(prompts, params)]


@pytest.mark.gpu
def test_one_request_cannot_fail_its_batch_on_gpu(tiny_model_dir):
    """With graphs and the overlap schedule: a sampled row whose logits turn NaN would trip multinomial's device
    assert and end every request; tiny temperatures and top_p would do the same. Now only that request fails."""
    prompts = [[256] + list(range(40, 40 + n)) for n in (5, 9, 4, 7)]
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    engine = gpu_engine(tiny_model_dir("deepseek_v3"), "fp32")
    assert engine.runner.graphs is not None and engine.overlap_schedule
    reference = [r.output_ids for r in engine.generate(prompts[1:], greedy)]
    first, forward = [True], engine.runner.forward

    def poisoned(batch):  # the first step's row 0 comes back as NaN
        logits = forward(batch)
        if first and first.pop():
            logits = logits.clone()
            logits[0] = float("nan")
        return logits

    engine.runner.forward = poisoned
    degenerate = [SamplingParams(max_new_tokens=10, ignore_eos=True, **kw)
                  for kw in ({"temperature": 1e-40}, {"temperature": 5e-324}, {"top_p": 1e-50, "seed": 3})]
    sampled = SamplingParams(max_new_tokens=10, temperature=0.8, ignore_eos=True)
    results = engine.generate(prompts, [sampled] + degenerate)
    assert results[0].finish_reason.value == "abort" and "not finite" in results[0].error
    assert [r.output_ids for r in results[1:]] == reference
    assert not engine.has_work and engine.flush_cache() and engine.kv.num_free_pages == engine.kv.num_pages


@pytest.mark.gpu
def test_no_step_waits_for_the_step_in_flight_on_gpu(tiny_model_dir):
    """Under the overlap schedule nothing in a step makes the host wait for the GPU (torch's sync debug mode raises
    on any such call), decode steps and the prompt steps of requests arriving meanwhile alike: a pageable copy of
    the logits' rows once made every step wait for the one before it (benchmarks/results/serving_syncs_s8.md)."""
    engine = gpu_engine(tiny_model_dir("qwen3_moe"), "bf16")
    assert engine.overlap_schedule and engine.runner.graphs is not None
    params = SamplingParams(max_new_tokens=48, temperature=0.0, ignore_eos=True)
    prompt = [256] + list(range(30, 126))  # 97 tokens, as benchmarks/host_profile.py --admit-every sends
    for _ in range(4):
        engine.add_request(prompt, params)
    for _ in range(4):  # the prompts in, decoding under way (first-use work done)
        engine.step()
    engine.add_request(prompt, params)
    engine.step()
    torch.cuda.synchronize()
    before = dict(engine.step_log.steps)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(24):
            if step % 4 == 0:
                engine.add_request(prompt, params)
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ran = {kind: n - before[kind] for kind, n in engine.step_log.steps.items()}
    assert ran["prompt"] >= 5 and ran["decode"] >= 10, ran
    while engine.has_work:
        engine.step()
