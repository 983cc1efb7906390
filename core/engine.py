"""Engine: schedule, run the model, post-process — one step at a time.

Under the overlap schedule (a CUDA engine, unless --disable-overlap-schedule) a step
schedules and launches the next batch before it reads the tokens of the batch before: the host's
work of step N+1 (scheduling, batch building, launching) runs while the GPU computes step N. A
request that stops in step N was already given a place in step N+1; that token is dropped, and its
pages are freed at once (the GPU runs steps in order, so step N+1's writes land before any later
owner's). A request whose next token is its last (max_new_tokens) is not scheduled again.

Speculative verify steps overlap the same way where the drafter drafts on the device (speculation/overlap.py):
step N + 1 is built from step N's accepted tokens on the device and launched before step N is read.

With several ranks the schedule is the same on each: the DP agreement of step N+1 (one collective
over the host group) reads only what the scheduler decided (token counts, modes, whether the batch
fits the graphs), never a token of step N, so it runs while the device still computes step N.
"""

from __future__ import annotations

import logging
import itertools
import os
import time
from typing import Iterable, Sequence

import attrs
import torch

from .config import EngineConfig
from .cuda_graph import decode_graphs
from .forward_batch import ForwardBatch
from .grammar.book import REJECTED, TERMINATED, GrammarBook
from .in_flight import InFlight
from .interfaces import BatchMeta
from .hooks import make_plugin_manager
from .json_file import read_json_object
from .kv_cache import KVPool
from .model_runner import ModelRunner
from .models.base import read_config
from .models.setup import load_model
from .moe.rebalance import ExpertBalancing, RebalanceReport
from .parallel import Group, ParallelState
from .prefix_cache import PrefixCache
from .disagg.rank import RankTransfers
from .progress import progress as progress_bar
from .request import FinishReason, Request, check_prompt
from . import prompt_logprobs
from .penalties import LogitAdjuster
from .sampler import FAILED, Sampler
from .sampling import SamplingParams
from .scheduler import Scheduler
from .speculation.build import build as build_speculation, graph_rows
from .speculation.engine_steps import SpeculativeSteps
from .speculation.overlap import VerifyInFlight
from .speculation.setup import check_drafter
from .speculation.step import is_decoding
from .step_agreement import Vote, agree
from .step_log import PROMPT_KINDS, VERIFY_KINDS, StepLog, launch_kind
from .selection import resolve
from .tokenizer import Detokenizer, load_tokenizer, text_while_running, whole_text
from .host_memory import keep_freed_host_memory
from .transfer import to_device

MAX_DEFAULT_KV_TOKENS = 1 << 17
PROGRESS_EVERY_S = 0.1  # how often generate() counts the tokens for its progress bar
SAMPLING_FAILED = "sampling failed: the model's logits for this request are not finite"

log = logging.getLogger(__name__)


def _eos_ids(folder: str, hf_config: dict) -> set[int]:
    path = os.path.join(folder, "generation_config.json")
    value = hf_config.get("eos_token_id")
    if os.path.exists(path):
        value = read_json_object(path, "generation_config.json").get("eos_token_id", value)
    if value is None:
        return set()
    return set(value) if isinstance(value, list) else {value}


