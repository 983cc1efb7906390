"""An overlapped verify step's device work in CUDA graphs: a handful of replays and two small copies per step.

OverlapVerify.launch builds a verify step from tensors with dozens of small ops (drafting, the grid, the batch,
the shift by step N's emitted counts, the draw, acceptance, packing): on a GPU their launches cost the host far
more than the step's kernels take. Here the same work runs as graphs, per padded request count R and grid width
W (rows per request), over static tensors:

  host   one copy of per-request integers (the previous step's row, the drafts chosen, the last token where
         the host knows it, the first position) and one of the page table; the drafter's `stage` (its known ids)
  "pre"  the drafter's StaticProposer on the previous step's accepted tokens (gathered by the row map), the
         grid and its checks, and the decode graphs' static inputs (DecodeInputs) written directly: ids,
         positions shifted by the emitted counts, KV slots from the page table, padding rows up to the
         decode graph's size S (requests beyond the live ones decode in the pool's scratch page)
  forward the target's decode graph of S rows (no `load` copies); a step that admits requests (OverlapVerify.follow)
         has their prompts' rows written after the grid by the host (ExtraRows) and replays the decode graph that
         holds them all, the grid's outputs copied to graph S's for "post"
  "post" greedy draw (argmax, finite check), acceptance, the accepted state the next "pre" reads, the
         packed [R, 3 + W] rows the host reads (VerifyInFlight.read: the same rows as the eager path)
  host   one copy of the packed rows into pinned memory and an event

Only greedy steps take this path: a sampled row draws with multinomial from filtered probabilities, whose filters
read host values; such a step (and one whose shapes no graph holds, or while expert load is recorded) runs
OverlapVerify's eager path. `capture` turns a step function into a replay function (CudaGraphCapture on the GPU;
CPU tests pass one that runs the function again into the tensors its first run returned, as a graph's static
outputs behave).
"""

from __future__ import annotations

import logging
import time
from typing import Sequence

import numpy as np
import torch

from ..cuda_graph import Capture, DecodeGraphs, capture_sizes, padded_size
from ..interfaces import DeviceTokens, StaticProposer
from ..sampler import FAILED, Sampler
from .accept import Accepted, accept
from .overlap import host_last_tokens

log = logging.getLogger(__name__)

PREVIOUS, CHOSEN, LAST, START = range(4)  # the staged integers' columns, per request


