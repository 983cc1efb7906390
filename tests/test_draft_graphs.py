"""The nextn drafter's own steps in CUDA graphs (DrafterContext.graphs_for).

On the CPU everything but the capture runs: the target's DecodeGraphs and the drafter's GraphedStep get a
`capture` that returns the step itself, so a replay reads the static inputs (padded batch, page table, the
static hidden rows) exactly as a CUDA graph would, through Triton's interpreter for the MLA decode kernels,
on one rank and (slow) over tp2 ep2 gloo ranks. The `gpu` test captures for real.
"""

from __future__ import annotations

import logging

import attrs
import pytest
import torch

from moeplex.attention.triton_backend import INTERPRETED
from moeplex.config import EngineConfig
from moeplex.cuda_graph import DecodeGraphs, DecodeInputs, capture_sizes, max_pages_per_request, padded_size
from moeplex.engine import Engine
from moeplex.interfaces import DraftRequest, TargetStep
from moeplex.models.make_model import write_checkpoint
from moeplex.sampling import SamplingParams
from moeplex.speculation.graphs import EagerStep, GraphedStep
from moeplex.speculation.setup import drafter_context
import moeplex.plugins.drafters.nextn as nextn

PAGE = 4
MAX_BS = 16
PROMPTS = [[256] + list(range(10, 20)) * 2, [256, 5, 6, 7, 5, 6, 7], [256] + list(range(40, 55))]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)

interpreted = pytest.mark.skipif(not INTERPRETED, reason="the CPU check of replay through the static inputs")


@pytest.fixture(scope="module")
def mtp_folder(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("mtp")), "deepseek_v3", "tiny", seed=0, mtp=1)


def engine(folder: str, **overrides) -> Engine:
    settings = dict(model=folder, dtype="fp32", show_progress=False, max_total_tokens=512, page_size=PAGE,
                    attention_backend="triton", mixed_chunk=False, disable_speculative_backoff=True,
                    speculative_policy="fixed")
    return Engine(EngineConfig(**{**settings, **overrides}))


def install_graphs(spec: Engine) -> list[int]:
    """Give a CPU engine the target's decode graphs and its nextn drafter graphed steps, both with the call-again
    capture; returns the log of the drafter's replays (captured size per replay)."""
    kv, model = spec.kv, spec.model
    inputs = DecodeInputs.allocate(MAX_BS, max_pages_per_request(kv, None), kv, "cpu")
    graphs = DecodeGraphs(model, kv, spec.runner.strategy, inputs, capture_sizes(MAX_BS), lambda step: step,
                          with_hidden=True)
    spec.runner.graphs = graphs
    drafter = spec.speculation.drafter
    drafter.bind(drafter_context(model, kv, spec.config, spec.device, drafter.context.kv_layer_ids, graphs,
                                 capture=lambda step: step))
    assert isinstance(drafter.rows_step, GraphedStep) and drafter.rows_step.sizes == capture_sizes(MAX_BS)
    return install_log(drafter.rows_step)


def install_log(graphed: GraphedStep) -> list[int]:
    """The captured size of each later replay of `graphed`."""
    replayed = []
    for size, replay in graphed.replays.items():
        graphed.replays[size] = lambda size=size, replay=replay: replayed.append(size) or replay()
    return replayed


def test_on_the_cpu_the_engine_gives_the_drafter_an_eager_step(mtp_folder):
    spec = engine(mtp_folder, speculative_algorithm="nextn", speculative_num_steps=2)
    assert spec.runner.graphs is None and isinstance(spec.speculation.drafter.rows_step, EagerStep)
    assert not spec.speculation.drafter.rows_step.can_replay(1)


@interpreted
def test_replayed_drafter_steps_change_no_token(mtp_folder):
    """Chain steps and the observe of verify steps (decode rows) replay; output equals decoding without drafts."""
    want = [r.output_ids for r in engine(mtp_folder).generate(PROMPTS, GREEDY)]
    spec = engine(mtp_folder, speculative_algorithm="nextn", speculative_num_steps=3)
    replayed = install_graphs(spec)
    got = spec.generate(PROMPTS, GREEDY)
    assert [r.output_ids for r in got] == want
    assert all(r.spec_verify_steps > 0 for r in got)
    assert 4 in replayed  # three chains (or three requests' kept rows) padded to four
    assert spec.flush_cache() and spec.kv.num_free_pages == spec.kv.num_pages


def cache_buffers(kv) -> list[torch.Tensor]:
    return [buffer for layer in kv.buffers for buffer in layer]


