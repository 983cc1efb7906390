"""Speculative decoding's parts for one engine: the verify step, its overlapped form, the step costs and their
calibration, made from the drafter and the engine's pieces once they exist (Engine.__init__ calls `build`)."""

from __future__ import annotations

from typing import Callable

import attrs

from ..cuda_graph import CudaGraphCapture
from .calibration import Calibration
from .costs import StepCosts
from .overlap import OverlapVerify
from .policy import AdaptivePolicy, FixedPolicy
from .setup import drafter_context, measure_step_costs, slowest_of
from .step import SpeculativeDecoding, observes
from .verify_graphs import verify_graphs


@attrs.frozen
class Speculation:
    decoding: SpeculativeDecoding
    overlap_verify: OverlapVerify | None  # verify steps under the overlap schedule (speculation/overlap.py)
    step_costs: StepCosts | None  # the adaptive policy's cost model
    calibration: Calibration | None  # the table scaled to what serving measures


def build(drafter, config, model, kv, runner, scheduler, device, parallel, graphs, draft_layers: range,
          overlap_schedule: bool, agree: Callable) -> Speculation:
    """Bind the drafter (its KV in pool layers `draft_layers`) and make the parts around it. Steps that draft run
    without the overlap schedule where the drafter drafts on the host (their drafts need the tokens accepted before
    them); the steps between them overlap (a drafter that reads hidden states observes them one step late)."""
    vocab = model.hf_config["vocab_size"]
    speculation = SpeculativeDecoding(
        drafter, kv, vocab, decode_rows=model.attention_backend.graph_safe,
        policy=FixedPolicy(drafter.num_steps, backoff=not config.disable_speculative_backoff),
        name=config.speculative_algorithm,
    )
    drafter.bind(drafter_context(model, kv, config, device, draft_layers, graphs, parallel.config.world_size))
    scheduler.lookahead = speculation.lookahead
    overlap_verify = None
    ragged = not model.attention_backend.graph_safe
    if overlap_schedule and verifies_overlapped(type(drafter), config) and not (ragged and device.type == "cuda"):
        overlap_verify = OverlapVerify(speculation, runner, kv, device, ragged, scheduler.draft_pages)
        if graphs is not None:  # its greedy steps as graph replays (speculation/verify_graphs.py)
            overlap_verify.graphs = verify_graphs(drafter, graphs, vocab, config.max_running_requests,
                                                  CudaGraphCapture(device))
        overlap_verify.admit_rows = admit_rows(scheduler, graphs, runner.prompt_graphs)
    step_costs = calibration = None
    if config.speculative_policy == "adaptive":
        step_costs = measure_step_costs(
            runner, kv, config, speculation.decode_rows, drafter.caps.needs_hidden, agree, parallel.world,
            overlap=overlap_schedule,
            # all sizes now where a step may be in flight when a size is first asked for (its graph outputs must
            # not be overwritten), or where DP ranks would ask for different sizes
            eager=overlap_schedule or parallel.config.dp_size > 1,
            overlap_verify=overlap_verify is not None, proposal_costs=drafter.proposal_costs,
            verify_overhead=overlap_verify.overhead if overlap_verify is not None else lambda n, rows: 0.0,
        )
        speculation.policy = AdaptivePolicy(drafter.num_steps, step_costs)
        # the table scaled to what verify steps take while serving (DP ranks step apart: their timings cannot agree)
        if config.speculative_cost_calibration and parallel.config.dp_size == 1:
            calibration = Calibration(step_costs, slowest_of(parallel.world),
                                      isolated=overlap_schedule and overlap_verify is None)
    return Speculation(speculation, overlap_verify, step_costs, calibration)


def verifies_overlapped(drafter_cls, config) -> bool:
    """Whether this drafter's verify steps run under the overlap schedule (where it is on): it drafts on the
    device, and one that observes drafts from the hidden rows of the step before (it observes only a run's last
    step); one DP group (DP ranks step apart). (An attention backend that reads flattened KV indices would need a
    host sync per step to shift them on a GPU: `build` checks that.)"""
    caps = drafter_cls.caps
    return caps.drafts_on_device and (caps.needs_hidden or not observes(drafter_cls)) and config.parallel.dp_size == 1


def graph_rows(config, drafter_cls, overlap_schedule: bool) -> int:
    """The rows of the largest decode graph a speculating engine captures for verify steps that admit prompts
    (`admit_rows`), or 0 where none does: a full grid of verify rows (--max-running-requests x (steps + 1)) with
    --cuda-graph-max-bs rows of prompts beside it. Its largest graph otherwise bounds the grid and the prompts
    together, and where fewer prompts fit than requests end, the batch empties (session 29, counted by
    benchmarks/spec_admit_rows.py with 97-token prompts and ~64-token outputs: at 32 requests a largest graph of
    256 rows kept 23.9 running, 384 kept 30.3; at 64 on the defaults no prompt fits beside the grid and 56 of 77
    steps were synchronous verify steps, 512 rows kept 55.6 running, 768 kept 61.6)."""
    if drafter_cls is None or not overlap_schedule or not verifies_overlapped(drafter_cls, config) or \
            config.disable_prompt_graphs or config.mixed_chunk is False:
        return 0
    return config.max_running_requests * (config.speculative_num_steps + 1) + config.cuda_graph_max_bs


def admit_rows(scheduler, graphs, prompt_graphs: bool) -> int | None:
    """The most rows of a verify step under the overlap schedule that admits requests with their whole prompt
    (OverlapVerify.follow), or None where admissions end a run of verify steps. Its prompt tokens are decode rows
    beside the verify rows: where decode steps replay graphs, as many as the largest graph holds (a step of more
    would run eagerly), and none where a captured size is split into micro-batches (a cut between a prompt's rows
    would read KV its other half has not written) or prompts never run as rows. None where prompts and decodes take
    separate steps (--mixed-chunk off), and none without graphs: on a CPU a prompt's tokens as decode rows cost more
    than as an extend, and a break leaves no device waiting (session 28, tiny DeepSeek-V3 with nextn and the overlap
    schedule forced on: a steady run's steps took 7-16% longer at 1, 8 and 16 requests with admissions beside).

    Why (DeepSeek-V3 shapes, 24 layers of 16 experts, nextn at steady 32 on an H100, session 27): with requests
    ending at ~1.5 a verify step, an admission was due at nearly every step, and each ended the run: the verify
    step read, a plain mixed step of every request (1 token each, 23.5 ms) or a synchronous mixed verify step
    (64 ms), and the break after it, where an overlapped verify step takes 28 ms for ~2.9 tokens a request."""
    if not scheduler.mixed or graphs is None or not prompt_graphs or \
            any(graphs.cuts.get(size) is not None for size in graphs.sizes):
        return None
    return graphs.sizes[-1]