class VerifyGraphs:
    """The pre and post graphs of every captured (R, W), their static inputs, and the accepted state between steps."""

    def __init__(self, graphs: DecodeGraphs, proposer: StaticProposer, steps: int, vocab_size: int, max_requests: int,
                 capture: Capture, with_hidden: bool = False):
        inputs = graphs.inputs
        device = inputs.input_ids.device
        self.graphs, self.proposer, self.steps, self.vocab_size = graphs, proposer, steps, vocab_size
        self.request_sizes = capture_sizes(min(max_requests, graphs.sizes[-1]))
        max_rows = self.request_sizes[-1]

        def ints(*shape, dtype=torch.int64):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.staged = ints(max_rows, 4)
        self.table = ints(max_rows, inputs.max_pages, dtype=torch.int32)
        self.state_tokens, self.state_counts = ints(max_rows, steps + 1), ints(max_rows)  # the last step's accepted
        self.proposed, self.verified, self.grid = ints(max_rows), ints(max_rows), ints(max_rows, steps)
        self.packed = ints(max_rows * (3 + steps + 1))  # [R, 3 + W] at its start: the live rows' part is contiguous
        # the last step's hidden rows [R, steps + 1, H], for a proposer that drafts from them (nextn): allocated
        # below from the first forward's (before any "pre" that reads it is captured)
        self.state_hidden = None
        self.pre: dict[tuple[int, int], object] = {}
        self.post: dict[tuple[int, int], object] = {}
        self.forward_size: dict[tuple[int, int], int] = {}
        self.batches = {}  # per decode graph size: its static batch, for the hooks
        # per decode graph size, its static output (replayed once: padding inputs, KV to the scratch page)
        self.outputs = logits = {}
        with torch.inference_mode():
            for rows in sorted(self.request_sizes, reverse=True):
                for width in range(1, steps + 2):
                    size = padded_size(rows * width, graphs.sizes)
                    if size is None:
                        continue
                    if size not in logits:
                        logits[size], self.batches[size] = graphs.replay_loaded(size, with_hidden), inputs.batch(size)
                        if with_hidden and self.state_hidden is None:  # (a normal tensor, as the state above)
                            hidden = logits[size][1]
                            with torch.inference_mode(False):
                                self.state_hidden = torch.zeros(max_rows, steps + 1, hidden.shape[1],
                                                                dtype=hidden.dtype, device=device)
                    self.forward_size[rows, width] = size
                    self.pre[rows, width] = capture(lambda r=rows, w=width, s=size: self._pre(r, w, s))
                    self.post[rows, width] = capture(lambda r=rows, w=width, x=logits[size]: self._post(r, w, x))

    # --- the graphed steps ------------------------------------------------------------------------
    def _pre(self, rows: int, width: int, size: int) -> None:
        """Drafts and the decode graph's static inputs for `rows` staged requests of `width` rows each."""
        inputs, page = self.graphs.inputs, self.graphs.inputs.page_size
        staged = self.staged[:rows]
        previous, chosen, host_last, start = staged.unbind(1)
        had = previous >= 0
        at = previous.clamp_min(0)
        counts, pending = self.state_counts[at], self.state_tokens[at]
        emitted = torch.where(had, counts + 1, 0)
        last = torch.where(had, pending.gather(1, counts[:, None])[:, 0].clamp_min(0), host_last)
        hidden = self.state_hidden[at] if self.state_hidden is not None else None
        drafts = self.proposer.propose(DeviceTokens(pending, emitted, hidden, width - 1))
        verified = torch.minimum(drafts.counts, chosen)
        grid = drafts.tokens[:, : width - 1]
        k = torch.arange(width - 1, device=grid.device)[None, :]
        bad = ((grid < 0) | (grid >= self.vocab_size)) & (k < verified[:, None])  # voids the request's drafts
        verified = torch.where(bad.any(dim=1), 0, verified)
        grid = torch.where(k < verified[:, None], grid, -1)
        positions = ((start + emitted)[:, None] + torch.arange(width, device=grid.device)[None, :]).flatten()
        table = self.table[:rows].repeat_interleave(width, dim=0)
        n = rows * width
        inputs.input_ids[:n].copy_(torch.cat([last[:, None], grid.clamp_min(0)], dim=1).flatten())
        inputs.positions[:n].copy_(positions)
        inputs.seq_lens[:n].copy_(positions + 1)
        inputs.out_cache_loc[:n].copy_(table.gather(1, (positions // page)[:, None])[:, 0].to(torch.int64) * page
                                       + positions % page)
        inputs.page_table[:n].copy_(table)
        inputs.pad(n, size)
        self.proposed[:rows].copy_(drafts.counts)
        self.verified[:rows].copy_(verified)
        self.grid[:rows, : width - 1].copy_(grid)

    def _post(self, rows: int, width: int, out) -> None:
        """The greedy draw, acceptance, the accepted state and the packed rows, from the forward's static logits
        (and hidden rows, kept for the next step's proposer where it reads them)."""
        logits = out
        if self.state_hidden is not None:
            logits, hidden = out
            self.state_hidden[:rows, :width].copy_(hidden[: rows * width].view(rows, width, -1))
        tokens, failed = Sampler.greedy(logits[: rows * width])
        drawn = torch.where(failed, FAILED, tokens).view(rows, width)
        verified = self.verified[:rows]
        accepted = accept(drawn, self.grid[:rows, : width - 1], verified)
        self.state_tokens[:rows, :width].copy_(accepted.tokens)
        self.state_counts[:rows].copy_(accepted.counts)
        self.packed[: rows * (3 + width)].view(rows, 3 + width).copy_(torch.cat(
            [self.proposed[:rows, None], verified[:, None], accepted.counts[:, None], accepted.tokens], dim=1))

    # --- per step -----------------------------------------------------------------------------------
    def shape_for(self, requests: Sequence, width: int, records_load: bool) -> tuple[int, int] | None:
        """The captured (R, W) a step of these requests replays, or None (its eager path)."""
        rows = padded_size(len(requests), self.request_sizes)
        if rows is None or (rows, width) not in self.pre or records_load or not self.proposer.replayable():
            return None
        if not all(r.params.greedy for r in requests):
            return None
        if max(len(r.pages) for r in requests) > self.graphs.inputs.max_pages:
            return None
        return rows, width

    def overhead(self, requests: int, width: int, rounds: int = 5, repeat: int = 4) -> float:
        """Seconds a graphed step of `requests` requests x `width` rows spends in its pre and post replays (drafting,
        inputs, acceptance): what it costs beyond the target's forward, for the policy's step costs. Padding rows
        only (nothing staged of any request), so call it only while no step is in flight (start-up); best of
        `rounds` timings of `repeat` back-to-back replays. 0.0 for a shape no graph holds (its eager path)."""
        rows = padded_size(requests, self.request_sizes)
        shape = (rows, width)
        if rows is None or shape not in self.pre:
            return 0.0
        inputs = self.graphs.inputs
        self.staged[:rows].copy_(torch.tensor([[-1, 0, 0, 0]] * rows, dtype=torch.int64))
        self.table[:rows].fill_(inputs.scratch_page)
        self.proposer.stage([], rows)
        device = inputs.input_ids.device

        def wait():
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        best = float("inf")
        for round in range(rounds + 1):  # (round 0 is a warm-up)
            wait()
            start = time.perf_counter()
            for _ in range(repeat):
                self.pre[shape]()
                self.post[shape]()
            wait()
            if round:
                best = min(best, (time.perf_counter() - start) / repeat)
        return best

    def carry(self, accepted: Accepted, hidden: torch.Tensor | None = None) -> None:
        """Make an eagerly launched step's accepted tokens (and hidden rows) the state the next "pre" reads."""
        count, width = accepted.tokens.shape
        self.state_tokens[:count, :width].copy_(accepted.tokens)
        self.state_counts[:count].copy_(accepted.counts)
        if self.state_hidden is not None and hidden is not None:
            self.state_hidden[:count, :width].copy_(hidden)

    def extra_rows(self, rows: Sequence[tuple[int, int, Sequence[int]]]) -> ExtraRows:
        """(token id, position, pages) per row, as ExtraRows for `launch`."""
        return ExtraRows(rows, self.graphs.inputs.page_size)

    def holds(self, shape: tuple[int, int], extra: int) -> bool:
        """Whether a step of `shape` holds `extra` more decode rows after its grid (a decode graph of them all)."""
        return padded_size(shape[0] * shape[1] + extra, self.graphs.sizes) is not None

    def launch(self, shape: tuple[int, int], requests: Sequence, counts: Sequence[int], previous_rows: Sequence[int],
               drafter_requests, runner, hooks=None, starts: Sequence[int] | None = None, extra=None
               ) -> tuple[Accepted, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Stage, replay pre / forward / post; (the accepted state's view, the packed rows on the device, the hidden
        rows' state view or None, `extra`'s hidden rows or None).
        previous_rows[i]: request i's row in the step before (its tokens in the accepted state), or -1 (its last
        token is on the host); starts[i]: where its rows start before the shift by what that step emitted (default:
        its num_cached). `extra` (ExtraRows): decode rows at known positions after the grid (admitted prompts'),
        written into the static inputs after "pre"; the forward then replays the decode graph that holds them all,
        and the grid's logits (and hidden rows) are copied to where "post" reads them where that graph is larger."""
        rows, width = shape
        count, inputs = len(requests), self.graphs.inputs
        staged = np.zeros((rows, 4), dtype=np.int64)
        staged[:, PREVIOUS] = -1
        staged[:count, CHOSEN] = counts
        staged[:count, START] = starts if starts is not None else [r.num_cached for r in requests]
        staged[:count, PREVIOUS] = previous_rows
        staged[:count, LAST] = host_last_tokens(requests, previous_rows)
        pages = max(max(len(r.pages) for r in requests), -(-width // inputs.page_size))
        table = np.zeros((rows, pages), dtype=np.int32)
        for i, r in enumerate(requests):
            table[i, : len(r.pages)] = r.pages
        table[count:] = inputs.scratch_page  # padding requests: `width` rows from position 0 in the scratch page
        self.staged[:rows].copy_(_pinned(torch.from_numpy(staged), inputs), non_blocking=True)
        self.table[:rows, :pages].copy_(_pinned(torch.from_numpy(table), inputs), non_blocking=True)
        self.proposer.stage(drafter_requests, rows)
        size = self.forward_size[shape]
        self.pre[shape]()
        extra_hidden = None
        if extra is None:
            batch = self.batches[size]
            if hooks is not None:
                hooks.hook.moeplex_batch_scheduled(batch=batch)
            runner.replay_verify(size, batch)
        else:
            extra_hidden = self._forward_with(extra, rows * width, size, runner, hooks)
        self.post[shape]()
        packed = self.packed[: count * (3 + width)].view(count, 3 + width)
        hidden = self.state_hidden[:count, :width] if self.state_hidden is not None else None
        return Accepted(self.state_counts[:count], self.state_tokens[:count, :width]), packed, hidden, extra_hidden

    def _forward_with(self, extra, grid: int, size: int, runner, hooks) -> torch.Tensor | None:
        """The forward of a step whose `grid` rows "pre" wrote, with `extra`'s rows after them: the decode graph
        holding them all, its grid rows' outputs copied into the graph of `size` ("post" reads those); the extra
        rows' hidden states (a copy) where the graphs return them."""
        inputs = self.graphs.inputs
        total = padded_size(grid + extra.count, self.graphs.sizes)
        extra.write(inputs, grid)
        if total > max(size, grid + extra.count):  # ("pre" padded its rows up to `size`)
            inputs.pad(max(size, grid + extra.count), total)
        if total not in self.batches:
            self.batches[total] = inputs.batch(total)
        if hooks is not None:
            hooks.hook.moeplex_batch_scheduled(batch=self.batches[total])
        out = runner.replay_verify(total, self.batches[total], with_hidden=self.state_hidden is not None)
        if total != size:
            for kept, fresh in zip(_parts(self.outputs[size]), _parts(out)):
                kept[:grid].copy_(fresh[:grid])
        return _parts(out)[1][grid : grid + extra.count].clone() if self.state_hidden is not None else None


class ExtraRows:
    """Decode rows at positions the host knows (an admitted prompt's tokens), for VerifyGraphs.launch: built on the
    host, copied into the decode graphs' static inputs after the rows "pre" wrote."""

    def __init__(self, rows: Sequence[tuple[int, int, Sequence[int]]], page_size: int):
        """rows: (token id, position, the sequence's pages) per row."""
        self.count = len(rows)
        width = max(len(pages) for _, _, pages in rows)
        self.table = np.zeros((self.count, width), dtype=np.int32)
        for i, (_, _, pages) in enumerate(rows):
            self.table[i, : len(pages)] = pages
        self.ids = np.array([t for t, _, _ in rows], dtype=np.int64)
        self.positions = np.array([p for _, p, _ in rows], dtype=np.int64)
        self.slots = self.table[np.arange(self.count), self.positions // page_size].astype(np.int64) * page_size \
            + self.positions % page_size

    def write(self, inputs, at: int) -> None:
        end = at + self.count
        for target, host in ((inputs.input_ids, self.ids), (inputs.positions, self.positions),
                             (inputs.seq_lens, self.positions + 1), (inputs.out_cache_loc, self.slots)):
            target[at:end].copy_(_pinned(torch.from_numpy(host), inputs), non_blocking=True)
        inputs.page_table[at:end, : self.table.shape[1]].copy_(_pinned(torch.from_numpy(self.table), inputs),
                                                               non_blocking=True)


def _parts(out) -> tuple:
    """A decode graph's static output as (logits, hidden) or (logits,)."""
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _pinned(host: torch.Tensor, inputs) -> torch.Tensor:
    return host.pin_memory() if inputs.input_ids.device.type == "cuda" else host


def verify_graphs(drafter, graphs: DecodeGraphs | None, vocab_size: int, max_requests: int,
                  capture: Capture) -> VerifyGraphs | None:
    """Graphs for the overlapped verify steps where the target has decode graphs and the drafter a StaticProposer;
    None otherwise, or where the capture fails (logged: graphs are only speed)."""
    if graphs is None:
        return None
    start = time.perf_counter()
    try:
        proposer = drafter.static_proposer(min(max_requests, graphs.sizes[-1]), drafter.num_steps + 1)
        if proposer is None:
            return None
        made = VerifyGraphs(graphs, proposer, drafter.num_steps, vocab_size, max_requests, capture,
                            with_hidden=drafter.caps.needs_hidden)
    except Exception as error:  # a performance feature never stops start-up
        log.warning("overlapped verify steps run without CUDA graphs: capturing them failed (%s: %s)",
                    type(error).__name__, error)
        return None
    log.info("captured CUDA graphs for overlapped verify steps of %s requests x 1..%d rows in %.1f s",
             made.request_sizes, drafter.num_steps + 1, time.perf_counter() - start)
    return made