@interpreted
def test_the_replayed_chain_equals_the_eager_one_and_padding_touches_only_the_scratch_page(mtp_folder):
    spec = engine(mtp_folder, speculative_algorithm="nextn", speculative_num_steps=3)
    install_graphs(spec)
    prompts = PROMPTS + [[256, 90, 91, 92], [256] + list(range(60, 69))]
    long = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    requests = [spec.add_request(p, long) for p in prompts]
    for _ in range(4):
        spec.step()
    drafter, kv = spec.speculation.drafter, spec.kv
    graphed, eager = drafter.rows_step, drafter.step_rows
    scratch = slice(kv.scratch_page * PAGE, (kv.scratch_page + 1) * PAGE)
    real = slice(0, kv.scratch_page * PAGE)
    mtp_buffer = kv.buffers[drafter.context.kv_layer_ids[0]][0]
    generator = torch.Generator().manual_seed(0)
    # 5 rows padded to 8, 3 padded to 4 over rows the first used, 2 (a captured size: no padding), 1
    for rows in ([0, 1, 2, 3, 4], [4, 2, 0], [1, 3], [2]):
        chosen = [requests[r] for r in rows]
        batch = drafter.context.batch_of([([7 + r], q.num_cached, q.pages) for r, q in zip(rows, chosen)])
        hidden = torch.randn(len(rows), graphed.hidden.shape[1], generator=generator)
        assert graphed.size_for(batch) is not None
        before = [b.clone() for b in cache_buffers(kv)]
        mtp_buffer[scratch] = 0
        with torch.inference_mode():
            new_hidden, drafts = graphed(batch, hidden)
        padded = graphed.size_for(batch) > len(rows)
        assert bool(mtp_buffer[scratch].abs().sum() > 0) == padded  # padding rows wrote their KV there
        after_replay = [b.clone() for b in cache_buffers(kv)]
        for buffer, saved in zip(cache_buffers(kv), before):
            buffer.copy_(saved)
        with torch.inference_mode():
            want_hidden, want_drafts = eager(batch, hidden)
        assert new_hidden.shape == want_hidden.shape == hidden.shape
        torch.testing.assert_close(new_hidden, want_hidden, atol=1e-5, rtol=1e-5)
        assert drafts.tolist() == want_drafts.tolist()
        for buffer, replayed in zip(cache_buffers(kv), after_replay):
            torch.testing.assert_close(buffer[real], replayed[real], atol=1e-6, rtol=1e-5)
    for request in requests:
        spec.abort(request.rid)


@interpreted
@pytest.mark.parametrize("graphed", [True, False])
@pytest.mark.parametrize("room", [True, False])
def test_propose_chains_each_draft_and_hidden_state_into_the_next_step(mtp_folder, graphed, room):
    """propose (replayed, or eager) equals the chain run step by step by hand: step j at position p + j - 2 on
    draft j - 1 and the hidden state step j - 1 returned. Without pages reserved for every row, a chain stops
    where its pages end and the others go on."""
    spec = engine(mtp_folder, speculative_algorithm="nextn", speculative_num_steps=3)
    replayed = install_graphs(spec) if graphed else []
    long = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    requests = [spec.add_request(p, long) for p in PROMPTS]
    for _ in range(3):
        spec.step()
    drafter = spec.speculation.drafter
    if room:  # as the scheduler reserves before a drafting step
        for q in requests:
            q.pages.extend(spec.kv.allocate(max(0, spec.kv.pages_for(q.num_cached + 3) - len(q.pages))))
    asked = [DraftRequest(q.rid, q.all_ids, q.num_cached, tuple(q.pages)) for q in requests]
    drafts = drafter.propose(asked).tokens
    lengths = [min(3, len(q.pages) * PAGE - q.num_cached + 1) for q in requests]
    assert [len(d) for d in drafts] == lengths and (room or min(lengths) < 3)
    if graphed:  # steps 2 and 3 replayed, padded to the next captured size
        assert replayed[-2:] == [padded_size(sum(n >= j for n in lengths), capture_sizes(MAX_BS)) for j in (2, 3)]
    hidden = {q.rid: drafter.starts[q.rid].hidden for q in requests}
    for j in (2, 3):
        going = [i for i, n in enumerate(lengths) if n >= j]
        batch = drafter.context.batch_of([([drafts[i][j - 2]], requests[i].num_cached + j - 2, requests[i].pages)
                                          for i in going])
        with torch.inference_mode():
            new_hidden, want = drafter.step_rows(batch, torch.stack([hidden[requests[i].rid] for i in going]))
        assert want.tolist() == [drafts[i][j - 1] for i in going]
        hidden = {requests[i].rid: h for i, h in zip(going, new_hidden)}
    for request in requests:
        spec.abort(request.rid)


