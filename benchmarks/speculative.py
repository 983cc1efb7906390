"""Speculative decoding: decode tokens/s with each drafter against no speculation, in one process.

    .venv/bin/python benchmarks/speculative.py --runs 3                         CPU, tiny DeepSeek-V3 (+ 1 MTP layer)
    python benchmarks/speculative.py --device cuda --runs 3                     H200: Qwen3-30B-A3B and DeepSeek-V3
                                                                                shapes (4 layers + MTP), dummy weights
    .venv/bin/python benchmarks/speculative.py --interleave --steady --runs 5   CPU, engines in turns (fair on a
                                                                                shared machine: see --interleave)
    python benchmarks/speculative.py --device cuda --only qwen --qwen-layers 12 --interleave --steady --runs 5
                                                                                H200, engines in turns (they must fit
                                                                                together: DeepSeek-V3's 4 layers + MTP
                                                                                are ~45 GB an engine, so Qwen only)

Drafters, every one greedy with ignore_eos (so every run does the same work and gives the same tokens):
- none: plain decoding, the reference of the ratio column; none/control: a second plain engine (an A/A control:
  its ratio to none is what the machine's noise alone does to a ratio);
- ngram: prompt lookup, on a repetitive workload: each prompt is a random 24-token phrase said 4 times, so the
  phrase's tokens are what ngram proposes; random weights do not repeat the phrase, so acceptance is whatever
  the model's own loops give (reported as the accept length column);
- ngram on a copy workload (--copy-edits; --no-copy leaves it out): a target of Qwen3-MoE shapes made to follow a
  fixed next-token map (make-model --synthetic-map; synthetic weights, every layer running at full cost) is given
  documents that walk its map with 10% of their tokens edited, then the document's first 4 tokens again; it copies
  the document on from there (summarizing, quoting and code editing repeat their input the same way), ngram
  drafts the document's next tokens and they miss where the copy reaches an edit: ngram's gain where it has one;
- oracle: proposes the continuation that `none` produced (tests/script_drafters.py, registered through an
  entry point): every draft accepted, the mechanism's ceiling at accept length steps + 1. On a GPU, bf16 logits
  of random weights are nearly flat and a verify batch of other shape flips near-ties, so a script from the
  plain run stops matching after a few tokens; there the oracle's verify step is forced to accept its drafts
  (the real verification still runs and is paid for: every step does the work of full acceptance);
- oracle-device: the oracle drafting on the device (test-oracle-device), so its verify steps run under the overlap
  schedule, as ngram's do: that mechanism's ceiling (on a GPU forced to accept in the overlapped step's graphs too);
- adversary: proposes a wrong token at every draft: accept length 1, the price of speculation that never pays;
- nextn (DeepSeek-V3 only): the checkpoint's MTP layer, random, so it accepts about nothing: its cost;
  and on a synthetic checkpoint (make-model --mtp-acceptance, docs/speculative.md) whose target follows a fixed
  next-token map and whose MTP layer's drafts are accepted at --mtp-acceptance per position (0.8: accept length
  about 3 with 3 steps): nextn's real gain, its own layer, KV and graphs running.
Every drafter runs under the adaptive policy (the default: drafts per request per step chosen from the step
costs the engine measured and each request's acceptance); a name with "/fixed" runs the fixed policy with backoff
(the previous default) and "/no-backoff" the fixed policy drafting every step, for comparison. The engine's cost
model is measured for every batch size before the clock starts (it would otherwise measure a size the first time
a step asks). The "never worse" rule: with speculation on, >= 0.97x of none at every batch for adversary, ngram and
nextn (random MTP).
Decode tokens/s counts the tokens generated after every request's first one (the prompts' step excluded),
over the wall time of those steps; median of --runs runs (one warmed-up engine per drafter, and --warmup-runs
unmeasured runs of it at each batch first), min-max beside it.
With --steady each batch slot gets 4 prompts in turn (a finished request is replaced at once), and the rate is
measured while the batch is full: serving's steady state, where a request whose drafts miss no longer holds a
shrinking batch open; the prompts' output lengths are spread over 0.5-1.5x --output-len (the same for every
engine), so plain decoding's requests end apart as a drafter's do and as served ones do. Its table adds the rate
over the decode-only steps (every step that scheduled a prompt, and the one after it, left out): at 32 and 64
requests on a GPU the admissions' prefills are about half of the steady rate's time (Qwen3 shapes: ~12 ms a step
of 32 tokens where a decode step takes ~5.4), and speculation speeds up only the rest.
SGLang's reported numbers for DeepSeek-V3 with its MTP layer on H200 (1.8x at batch 1, 1.5x at batch 32,
accept length 2.2-2.4) are printed beside the oracle and ngram rows: a trained MTP layer's ceiling vs ours.
"""

