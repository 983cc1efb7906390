"""The engine's drafter: checked against the flags, the plugins and the model, then made."""

from __future__ import annotations

import contextlib
import logging
import time

import attrs
import torch

from ..batch_builder import ScheduledSeq, build_forward_batch
from ..cuda_graph import Capture, CudaGraphCapture
from ..interfaces import DrafterContext, ForwardBatch
from ..kv_cache import KVPool
from ..transfer import to_device
from .checks import check_model, check_speculation
from .costs import StepCosts, grid_sizes, time_size
from .graphs import graphs_for

log = logging.getLogger(__name__)


def has_mtp_layers(hf_config) -> bool:
    return bool(hf_config.get("num_nextn_predict_layers") or 0)


def check_drafter(config, selection, hf_config) -> type | None:
    """The drafter class --speculative-algorithm names (None for none), or one sentence saying why it cannot run."""
    dcaps = selection.dispatcher.caps
    cls = check_speculation(config, dcaps, config.dispatch_tokens_per_rank(dcaps))
    check_model(config, cls, hf_config, has_mtp_layers(hf_config))
    return cls


def drafter_context(model, kv: KVPool, config, device: torch.device, kv_layer_ids, target_graphs=None,
                    world_size: int = 1, capture: Capture | None = None) -> DrafterContext:
    """The context `bind` gets. `target_graphs`: the target's decode graphs (None: the drafter's steps run eagerly
    too), whose static inputs and sizes the drafter's graphs share; `capture`: CudaGraphCapture by default."""

    def batch_of(seqs, rows: bool = False) -> ForwardBatch:
        return build_forward_batch([ScheduledSeq(list(ids), start, pages) for ids, start, pages in seqs], kv, device,
                                   rows=rows)

    def graphs_for_step(step, width: int):
        captures = capture if capture is not None or target_graphs is None else CudaGraphCapture(device)
        return graphs_for(step, width, config.torch_dtype, target_graphs, captures, world_size,
                          lambda: model.moe_runtime.records_load)

    return DrafterContext(model, kv, config, device, tuple(kv_layer_ids), batch_of, graphs_for_step,
                          vocab_size=int(model.hf_config["vocab_size"]))


def slowest_of(world):
    """values -> each value as the largest any rank has, on every rank (one small all-gather; ranks call it alike)."""

    def slowest(values):
        if world.size == 1:
            return list(values)
        return [max(column) * 1e-7 for column in zip(*world.all_gather_ints([round(v * 1e7) for v in values]))]

    return slowest


CONTEXT = 128  # tokens of context each measured request reads (its KV: the pool's scratch page, repeated)


@contextlib.contextmanager
def _serving_nothing(runner):
    """Expert-load recording and the runner's hooks off while steps that serve no request are timed."""
    recorders = list(getattr(runner.model.moe_runtime, "recorders", ()))
    recording = [r.recording for r in recorders]
    hooks, runner.hooks = runner.hooks, None
    try:
        for r in recorders:
            r.recording = False
        yield
    finally:
        runner.hooks = hooks
        for r, was in zip(recorders, recording):
            r.recording = was