@interpreted
@pytest.mark.parametrize("from_zero,row_reads", [(False, None), (True, None), (True, 1)])
def test_observe_as_decode_rows_equals_observe_as_an_extend(mtp_folder, from_zero, row_reads, monkeypatch):
    """Several kept positions per request (a verify step that accepted drafts), one decode row each and replayed,
    give the chain start and the MTP KV rows of the same positions observed as one extend per request. A request
    observed from position 0 (a first prompt chunk) is rows too, replayed; where the rows would read more than
    ROW_READS cached tokens the step is observed as extends, no replay."""
    if row_reads is not None:
        monkeypatch.setattr(nextn, "ROW_READS", row_reads)
    spec = engine(mtp_folder, speculative_algorithm="nextn", speculative_num_steps=3)
    install_graphs(spec)
    long = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    requests = [spec.add_request(p, long) for p in PROMPTS]
    for _ in range(4):
        spec.step()
    drafter, kv = spec.speculation.drafter, spec.kv
    kept = [3, 1, 4]  # positions num_cached - k .. num_cached - 1 of each request, observed again
    starts = [0 if from_zero and i == 0 else q.num_cached - k for i, (q, k) in enumerate(zip(requests, kept))]
    step = TargetStep(
        rids=[q.rid for q in requests], starts=starts,
        next_ids=[q.all_ids[s + 1 : s + 1 + k] for q, s, k in zip(requests, starts, kept)],
        pages=[tuple(q.pages) for q in requests],
        hidden=torch.randn(sum(kept), drafter.rows_step.hidden.shape[1], generator=torch.Generator().manual_seed(1)),
    )
    graphed, real = drafter.rows_step, slice(0, kv.scratch_page * PAGE)
    assert graphed.can_replay(sum(kept))
    replayed = install_log(graphed)
    drafter.run_now(step)  # observe defers the layer to the next draft; this is what it then runs
    assert replayed == ([] if row_reads is not None else [8])  # 8 rows, no padding
    as_rows = {rid: (s.position, s.draft, s.hidden) for rid, s in drafter.starts.items()}
    kv_rows = kv.buffers[drafter.context.kv_layer_ids[0]][0][real].clone()
    drafter.replays = lambda rows: False  # as without graphs: observe runs one extend per request
    drafter.run_now(step)
    for rid, (position, draft, hidden) in as_rows.items():
        start = drafter.starts[rid]
        assert (start.position, start.draft) == (position, draft)
        torch.testing.assert_close(start.hidden, hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv.buffers[drafter.context.kv_layer_ids[0]][0][real], kv_rows, atol=1e-5, rtol=1e-5)
    for request in requests:
        spec.abort(request.rid)


@interpreted
def test_a_prompt_beside_verify_rows_reaches_the_mtp_layer_as_replayed_rows(mtp_folder):
    """--mixed-chunk on with graphs: prompts arrive while others decode, so mixed steps verify drafts (the prompt's
    tokens decode rows beside the verify rows), and the MTP layer's catch-up over a new prompt's positions, from
    position 0, runs them as decode rows through its captured step, not as an extend. Output equals decoding
    without drafts."""
    prompts = [PROMPTS[1], PROMPTS[1][:5], [256, 30, 31, 32, 33], [256, 8, 9]]
    want = [r.output_ids for r in engine(mtp_folder, mixed_chunk=True).generate(prompts, GREEDY)]
    spec = engine(mtp_folder, mixed_chunk=True, speculative_algorithm="nextn", speculative_num_steps=2)
    install_graphs(spec)
    drafter = spec.speculation.drafter
    batches = []  # per batch the drafter built: (rows, whether a seq starts at position 0)
    batch_of = drafter.context.batch_of

    def logged(seqs, rows=False):
        seqs = list(seqs)
        batches.append((rows, any(start == 0 for _, start, _ in seqs)))
        return batch_of(seqs, rows=rows)

    drafter.context = attrs.evolve(drafter.context, batch_of=logged)
    mixed_drafts = []
    prepare = spec.runner.prepare

    def prepared(work, *args, drafts=None, **kwargs):
        if any(not item.request.output_ids for item in work) and any(item.request.output_ids for item in work):
            mixed_drafts.append(sum(len(d) for d in drafts or ()))
        return prepare(work, *args, drafts=drafts, **kwargs)

    spec.runner.prepare = prepared
    requests = [spec.add_request(prompts[0], GREEDY)]
    for prompt in prompts[1:]:  # each arrives while the ones before decode
        spec.step(), spec.step()
        requests.append(spec.add_request(prompt, GREEDY))
    while spec.has_work:
        spec.step()
    assert [r.output_ids for r in requests] == want
    assert any(mixed_drafts), mixed_drafts
    assert (True, True) in batches, batches  # a catch-up from position 0, as rows
    assert (False, True) not in batches, batches  # and never as an extend: every prompt here is short
    assert spec.flush_cache() and spec.kv.num_free_pages == spec.kv.num_pages