def _kv_tokens(config: EngineConfig, bytes_per_token: int, device: torch.device) -> int:
    if config.max_total_tokens:
        return config.max_total_tokens
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(config.page_size, min(int(free * config.kv_memory_fraction) // bytes_per_token, MAX_DEFAULT_KV_TOKENS))


def _overlap_schedule(config: EngineConfig, device: torch.device) -> bool:
    """Whether steps overlap (the flag, or by default where it pays: on a CUDA device)."""
    if config.overlap_schedule is None:
        return device.type == "cuda"
    return config.overlap_schedule


class Engine(SpeculativeSteps):
    def __init__(self, config: EngineConfig, hooks=None, parallel: ParallelState | None = None):
        self.config = config
        self.device = torch.device(config.device)
        self.parallel = parallel if parallel is not None else ParallelState(config.parallel)
        self.hooks = hooks if hooks is not None else make_plugin_manager()
        selection = resolve(config, ep_size=self.parallel.ep.size)
        drafter_cls = check_drafter(config, selection, read_config(config.model))
        mtp = drafter_cls is not None and drafter_cls.caps.needs_weights  # the drafter runs the MTP layers
        self.model = load_model(config.model, config, selection, self.parallel, hooks=self.hooks, mtp=mtp)
        drafter = drafter_cls(config.speculative_num_steps) if drafter_cls is not None else None
        self.balancing = ExpertBalancing(
            self.model.moe_runtime, self.model.moe_layers(), selection.balancer(), config, self.parallel, self.hooks
        )
        shapes = self.model.kv_shapes()
        draft_shapes = drafter.kv_layers(self.model) if drafter is not None else []
        tokens = _kv_tokens(config, KVPool.bytes_per_token(shapes + draft_shapes, config.torch_dtype), self.device)
        self.kv = KVPool(
            -(-tokens // config.page_size), config.page_size, shapes + draft_shapes, config.torch_dtype, self.device
        )
        strategy = selection.overlap(min_tokens=config.overlap_min_tokens)
        hidden = drafter is not None and drafter.caps.needs_hidden
        self.overlap_schedule = _overlap_schedule(config, self.device)
        graphs = decode_graphs(config, self.model, self.kv, strategy, selection, self.parallel.config.world_size,
                               hidden, admit_rows=graph_rows(config, drafter_cls, self.overlap_schedule))
        # prompts share steps with decodes unless decode steps replay graphs and a mixed step would then run eagerly
        # for one prompt; with prompt graphs a mixed step whose rows fit replays a graph too (H100, steady decode at 16
        # with a 97-token arrival every 4 steps: 5740 tok/s mixed, 4955 separate). So does a speculating engine's,
        # whose mixed steps then draft nothing (`plain_mixed_steps`: SpeculativeSteps._mixed_plain says why): drafts
        # would make the step a synchronous verify step, and its overlapped verify steps take decoding requests only.
        mixed = config.mixed_chunk if config.mixed_chunk is not None else \
            graphs is None or not config.disable_prompt_graphs
        self.plain_mixed_steps = config.mixed_chunk is None and graphs is not None
        self.prefix_cache = None if config.disable_prefix_cache else PrefixCache(self.kv)
        self.scheduler = Scheduler(
            self.kv, config.max_running_requests, config.max_batched_tokens, config.chunked_prefill_size, mixed,
            self.prefix_cache, config.schedule_policy,
            # auto mixes where the step's rows replay a graph: at most the largest one's
            mixed_rows=graphs.sizes[-1] if self.plain_mixed_steps and mixed else None,
        )
        self.runner = ModelRunner(self.model, self.kv, strategy, self.device, self.hooks, graphs,
                                  prompt_graphs=not config.disable_prompt_graphs)
        # speculative decoding (core/speculation/build.py): its verify step, overlapped form, costs and calibration
        self.speculation = self.overlap_verify = self.step_costs = self.calibration = None
        if drafter is not None:
            parts = build_speculation(drafter, config, self.model, self.kv, self.runner, self.scheduler, self.device,
                                      self.parallel, graphs, range(len(shapes), len(self.kv.buffers)),
                                      self.overlap_schedule, self._agree)
            self.speculation, self.overlap_verify = parts.decoding, parts.overlap_verify
            self.step_costs, self.calibration = parts.step_costs, parts.calibration
        # prefill/decode disaggregation: this rank's transfer backend and the pages it holds or expects
        self.pd = RankTransfers.create(self) if config.disaggregation_mode != "none" else None
        self.in_flight: InFlight | None = None  # the step launched last, its tokens not read yet
        self.step_log = StepLog()  # steps by kind and overlap breaks (/metrics)
        self._read_early: list[Request] = []  # finished by a step in flight read before the next draw (grammar)
        self.tokenizer = load_tokenizer(config.model)
        self.eos_ids = _eos_ids(config.model, self.model.hf_config)
        self.vocab_size = self.model.hf_config["vocab_size"]
        self.sampler = Sampler(LogitAdjuster(self.vocab_size, self.device, self.eos_ids))
        # structured outputs: checked now (an unknown backend fails at start-up), built on the first constrained request;
        # the DP group's first rank fills the masks for its tensor-parallel ranks (with speculative decoding each rank
        # keeps its own matchers: every accepted draft token would otherwise cost one more collective)
        self.grammar = GrammarBook.named(
            config.grammar_backend, self.tokenizer, self.vocab_size, self.eos_ids, needs_rollback=self.speculation is not None,
            group=self.parallel.attn if self.speculation is None else Group(),
        )
        self._requests: dict[str, Request] = {}
        self._detok: dict[str, Detokenizer] = {}
        self._text_at_end: set[str] = set()  # requests whose text is decoded once, when they finish (offline)
        self._ids = itertools.count()
        torch.manual_seed(config.seed)
        if self.device.type == "cpu":
            keep_freed_host_memory()  # from here on (weights and KV pool placed), freed activations are reused
        self.hooks.hook.moeplex_engine_started(engine=self)

    # --- requests -------------------------------------------------------------------------------
    def add_request(
        self, prompt_ids: Sequence[int], params: SamplingParams, rid: str | None = None, room: int | None = None,
        stream_text: bool = True,
    ) -> Request:
        """Queue a request; `room`: its KV pages move under this bootstrap room (a prefill or decode engine).
        `stream_text` False: nobody reads request.text before the request finishes (offline generation; a served
        rank, whose front end makes the text it streams), so it is decoded then, in one call, instead of at every
        token; stop strings and a constraint that starts after some text still need it as it grows."""
        prompt_ids = list(prompt_ids)
        check_prompt(prompt_ids, self.vocab_size, self.kv.capacity_tokens)
        if params.prompt_logprobs is not None and (self.speculation is not None or self.pd is not None):
            raise ValueError("prompt logprobs are not computed with speculative decoding or disaggregation (as in vLLM)")
        if room is not None and self.pd is None:
            raise ValueError("a bootstrap room needs --disaggregation-mode prefill or decode")
        request = Request(rid if rid is not None else str(next(self._ids)), prompt_ids, params)
        if params.constraint is not None:
            self.grammar.add(request.rid, params.constraint, params.constraint_after)  # compiles during the prefill
        if room is None or self.pd.add(request, room):
            self.scheduler.add(request)
        self._requests[request.rid] = request
        if self.tokenizer is not None and (stream_text or text_while_running(params)):
            self._detok[request.rid] = Detokenizer(self.tokenizer, params.skip_special_tokens)
        elif self.tokenizer is not None:
            self._text_at_end.add(request.rid)
        return request

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"{self.config.model} has no tokenizer.json; pass token ids instead of text")
        return self.tokenizer.encode(text).ids

    def flush_cache(self) -> bool:
        """Empty the prefix cache (its pages back to the free list) unless a running request reads from it."""
        return self.prefix_cache.flush() if self.prefix_cache is not None else True

    def reset_prefix_cache(self) -> bool:
        """Flush the idle cache and zero its counters (after the warm-up, whose prompts are nobody's prefix);
        whether it was flushed."""
        if self.prefix_cache is not None and self.flush_cache():
            self.prefix_cache.reset_counters()
            return True
        return False

    def abort(self, rid: str) -> None:
        request = self._requests.get(rid)
        if request is not None and not request.finished:
            request.finish(FinishReason.ABORT)
            self._retire(request)
        elif self.pd is not None and rid in self.pd.held:  # prefilled, its pages held for a transfer
            self.pd.abort_held(rid)

    def fail(self, request: Request, reason: str | None) -> None:
        """End a request with an error the client is told (a KV transfer that failed)."""
        if not request.finished:
            request.finish(FinishReason.ABORT, error=reason or "the request failed")
            self._retire(request)

    def admit_transferred(self, request: Request, token: int, logprob: dict | None) -> None:
        """Decode: a request whose prompt KV has landed in its pages (num_cached set) gets its first token from the
        prefill server and then decodes like any other."""
        if logprob is not None:
            request.logprobs.append(logprob)
        if not self._append(request, token):
            self.scheduler.add_decoding(request)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self.in_flight is not None or (self.pd is not None and self.pd.has_work)

    def any_rank_has_work(self) -> bool:
        """Under DP attention, whether any rank still has requests (all ranks must keep stepping)."""
        if self.parallel.config.dp_size == 1:
            return self.has_work
        return any(row[0] for row in self.parallel.world.all_gather_ints([int(self.has_work)]))

    # --- expert load: with several ranks, every rank calls these between the same steps ----------
    def start_recording(self, mode: str | None = None) -> None:
        """Count the tokens routed to every expert from the next step on (stat, or per-step; default: the flag)."""
        self.balancing.start_recording(mode)

    def stop_recording(self) -> None:
        self.balancing.stop_recording()

    def dump_recording(self, path: str | None = None) -> dict:
        """The recorded expert load summed over the ranks, and the placement in force; rank 0 writes it to `path`."""
        return self.balancing.dump_recording(path)

    def rebalance(self, load: torch.Tensor | None = None) -> RebalanceReport:
        """Balance the recorded load (or `load`, [layers, experts]) and move the expert weights to match."""
        return self.balancing.rebalance(load)

    # --- the loop -------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one scheduled step; return the requests that finished (under the overlap schedule: whose
        tokens of the step before, read now, finished them)."""
        start = time.perf_counter()
        try:
            return self._step()
        finally:
            end = time.perf_counter()
            timed = self.step_log.timed(end - start, end)
            if self.calibration is not None:
                self.calibration.observe(timed)
            if self.speculation is not None:  # (a verify step under the overlap schedule that admitted goes on)
                self.speculation.stepped(timed.kind in PROMPT_KINDS or (timed.prompt and timed.kind == "verify"))
            if timed.wanted_drafts:  # (the step in flight was read for drafts: did a verify step come of it?)
                self.speculation.break_ended(timed.kind in VERIFY_KINDS)

    def _step(self) -> list[Request]:
        if self.pd is not None:
            self.pd.before_step()
        spec = self.speculation
        finished = []
        if isinstance(self.in_flight, VerifyInFlight):  # launch the next verify step before reading this one
            previous = self.in_flight
            self.in_flight = self.overlap_verify.follow(previous, self.scheduler, self.grammar.tracks, self.hooks)
            admitted = self._admit_ahead() if self.in_flight is None and self.scheduler.may_admit else None
            if self.in_flight is not None:
                self.balancing.after_forward()
                self.step_log.launched("verify_idle" if self.in_flight.idle else "verify_overlap", *self.in_flight.shape,
                                       prompt=self.in_flight.prompts > 0)
            elif admitted is None:
                self.step_log.broke("verify_run_ended")
            self._await_tokens(previous)
            finished = self.overlap_verify.read(previous, self.in_flight, self._append, self._fail, self.sampler)
            if self.in_flight is not None:
                return finished
            if admitted is not None:
                (self.in_flight,) = admitted
                return finished + self._drain_dropped()
        if spec is not None and self.in_flight is not None and not self._prompt_due():
            follows = self._follows_plain()  # (then entering a run breaks the overlap schedule only where it ends)
            if spec.wants_drafts(self.scheduler.running, breaks=1 if follows else 2):
                ahead = self._verify_ahead(follows)
                finished = self._complete(self.in_flight)  # the step in flight is read (after `ahead` launched)
                self.in_flight = ahead
                if ahead is not None:
                    return finished + self._drain_dropped()
                self.step_log.broke("drafts_wanted")
        if spec is not None:  # pages for drafts only where a draft could pay at this batch size (the policy says)
            self.scheduler.lookahead = spec.lookahead if spec.policy.may_draft(max(len(self.scheduler.running), 1)) else 0
        work = self.scheduler.schedule()
        finished += self._drain_dropped()
        if spec is not None:
            decoding = [item.request for item in work if is_decoding(item)]
            # (a request resumed fully cached may be due while a step is still in flight: it decodes plainly this once)
            if self.in_flight is None and self._verify_overlaps(work, decoding):
                if self._start_verify(decoding):  # else a plain step: the synchronous verify step costs far more
                    return finished
            elif self.in_flight is None and not self._mixed_plain(work, decoding) and spec.drafts_in(decoding):
                drafts = spec.draft(work)
                # a drafter asked first (cheap proposals) may have had nothing the policy keeps: then the step is a
                # plain one and takes the ordinary path (the verify path costs more)
                if any(drafts):
                    return finished + self._speculative_step(work, drafts)
            if decoding:
                spec.counts.step(())  # a decode step the policy left without drafts
        batch = self._agree(self.runner.prepare(work, self.in_flight))
        launched = self._launch(work, batch) if batch is not None else None
        finished += self._read_early
        self._read_early = []
        if self.overlap_schedule:
            launched, self.in_flight = self.in_flight, launched
        return finished + self._complete(launched)

    def _fail(self, request: Request) -> None:
        request.finish(FinishReason.ABORT, error=SAMPLING_FAILED)
        self._retire(request)

    def _launch(self, work, batch: ForwardBatch) -> InFlight | None:
        """Run the batch and sample on the device; the requests due a token hold a place for it."""
        self.hooks.hook.moeplex_batch_scheduled(batch=batch)
        self.step_log.launched(launch_kind(work), len(work), len(work))
        prompt_rows = prompt_logprobs.due_rows(work)
        extra_rows = [row for _, row, _ in prompt_rows]
        observed = None
        if self.speculation is not None and self.speculation.reads_plain_steps:  # the drafter reads hidden states
            logits, prompt_logits, hidden = self.runner.forward_with_hidden(batch, extra_rows)
            observed = self.speculation.plain_step(work, hidden)
        elif prompt_rows:
            logits, prompt_logits = self.runner.forward(batch, extra_rows)
        else:
            logits = self.runner.forward(batch)
        if prompt_rows:
            prompt_logprobs.record(prompt_rows, prompt_logits)
        self.balancing.after_forward()  # counts the step in the load recorders; may move experts between steps
        due = []
        for row, item in enumerate(work):
            request = item.request
            request.num_cached += item.num_tokens
            if request.num_cached >= len(request.prompt_ids):
                prompt_logprobs.finish_prompt(request)
            if request.num_cached <= len(request.prompt_ids):  # a prompt chunk: its pages may be shared now
                self.scheduler.cache_progress(request)
            if request.num_uncached == 0:
                due.append(row)
        if not due:
            if observed is not None:  # prompt chunks only: every token that follows them is known
                self.speculation.observe_plain(observed)
            return None
        requests = [work[row].request for row in due]
        if len(due) < len(work):  # some requests are mid-prompt
            logits = logits[to_device(logits.device, torch.tensor(due))[0]]
        if self.in_flight is not None and any(self.grammar.tracks(r.rid) for r in requests):
            # a constrained request's mask needs its matcher advanced by the token in flight: read it now, while the
            # device runs this step's forward (the mask is filled on the host meanwhile; only the draw waits for it)
            self._read_early, self.in_flight = self._complete(self.in_flight, fill_ahead=False), None
        logits = self.grammar.mask(logits, [r.rid for r in requests])  # structured outputs: forbidden tokens at -inf
        drawn = self.sampler.sample(logits, requests)  # penalties and biases, then the draw, all on the device
        for row, request in enumerate(requests):
            request.pending_rows.append(row)
        return InFlight.start(requests, logits, drawn, observed)

    def _complete(self, step: InFlight | None, fill_ahead: bool = True) -> list[Request]:
        """Read a launched step's tokens into its requests; those that finish with them. `fill_ahead`: the next
        masks may fill in the background (a step read early for its mask is masked right away: no point)."""
        if step is None:
            return []
        self._await_tokens(step)
        tokens = step.token_list()
        finished = []
        for row, request in enumerate(step.requests):
            if tokens[row] == FAILED and not request.finished:
                request.finish(FinishReason.ABORT, error=self.grammar.errors.get(request.rid, SAMPLING_FAILED))
                self._retire(request)
                finished.append(request)
        live = [row for row, request in enumerate(step.requests) if not request.finished]
        if any(step.requests[row].params.logprobs > 0 for row in live):
            requests = [step.requests[row] for row in live]
            self.sampler.record_logprobs(step.logits[live], requests, [tokens[row] for row in live])
        self.grammar.accept_step([step.requests[row].rid for row in live], [tokens[row] for row in live], fill_ahead)
        for row in live:
            request = step.requests[row]
            request.pending_rows.pop(0)
            if self._append(request, tokens[row]):
                finished.append(request)
        if step.observed is not None:
            self.speculation.observe_plain(step.observed)
        return finished

    def _await_tokens(self, step: InFlight | VerifyInFlight) -> None:
        """Wait for a launched step's tokens to reach the host, and tell the step log when they did (where the device
        runs ahead of the host: what a break exposes is the host work from then to the next launch)."""
        if step.ready is not None:
            step.ready.synchronize()
            self.step_log.arrived(time.perf_counter())

    def _agree(self, batch: ForwardBatch) -> ForwardBatch | None:
        """Under DP attention every rank learns every rank's token count in one small collective.

        All ranks then step together: one with nothing to do runs its IDLE batch (or, when the step
        replays graphs, the agreed size as padding) so the MoE layers' collectives never wait for it;
        when no rank has tokens, nobody runs.
        """
        if self.parallel.config.dp_size == 1:
            return batch if batch.num_tokens else None
        graphs = self.runner.graphs
        can_split = batch.overlap_split is not False and self.runner.strategy.cuts(BatchMeta(batch.mode, batch.extend_lens)) is not None
        can_graph = graphs is not None and graphs.fits(batch)
        vote = Vote(batch.num_tokens, batch.mode.is_extend, can_split, can_graph)
        agreed = agree(self.parallel.world.all_gather_ints(vote.row()), graphs.sizes if graphs is not None else ())
        if agreed is None:
            return None
        return attrs.evolve(
            batch, global_num_tokens=agreed.counts, overlap_split=agreed.split, global_all_decode=agreed.all_decode,
            graph_size=agreed.graph_size,
        )

    def _drain_dropped(self) -> list[Request]:
        dropped, self.scheduler.dropped = self.scheduler.dropped, []
        for request in dropped:
            self._retire(request)
        return dropped

    def _append(self, request: Request, token: int) -> bool:
        request.output_ids.append(token)
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
        params = request.params
        detok = self._detok.get(request.rid)
        grown_from = len(request.text)
        if detok is not None:
            request.text += detok.push(token)
        grammar = self.grammar.accept(request.rid, token, request.text)
        stops_count = len(request.output_ids) >= params.min_tokens  # before min_tokens, nothing but the length stops it
        if grammar == REJECTED:
            request.finish(FinishReason.ABORT, error=f"token {token} breaks the request's structured-output constraint")
        elif stops_count and (token in params.stop_token_ids or (token in self.eos_ids and not params.ignore_eos)):
            request.finish(FinishReason.STOP, stop_reason=token)
        elif grammar == TERMINATED:  # the constrained output is complete: nothing else may follow
            request.finish(FinishReason.STOP)
        elif stops_count and detok is not None and params.stop and self._hit_stop_string(request, grown_from):
            pass
        elif len(request.output_ids) >= params.max_new_tokens:
            request.finish(FinishReason.LENGTH)
        if request.finished:
            self._retire(request)
        return request.finished

    @staticmethod
    def _hit_stop_string(request: Request, grown_from: int) -> bool:
        """Whether the text gained from `grown_from` on completes a stop string; the text is cut at the
        earliest. Only the new text and the few characters before it are searched: O(new text) a step."""
        hits = []
        for stop in request.params.stop:
            at = request.text.find(stop, max(0, grown_from - len(stop) + 1))
            if at >= 0:
                hits.append((at, stop))
        if not hits:
            return False
        at, stop = min(hits, key=lambda hit: hit[0])
        request.text = request.text[: at + len(stop) if request.params.include_stop_str_in_output else at]
        request.finish(FinishReason.STOP, stop_reason=stop)
        return True

    def _retire(self, request: Request) -> None:
        request.pending_rows.clear()  # a token still in flight comes too late
        if self.pd is None or not self.pd.on_retire(request):  # a prefilled request may keep its pages for a transfer
            self.scheduler.finish(request)
        if self.speculation is not None:
            self.speculation.finished(request)
        self.sampler.release(request)
        self.grammar.finished(request.rid)
        self._requests.pop(request.rid, None)
        detok = self._detok.pop(request.rid, None)
        if detok is not None and request.finish_reason != FinishReason.STOP:
            request.text += detok.flush()
        if request.rid in self._text_at_end:
            self._text_at_end.discard(request.rid)
            request.text = whole_text(self.tokenizer, request.output_ids, request.params.skip_special_tokens,
                                      stopped=request.finish_reason == FinishReason.STOP)
        self.hooks.hook.moeplex_request_finished(request=request)

    def generate(
        self, prompts: Iterable[Sequence[int]], params: SamplingParams | Sequence[SamplingParams], progress: bool | None = None
    ) -> list[Request]:
        """Run prompts to completion; results in prompt order. The step loop does no more per step than a served
        engine's: each request's text is decoded once, when it finishes (unless stop strings need it sooner), and the
        progress bar counts the tokens a few times a second, not at every step."""
        prompts = list(prompts)
        params = params if isinstance(params, Sequence) else [params] * len(prompts)
        requests = [self.add_request(p, sp, stream_text=False) for p, sp in zip(prompts, params)]
        show = self.config.show_progress if progress is None else progress
        total = sum(sp.max_new_tokens for sp in params[: len(requests)])
        with progress_bar(desc="generating", unit="tok", total=total, enabled=show) as bar:
            shown_at = time.monotonic()
            while self.any_rank_has_work():
                self.step()
                if show and time.monotonic() - shown_at >= PROGRESS_EVERY_S:  # counting is O(requests)
                    shown_at = time.monotonic()
                    bar.update(sum(len(r.output_ids) for r in requests) - bar.n)
            if show:
                bar.update(sum(len(r.output_ids) for r in requests) - bar.n)
        return requests