def measure_step_costs(runner, kv: KVPool, config, decode_rows: bool, with_hidden: bool, agree, world,
                       overlap: bool = False, eager: bool = False, overlap_verify: bool = False,
                       proposal_costs=lambda n: [0.0], verify_overhead=lambda n, rows: 0.0) -> StepCosts:
    """The adaptive policy's cost model (costs.py), measured on this engine's own forward paths: a plain step
    through `runner.forward` (graphs where they are captured), a verify step through `runner.verify_forward`
    with logits on every row, built the way ModelRunner.prepare builds them (decode rows, or one extend per
    request). Each measured request reads CONTEXT tokens and writes its rows, all in the pool's scratch page,
    so measuring takes no page from anyone, at start-up or between steps. With `overlap` (plain steps run under
    the overlap schedule) a plain step is timed as half of two steps launched back to back, the second built
    while the first runs, read once at the end: its host work hides as the schedule hides it. With
    `overlap_verify` (verify steps run under the overlap schedule too: speculation/overlap.py) a verify step is
    timed the same way, so the policy weighs a verify step at what it costs there: the device's time where the
    host's is hidden, not the host's and the device's one after the other. A verify step also costs what the
    drafter's proposals for it take (`proposal_costs(n)[d - 1]`, Drafter.proposal_costs: nextn's chain of d MTP
    steps), added to every verify shape of d drafts per request (to the shape of none that of d = 1: it stands for
    steps where only some requests draft), or, where an overlapped verify step replays graphs, what it does
    beyond the forward instead (`verify_overhead(n, rows per request)`, VerifyGraphs.overhead: the drafter's device
    half, its proposals included, the inputs and the acceptance), measured only at start-up (it replays those
    graphs).

    Every rank measures the same sizes at the same time (their collectives pair up: TP ranks schedule the same
    requests, so they ask for a size at the same step; under DP attention all sizes are measured at start-up,
    `eager`, as they are under the overlap schedule, where a step in flight must not see its graphs replayed) and keeps each shape's slowest rank, so every rank decides from the same numbers. Expert-load
    recording and the runner's hooks are off meanwhile: these steps serve no request."""
    pages = [kv.scratch_page] * kv.pages_for(CONTEXT + config.speculative_num_steps + 1)

    vocab = int(runner.model.hf_config["vocab_size"])

    def ids(count: int, first: int) -> list[int]:
        """Distinct token ids, spread over the vocabulary: a real batch's rows route to many experts (one id
        for every row sent them all to the same top-k experts, and priced a MoE step at a few experts' reads)."""
        return [(first + i) * 7919 % vocab for i in range(count)]

    def run(n: int, k: int, synchronous: bool = False) -> None:
        plain = k == 0
        seqs = []
        for i in range(n):
            if plain:
                seqs.append(ScheduledSeq(ids(1, i), CONTEXT, pages))
            elif decode_rows:
                seqs += [ScheduledSeq(ids(1, i * k + j), CONTEXT + j, pages) for j in range(k)]
            else:
                seqs.append(ScheduledSeq(ids(k, i * k), CONTEXT, pages))
        batch = build_forward_batch(seqs, kv, runner.device)
        batch = agree(batch if plain else attrs.evolve(batch, overlap_split=False))
        if plain:
            logits = runner.forward(batch)
            if overlap and not synchronous:
                logits = runner.forward(agree(build_forward_batch(seqs, kv, runner.device)))
        else:
            rows = to_device(batch.input_ids.device, torch.arange(n * k, dtype=torch.int64))[0]
            logits, _ = runner.verify_forward(batch, rows, with_hidden)
            if overlap_verify:
                torch.argmax(logits, dim=-1)  # the first step's acceptance, on the device
                again = agree(attrs.evolve(build_forward_batch(seqs, kv, runner.device), overlap_split=False))
                logits, _ = runner.verify_forward(again, rows, with_hidden)
        torch.argmax(logits, dim=-1).tolist()  # the host reads the tokens, as a step does

    def any_rank(flag: bool) -> bool:
        return any(row[0] for row in world.all_gather_ints([int(flag)]))

    slowest = slowest_of(world)

    def measure_size(n: int) -> list[float]:
        start = time.perf_counter()
        with _serving_nothing(runner):
            rows = config.speculative_num_steps + 1
            costs = time_size(n, rows, run, any_rank,
                              steps_per_run=[2 if overlap else 1] + [2 if overlap_verify else 1] * rows)
            proposing = list(proposal_costs(n))
            # a step that replays VerifyGraphs has the drafter's device half inside them: their timing holds it
            costs = costs[:1] + [c + (verify_overhead(n, k) or proposing[min(max(k - 2, 0), len(proposing) - 1)])
                                 for k, c in enumerate(costs[1:], start=1)]
        costs = slowest(costs)
        log.info("speculative step costs of %d requests (ms): plain %.3f, verify x1..x%d %s (measured in %.2f s)", n,
                 costs[0] * 1e3, len(costs) - 1, " ".join(f"{c * 1e3:.3f}" for c in costs[1:]),
                 time.perf_counter() - start)
        return costs

    def measure_break(n: int) -> float:
        """Seconds a break of the overlap schedule adds to a plain step of n requests: the step run and read before
        the next is built, against half of two launched back to back (interleaved rounds, best of each; 0.0 where
        verify steps do not overlap: there every step is read before the next)."""
        if not (overlap and overlap_verify):
            return 0.0
        with _serving_nothing(runner):  # shape 0: two plain steps back to back; shape 1: one, read at once
            best = slowest(time_size(n, 1, lambda n, k: run(n, 0, synchronous=k == 1), any_rank, steps_per_run=[2, 1]))
        log.info("a break of the overlap schedule at %d requests: %.3f ms (plain step %.3f ms, read at once %.3f ms)",
                 n, (best[1] - best[0]) * 1e3, best[0] * 1e3, best[1] * 1e3)
        return max(best[1] - best[0], 0.0)

    costs = StepCosts(grid_sizes(config.max_running_requests), measure_size, measure_break)
    if eager:
        costs.measure_all()
    return costs