def test_a_capture_that_fails_leaves_the_drafter_eager_with_one_line_saying_why(mtp_folder, caplog):
    spec = engine(mtp_folder, speculative_algorithm="nextn", speculative_num_steps=2, attention_backend="torch")
    kv, model = spec.kv, spec.model
    inputs = DecodeInputs.allocate(2, 4, kv, "cpu")
    graphs = DecodeGraphs(model, kv, spec.runner.strategy, inputs, [1, 2], lambda step: step)

    def failing(step):
        raise RuntimeError("operation not permitted when stream is capturing")

    drafter = spec.speculation.drafter
    with caplog.at_level(logging.WARNING):
        drafter.bind(drafter_context(model, kv, spec.config, spec.device, drafter.context.kv_layer_ids, graphs,
                                     capture=failing))
    assert isinstance(drafter.rows_step, EagerStep)
    lines = [r.getMessage() for r in caplog.records if "without CUDA graphs" in r.getMessage()]
    assert len(lines) == 1 and "not permitted" in lines[0]
    got = spec.generate(PROMPTS[:1], GREEDY)
    assert got[0].spec_verify_steps > 0


@interpreted
@pytest.mark.slow
def test_over_tensor_and_expert_parallel_ranks_the_replayed_drafter_changes_no_token(mtp_folder):
    """tp2 ep2 (naive all-to-all): both ranks hold every request, pad the drafter's steps alike and route half
    the padded rows of its MTP layer's experts each; output equals one rank's without speculation."""
    import graph_ranks
    from moeplex.parallel import ParallelConfig
    from moeplex.ranks.launcher import launch
    from test_parallel import free_address

    prompts = PROMPTS[1:]  # two requests: every chain step and observe fits graph_ranks' largest size, 4
    want = [r.output_ids for r in engine(mtp_folder).generate(prompts, GREEDY)]
    parallel = ParallelConfig(tp_size=2, ep_size=2, dist_init_addr=free_address(), timeout_s=120)
    settings = {"speculative_algorithm": "nextn", "speculative_num_steps": 2, "dtype": "fp32",
                "disable_speculative_backoff": True, "speculative_policy": "fixed"}
    out = launch(graph_ranks.run_engines, parallel, parallel, mtp_folder, prompts, [GREEDY] * len(prompts),
                 {"graphs": (settings, True)})["graphs"]
    assert [r["output_ids"] for r in out["results"]] == want
    first, second = (rank["draft_replays"] for rank in out["ranks"])
    assert first and first == second and 2 in first
    assert all(rank["pages_conserved"] for rank in out["ranks"])


@pytest.mark.gpu
def test_on_gpu_the_captured_drafter_steps_equal_eager_and_change_no_token(tmp_path):
    folder = write_checkpoint(str(tmp_path), "deepseek_v3", "tiny", seed=0, mtp=1)
    # synchronous verify steps: the host path's chain (under the overlap schedule nextn drafts inside the verify
    # steps' own graphs: test_nextn_overlap.py)
    gpu = dict(device="cuda", moe_kernel="triton", max_running_requests=16, cuda_graph_max_bs=16,
               max_total_tokens=4096, page_size=16, mixed_chunk=None, overlap_schedule=False)
    want = [r.output_ids for r in engine(folder, **gpu).generate(PROMPTS, GREEDY)]
    spec = engine(folder, speculative_algorithm="nextn", speculative_num_steps=3, **gpu)
    drafter = spec.speculation.drafter
    assert isinstance(drafter.rows_step, GraphedStep) and max(drafter.rows_step.sizes) >= 16
    replayed = install_log(drafter.rows_step)
    assert [r.output_ids for r in spec.generate(PROMPTS, GREEDY)] == want
    assert 4 in replayed  # chain steps (and verify steps' observes) of three requests, padded to four
    long = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    requests = [spec.add_request(p, long) for p in PROMPTS]
    for _ in range(3):
        spec.step()
    batch = drafter.context.batch_of([([7], q.num_cached, q.pages) for q in requests])
    hidden = torch.randn(len(requests), drafter.rows_step.hidden.shape[1], device="cuda")
    with torch.inference_mode():
        replayed, replayed_drafts = drafter.rows_step(batch, hidden)
        eager, eager_drafts = drafter.step_rows(batch, hidden)
    assert ((replayed - eager).abs().max() / eager.abs().max()).item() < 1e-4
    assert replayed_drafts.tolist() == eager_drafts.tolist()
    for request in requests:
        spec.abort(request.rid)