from __future__ import annotations

import argparse
import copy
import contextlib
import gc
import importlib
import os
import random
import statistics
import sys
import tempfile
import time

import attrs
import torch

from moeplex.config import EngineConfig
from moeplex.engine import Engine
from moeplex.models.make_model import write_checkpoint
from moeplex.models.setup import read_config
from moeplex.models.synthetic_mtp import next_token_map
from moeplex.sampling import SamplingParams
from moeplex.speculation import overlap as spec_overlap, step as spec_step, verify_graphs as spec_graphs
from report import emit, processor
from timing import CLOCK_HELP, CLOCKS, decode_rate, sync

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import script_drafters  # noqa: E402  (the test-only oracle and adversary)

SGLANG = {1: "1.8x", 32: "1.5x"}  # SGLang, DeepSeek-V3 + MTP (EAGLE), H200, as reported in its docs / blog
PHRASE, REPEATS = 24, 4
CUE = 4  # --copy: the document's first tokens, said again at the prompt's end
STEADY_WAVES = 4  # --steady: prompts per batch slot (--waves)


def workload(batch: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[256] + [rng.randrange(256) for _ in range(PHRASE)] * REPEATS for _ in range(batch)]


def copy_workload(batch: int, seed: int, follow: list[int], length: int, edits: float) -> list[list[int]]:
    """--copy: prompts for a synthetic-map target (make-model --synthetic-map), each a document of `length` tokens
    that walks the target's next-token map from a random token, a fraction `edits` of its tokens then replaced by
    random ones, followed by the document's first CUE tokens again: the target goes on copying the document (its
    map, from the cue's last token), ngram drafts the document's next tokens, and a draft misses where the copy
    reaches an edit (the document's token there is not the map's)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(batch):
        doc = [rng.randrange(len(follow))]
        while len(doc) < length:
            doc.append(follow[doc[-1]])
        doc = doc[:CUE] + [t if rng.random() >= edits else rng.randrange(len(follow)) for t in doc[CUE:]]
        prompts.append(doc + doc[:CUE])
    return prompts


NO_BACKOFF = "/no-backoff"  # a drafter name with this suffix runs the fixed policy without backoff
FIXED = "/fixed"  # ... the fixed policy with backoff
OVERLAP = "/overlap"  # ... the overlap schedule forced on (the default on a GPU only)
SYNC = "/sync"  # ... the overlap schedule off
CONTROL = "/control"  # "none/control": a second plain engine, the A/A control of a shared machine's noise
TABLE = "/table"  # ... the adaptive policy priced by the start-up table only (--disable-speculative-cost-calibration)
SUFFIXES = (NO_BACKOFF, FIXED, OVERLAP, SYNC, CONTROL, TABLE)
DEFAULT_DRAFTERS = ["none", "ngram", "test-oracle", "test-adversary"]


def drafter_name(drafter: str) -> str:
    """The --speculative-algorithm value of a drafter column (its suffixes, in any order, removed)."""
    while any(drafter.endswith(suffix) for suffix in SUFFIXES):
        drafter = next(drafter.removesuffix(s) for s in SUFFIXES if drafter.endswith(s))
    return drafter


def label_of(drafter: str) -> str:
    return (drafter.removeprefix("test-").replace(NO_BACKOFF, " (no backoff)").replace(FIXED, " (fixed)")
            .replace(OVERLAP, " (overlap)").replace(SYNC, " (no overlap)").replace(CONTROL, " (second engine)")
            .replace(TABLE, " (table only)"))


def engine_for(folder: str, args, drafter: str) -> Engine:
    prompt = prompt_len(args)
    settings = dict(model=folder, device=args.device, show_progress=False, max_running_requests=max(args.batches),
                    max_batched_tokens=max(args.batches) * prompt, chunked_prefill_size=4096,
                    max_total_tokens=max(args.batches) * (prompt + round(1.5 * args.output_len) + 16) + 1024)
    if args.device == "cpu":
        settings.update(dtype="fp32")
    else:
        # verify steps replay the decode graphs with one row per request and draft, prompts admitted beside them as
        # rows too: the engine sizes its largest graph for both itself (speculation/build.graph_rows)
        settings.update(dtype="bf16", load_format="dummy", moe_kernel="triton")
        if getattr(args, "cuda_graph_max_bs", None):
            settings.update(cuda_graph_max_bs=args.cuda_graph_max_bs)
    mixed = getattr(args, "mixed_chunk", "auto")  # (spec_host_profile.py builds its engines here too)
    if mixed != "auto":  # prompts inside decode steps (eager) or in steps of their own
        settings.update(mixed_chunk=mixed == "on")
    if OVERLAP in drafter or SYNC in drafter:
        settings.update(overlap_schedule=OVERLAP in drafter)
    if drafter_name(drafter) != "none":
        fixed = NO_BACKOFF in drafter or FIXED in drafter
        settings.update(speculative_algorithm=drafter_name(drafter), speculative_num_steps=args.steps,
                        speculative_policy="fixed" if fixed else "adaptive",
                        disable_speculative_backoff=NO_BACKOFF in drafter,
                        speculative_cost_calibration=TABLE not in drafter)
    with forced_acceptance(forced(drafter, args)):  # the overlapped verify step's graphs capture the forced accept
        engine = Engine(EngineConfig(**settings))
    costs = getattr(engine, "step_costs", None)
    if costs is not None and drafter_name(drafter) in ("ngram", "test-oracle", "test-oracle-device", "test-adversary",
                                                       "nextn"):
        costs.measure_all()  # before any clock starts
        print(f"# {drafter}: measured step costs (ms)\n{costs.table()}", flush=True)
    return engine


def prompt_len(args) -> int:
    """The longest prompt of either workload (the copy one's document covers the longest output)."""
    return max(PHRASE * REPEATS + 1, copy_length(args) + CUE if getattr(args, "copy", None) is not None else 0)


def copy_length(args) -> int:
    return round(1.5 * args.output_len) + 2 * CUE + args.steps


def forced(drafter: str, args) -> bool:
    """Whether the drafter's drafts are forced to be accepted (the oracles on a GPU: see the module docstring)."""
    return drafter_name(drafter) in ("test-oracle", "test-oracle-device") and args.device != "cpu"


@contextlib.contextmanager
def forced_acceptance(on: bool):
    """Every draft accepted, after the real verification ran (see the oracle above), on the synchronous path and in
    the overlapped verify step (eager or captured while this is on); off: unchanged."""
    real, real_accept = spec_step.verify, spec_overlap.accept

    def verify(logits, requests, drafts, draft_probs=None):
        tokens = real(logits, requests, drafts, draft_probs)
        return [[*d, t[-1]] if d else t for d, t in zip(drafts, tokens)]

    def accept(drawn, drafts, draft_counts):  # the target made to draw each verified draft
        k = torch.arange(drafts.shape[1], device=drawn.device)[None, :]
        agreed = torch.where(k < draft_counts[:, None], drafts, drawn[:, : drafts.shape[1]])
        return real_accept(torch.cat([agreed, drawn[:, drafts.shape[1]:]], dim=1), drafts, draft_counts)

    if on:
        spec_step.verify, script_drafters.FALLBACK = verify, True
        spec_overlap.accept = spec_graphs.accept = accept
    try:
        yield
    finally:
        spec_step.verify, script_drafters.FALLBACK = real, False
        spec_overlap.accept = spec_graphs.accept = real_accept





def steady_lengths(count: int, output_len: int, seed: int) -> list[int]:
    """--steady: each prompt's max_new_tokens, spread over 0.5 .. 1.5 x output_len (the same for every engine).
    With one length for all, plain decoding finishes a whole batch in one step and admits its successors in one
    prompt step, while a drafter's requests finish apart and each admission costs the batch a prompt step of its
    own: serving's requests end apart whatever decodes them."""
    rng = random.Random(seed)
    return [max(1, round(output_len * (0.5 + rng.random()))) for _ in range(count)]


def steady_rate(engine: Engine, prompts, params, batch: int, device: str, clock=time.perf_counter
                ) -> tuple[float, list, float]:
    """(decode tokens/s with `batch` requests always running, the finished requests, the same over the decode-only
    steps): each request that finishes is replaced by the next prompt; the clock runs from when the first `batch`
    requests all have their first token to when the last prompt is admitted, so the batch is full throughout
    (tokens of admitted requests' prefills count too, alike for every drafter). The decode-only rate leaves out
    every step that scheduled a prompt and the step after it (under the overlap schedule it reads the prompt's
    step): what speculation can speed up, where the whole rate also holds the admissions, which it cannot."""
    queue = list(zip(prompts, params))
    requests = [engine.add_request(*queue.pop(0)) for _ in range(batch)]
    start = stop = None
    counted = 0
    admitted: list[bool] = []  # whether the step now running scheduled a prompt
    schedule = engine.scheduler.schedule

    def watched():
        work = schedule()
        admitted.append(any(not spec_step.is_decoding(item) for item in work))
        return work

    engine.scheduler.schedule = watched
    clean_time, clean_tokens, touched_before, before = 0.0, 0, True, 0
    try:
        while engine.has_work:
            admitted.clear()
            began = clock()
            for _ in engine.step():
                if queue:
                    requests.append(engine.add_request(*queue.pop(0)))
            ended, touched = clock(), any(admitted)
            after = sum(len(r.output_ids) for r in requests)  # (one sum a step: the last step's is this one's before)
            if start is not None and stop is None and not (touched or touched_before):
                clean_time += ended - began
                clean_tokens += after - before
            touched_before, before = touched, after
            if start is None and all(r.output_ids for r in requests[:batch]):
                sync(device)
                start, counted = clock(), sum(len(r.output_ids) for r in requests)
            if start is not None and stop is None and not queue:
                sync(device)
                stop, counted = clock(), sum(len(r.output_ids) for r in requests) - counted
    finally:
        engine.scheduler.schedule = schedule
    return counted / (stop - start), requests, clean_tokens / clean_time if clean_time > 0 else 0.0


def measure(engine: Engine, drafter: str, batch: int, prompts, args, reference: dict
            ) -> tuple[float, float | None, float | None]:
    """One timed run of `engine` on a batch: (decode tokens/s, accept length or None, decode-only tokens/s with
    --steady or None). `none`'s first outputs per batch become the reference that the oracle proposes and that
    every drafter must reproduce (on CPU)."""
    params = SamplingParams(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    log_before = copy.deepcopy(engine.step_log)
    if drafter.startswith(("test-oracle", "test-adversary")):
        script_drafters.set_script([p + out for p, out in zip(prompts, reference[batch])])
    with forced_acceptance(forced(drafter, args)):
        if args.steady:
            per_prompt = [attrs.evolve(params, max_new_tokens=n)
                          for n in steady_lengths(len(prompts), args.output_len, seed=batch)]
            rate, done, clean = steady_rate(engine, prompts, per_prompt, batch, args.device, CLOCKS[args.clock])
        else:
            (rate, done), clean = decode_rate(engine, prompts, params, args.device, CLOCKS[args.clock]), None
    outputs = [r.output_ids for r in done]
    if drafter == "none":
        reference.setdefault(batch, outputs)
    elif outputs != reference[batch] and args.device == "cpu":  # bf16 GPU runs differ in near-ties
        raise AssertionError(f"{drafter} changed the output at batch {batch}")
    print(f"#   {drafter} at {batch}: {step_mix(log_before, engine)}", flush=True)
    steps = sum(r.spec_verify_steps for r in done)
    return rate, (sum(r.spec_accepted_tokens for r in done) + steps) / steps if steps else None, clean


def step_mix(before, engine: Engine) -> str:
    """The run's steps by kind (count x mean wall ms), the overlap schedule's breaks, and the verify costs', breaks'
    and mixed verify steps' scales the calibration reached (speculation/calibration.py; sizes where it moved the
    table)."""
    log = engine.step_log
    parts = [f"{kind} {log.steps[kind] - before.steps[kind]}x"
             f"{(log.seconds[kind] - before.seconds[kind]) * 1e3 / (log.steps[kind] - before.steps[kind]):.2f}ms"
             for kind in log.steps if log.steps[kind] > before.steps[kind]]
    parts += [f"breaks {reason} {log.breaks[reason] - before.breaks[reason]}" for reason in log.breaks
              if log.breaks[reason] > before.breaks[reason]]
    costs = getattr(engine, "step_costs", None)
    if costs is not None and costs.scales:
        parts.append("verify scales " + " ".join(f"{n}:{s:.2f}" for n, s in sorted(costs.scales.items())))
    if getattr(costs, "break_scales", None):  # (an earlier core, AB=1, has none)
        parts.append("break scales " + " ".join(f"{n}:{s:.2f}" for n, s in sorted(costs.break_scales.items())))
    if getattr(costs, "sync_scales", None):  # a mixed verify step's (StepCosts.sync_cost)
        parts.append("mixed verify scales " + " ".join(f"{n}:{s:.2f}" for n, s in sorted(costs.sync_scales.items())))
    return ", ".join(parts)


def warmed_engine(folder: str, args, drafter: str) -> Engine:
    engine = engine_for(folder, args, drafter)
    # warm-up: allocator, Triton compiles, graphs
    decode_rate(engine, workload(2, 99), SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True), args.device)
    return engine


def rows_for(name: str, folder: str, drafters: list[str], args, follow: list[int] | None = None) -> list[str]:
    """One engine at a time (on a GPU several real-shaped engines would not fit together), `none` first, each
    drafter's --runs runs back to back; or, with --interleave, every engine built and warmed once, then rounds in
    which every engine runs each batch once, the order rotated per round. With `follow` (a synthetic-map
    target's next-token map) the prompts are --copy's documents."""
    waves = args.waves if args.steady else 1
    if follow is None:
        workloads = {batch: workload(batch * waves, seed=batch) for batch in args.batches}
    else:
        workloads = {batch: copy_workload(batch * waves, batch, follow, copy_length(args), args.copy)
                     for batch in args.batches}
    rates: dict[tuple[str, int], list[float]] = {}
    clean: dict[tuple[str, int], list[float]] = {}  # decode-only rates (--steady)
    accept: dict[tuple[str, int], float | None] = {}
    reference: dict[int, list] = {}
    if args.interleave:
        engines = {drafter: warmed_engine(folder, args, drafter) for drafter in drafters}
        for batch, prompts in workloads.items():
            measure(engines["none"], "none", batch, prompts, args, reference)  # the reference; warms the batch
            for drafter in [d for d in drafters if d != "none"] * args.warmup_runs:
                measure(engines[drafter], drafter, batch, prompts, args, reference)
            for round in range(args.runs):
                order = drafters[round % len(drafters):] + drafters[: round % len(drafters)]
                for drafter in order:
                    rate, accept[drafter, batch], decode = measure(engines[drafter], drafter, batch, prompts, args,
                                                                   reference)
                    rates.setdefault((drafter, batch), []).append(rate)
                    clean.setdefault((drafter, batch), []).append(decode)
                    print(f"# batch {batch} round {round + 1} {drafter}: {rate:.1f} tok/s", flush=True)  # survives a kill
        del engines
    for drafter in drafters if not args.interleave else ():
        engine = warmed_engine(folder, args, drafter)
        for batch, prompts in workloads.items():
            for _ in range(args.warmup_runs):  # (none's first run at a batch is the reference, counted or not)
                measure(engine, drafter, batch, prompts, args, reference)
            for run in range(args.runs):
                rate, accept[drafter, batch], decode = measure(engine, drafter, batch, prompts, args, reference)
                rates.setdefault((drafter, batch), []).append(rate)
                clean.setdefault((drafter, batch), []).append(decode)
                print(f"# batch {batch} run {run + 1} {drafter}: {rate:.1f} tok/s", flush=True)  # survives a kill
        del engine
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return table_rows(name, drafters, args, rates, accept, clean)


def table_rows(name: str, drafters: list[str], args, rates: dict, accept: dict, clean: dict) -> list[str]:
    """Interleaved, the ratio is the median of the rounds' own ratios (each round's engines ran minutes apart at
    most), with their min-max. With --steady, the decode-only steps' rate and its ratio the same way."""
    lines = []
    for batch in args.batches:
        base = rates["none", batch]
        for drafter in drafters:
            r = rates[drafter, batch]
            med = statistics.median(r)
            length = f"{accept[drafter, batch]:.2f}" if accept[drafter, batch] is not None else "-"
            sglang = SGLANG.get(batch, "") if drafter in ("test-oracle", "ngram", "nextn") else ""
            label = label_of(drafter)
            if args.interleave:
                ratios = [a / b for a, b in zip(r, base)]
                ratio = f"{statistics.median(ratios):.2f}x | {min(ratios):.2f}-{max(ratios):.2f}"
            else:
                ratio = f"{med / statistics.median(base):.2f}x"
            decode = ""
            if args.steady:
                c, base_c = clean[drafter, batch], clean["none", batch]
                ratios = [a / b for a, b in zip(c, base_c)] if args.interleave else \
                    [statistics.median(c) / statistics.median(base_c)]
                decode = f" {statistics.median(c):.1f} | {statistics.median(ratios):.2f}x |"
            lines.append(f"| {name} | {batch} | {label} | {med:.1f} | {min(r):.1f}-{max(r):.1f} | {ratio} "
                         f"| {length} | {sglang} |{decode}")
            print(lines[-1], flush=True)
    return lines


def register_script_drafters() -> None:
    folder = tempfile.mkdtemp()
    from pathlib import Path

    script_drafters.write_distribution(Path(folder))
    sys.path.insert(0, folder)
    importlib.invalidate_caches()


def arguments() -> argparse.ArgumentParser:
    """This script's options; the profiling scripts built on it start from their defaults (with_defaults)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="default: 1 8 32 (CPU), 1 8 32 64 (GPU)")
    parser.add_argument("--drafters", nargs="+", default=None,
                        help=f"default: {' '.join(DEFAULT_DRAFTERS)} (+ nextn on DeepSeek-V3); none always runs "
                        f"first; a suffix {FIXED} or {NO_BACKOFF} picks the fixed policy, {OVERLAP} or {SYNC} turns the "
                             f"overlap schedule on or off, {TABLE} prices verify steps by the start-up table only")
    parser.add_argument("--steps", type=int, default=3, help="--speculative-num-steps (default: %(default)s)")
    parser.add_argument("--output-len", type=int, default=None, help="tokens per request (default: 32 CPU, 128 GPU)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--warmup-runs", type=int, default=1,
                        help="unmeasured runs of each engine at each batch first (default: %(default)s): its first "
                        "steps at a batch size compile kernels and its policy's records start empty")
    parser.add_argument("--only", choices=("qwen", "dsv3"), help="GPU: one model instead of both")
    parser.add_argument("--qwen-layers", type=int, default=48,
                        help="GPU: Qwen3-30B-A3B's decoder layers to build (default: all %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="CPU: torch threads (default: %(default)s; shared "
                        "cores make more threads wait on each other)")
    parser.add_argument("--dsv3-layers", type=int, default=4,
                        help="GPU: DeepSeek-V3's decoder layers to build (default: %(default)s; the first 3 dense)")
    parser.add_argument("--dsv3-experts", type=int, default=None,
                        help="GPU: DeepSeek-V3's routed experts per MoE layer (default: its 256). Fewer let more layers "
                        "fit one GPU: a decode row still reads 8 experts a layer, so at batch 1 a step reads what the "
                        "model's does and the MTP layer weighs what it weighs in the full model; batches of more rows "
                        "read fewer distinct experts than the full model's would")
    parser.add_argument("--synthetic-only", action="store_true",
                        help="GPU: DeepSeek-V3 with the synthetic MTP checkpoint only (not the random MTP weights)")
    parser.add_argument("--steady", action="store_true",
                        help="keep each batch full: --waves prompts per slot, a finished request replaced by the "
                        "next (serving's steady state); default: one batch run to completion, where the request whose "
                        "drafts land least sets the step count")
    parser.add_argument("--waves", type=int, default=STEADY_WAVES,
                        help="--steady: prompts per batch slot (default: %(default)s; more make each timed run longer, "
                        "which averages out a shared machine's bursts)")
    parser.add_argument("--mtp-acceptance", type=float, default=0.8,
                        help="per-position acceptance of the synthetic MTP checkpoint's drafts (default: %(default)s)")
    parser.add_argument("--copy-edits", type=float, default=0.1, metavar="RATE",
                        help="ngram's second workload: a synthetic-map target (make-model --synthetic-map: Qwen3 shapes "
                        "on a GPU, tiny Qwen3 on CPU) copying documents that walk its map, RATE of their tokens edited "
                        "(default: %(default)s; see copy_workload)")
    parser.add_argument("--no-copy", action="store_true", help="leave the copy workload out")
    parser.add_argument("--interleave", action="store_true",
                        help="build and warm every engine once, then --runs rounds in which every engine runs each "
                        "batch once, the order rotated per round; the ratio is the median of the rounds' ratios (a "
                        "shared machine's load drifts over minutes; the engines must fit in memory together)")
    parser.add_argument("--cuda-graph-max-bs", type=int, default=None, metavar="N",
                        help="GPU: the engines' --cuda-graph-max-bs (default: the engine's 256; a speculating engine "
                        "captures a full verify grid of the largest batch plus this many rows: the prompts a verify step "
                        "admits beside its rows, benchmarks/spec_admit_rows.py)")
    parser.add_argument("--mixed-chunk", choices=("auto", "on", "off"), default="auto",
                        help="the engines' --mixed-chunk (default: auto, the engine's own choice: mixed, where decode "
                        "replays graphs through prompt graphs, a speculating engine's mixed steps drafting nothing; "
                        "'on' lets them draft, 'off' gives prompts steps of their own)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help=CLOCK_HELP)
    parser.add_argument("--out", help="also write the table to this file")
    return parser


def with_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """`args` (another script's) with every option of this script it lacks at its default."""
    return argparse.Namespace(**{**vars(arguments().parse_args([])), **vars(args)})


def copy_rows(name: str, preset: str, overrides: dict, drafters: list[str], args) -> list[str]:
    """The copy workload's rows: a synthetic-map Qwen3-MoE (weights made from config.json on a GPU)."""
    folder = write_checkpoint(tempfile.mkdtemp(), "qwen3_moe", preset, seed=0, overrides=overrides,
                              config_only=args.device != "cpu", synthetic_map=True)
    follow = next_token_map(read_config(folder), seed=0)
    dtype = "fp32" if args.device == "cpu" else "bf16"
    return rows_for(f"{name}, synthetic map, copy ({args.copy:.0%} edited), {dtype}", folder, drafters, args, follow)


def main() -> None:
    parser = arguments()
    args = parser.parse_args()
    if args.clock == "cpu" and args.device != "cpu":
        parser.error("--clock cpu is for CPU runs: a GPU engine's time is the device's")
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    args.output_len = args.output_len or (32 if args.device == "cpu" else 128)
    args.batches = args.batches or ([1, 8, 32] if args.device == "cpu" else [1, 8, 32, 64])
    args.copy = None if args.no_copy else args.copy_edits
    register_script_drafters()
    chosen = args.drafters or DEFAULT_DRAFTERS + ["nextn"]
    plain = ["none"] + [d for d in chosen if d != "none" and drafter_name(d) != "nextn"]
    copying = ["none"] + [d for d in plain if drafter_name(d) in ("ngram", "test-oracle", "test-oracle-device")]
    if args.copy is None or copying == ["none"]:
        copying = []
    with_mtp = plain + [d for d in chosen if drafter_name(d) == "nextn"]
    mode = f"steady batches ({args.waves} prompts per slot)" if args.steady else "each batch run to completion"
    if args.interleave:
        mode += f"; interleaved: {args.runs} rounds, every engine once per round (order rotated)"
        ratio_head, ratio_rule = "vs none (median of rounds) | rounds' min-max", "---:|---:"
    else:
        ratio_head, ratio_rule = "vs none", "---:"
    if args.clock == "cpu":
        mode += "; rates per second of this process's CPU time"
    lines = [processor(), "",
             f"steps {args.steps}, {args.output_len} tokens per request, prompts of {PHRASE} tokens x {REPEATS}; {mode}"
             + (f"; copy rows: documents of {copy_length(args)} tokens walking the map, {args.copy:.0%} of them edited,"
                f" then their first {CUE} tokens" if copying else ""), "",
             f"| model | batch | drafter | decode tok/s (median) | min-max | {ratio_head} | accept length | SGLang H200 (reported) |"
             + (" decode-only steps: tok/s (median) | vs none |" if args.steady else ""),
             f"|---|---:|---|---:|---:|{ratio_rule}|---:|---:|" + ("---:|---:|" if args.steady else "")]
    if args.device == "cpu":
        folder = write_checkpoint(tempfile.mkdtemp(), "deepseek_v3", "tiny", seed=0, mtp=1)
        lines += rows_for("tiny DeepSeek-V3 + MTP, fp32", folder, with_mtp, args)
        if with_mtp != plain:
            synthetic = write_checkpoint(tempfile.mkdtemp(), "deepseek_v3", "tiny", seed=0, mtp=1,
                                         mtp_acceptance=args.mtp_acceptance)
            lines += rows_for(f"tiny DeepSeek-V3 + synthetic MTP ({args.mtp_acceptance}), fp32", synthetic,
                              ["none"] + with_mtp[len(plain):], args)
        if copying:
            lines += copy_rows("tiny Qwen3-MoE", "tiny", {}, copying, args)
    else:
        if args.only != "dsv3":
            qwen = write_checkpoint(tempfile.mkdtemp(), "qwen3_moe", "30b-a3b", config_only=True,
                                    overrides={"num_hidden_layers": args.qwen_layers})
            lines += rows_for(f"Qwen3-30B-A3B shapes ({args.qwen_layers} layers), bf16", qwen, plain, args)
            if copying:
                lines += copy_rows(f"Qwen3-30B-A3B shapes ({args.qwen_layers} layers)", "30b-a3b",
                                   {"num_hidden_layers": args.qwen_layers}, copying, args)
        if args.only != "qwen":
            shape = {"num_hidden_layers": args.dsv3_layers}
            name = f"DeepSeek-V3 shapes, {args.dsv3_layers} layers"
            if args.dsv3_experts:
                shape["n_routed_experts"] = args.dsv3_experts
                name += f" of {args.dsv3_experts} routed experts"
            if not args.synthetic_only:
                dsv3 = write_checkpoint(tempfile.mkdtemp(), "deepseek_v3", "v3", overrides=shape, config_only=True,
                                        mtp=1)
                lines += rows_for(f"{name} + MTP, bf16", dsv3, with_mtp, args)
            if with_mtp != plain:
                synthetic = write_checkpoint(tempfile.mkdtemp(), "deepseek_v3", "v3", overrides=shape,
                                             config_only=True, mtp=1, mtp_acceptance=args.mtp_acceptance)
                lines += rows_for(f"{name} + synthetic MTP ({args.mtp_acceptance}), bf16",
                                  synthetic, ["none"] + with_mtp[len(plain):], args)
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
