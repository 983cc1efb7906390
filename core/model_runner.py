"""ModelRunner: scheduled work -> ForwardBatch -> logits of the requests whose next token is due."""

from __future__ import annotations

import itertools
from typing import Sequence

import attrs
import torch

from .batch_builder import ScheduledSeq, build_forward_batch
from .cuda_graph import DecodeGraphs, padded_size
from .forward_batch import ForwardBatch
from .in_flight import InFlight, fill_placeholders
from .kv_cache import KVPool
from .scheduler import ScheduledWork
from .transfer import to_device


# KV tokens the rows of a prompt step run as decode rows may read in all, per layer: every row reads its sequence up
# to itself, so a prompt of n new tokens after p cached ones reads ~n * (p + n / 2). 2^17 reads 256 MB of a Qwen3-30B
# layer's KV (~85 µs on an H100), against the ~1 ms of host time an eager prompt step spends on each layer.
PROMPT_ROW_READS = 1 << 17


def verify_logit_rows(work: Sequence[ScheduledWork], drafts: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """The token rows whose logits a verify step needs (a due request's last token and its drafts), and the work
    items that are due a token."""
    rows, due, at = [], [], 0
    for i, (item, draft) in enumerate(zip(work, drafts)):
        at += item.num_tokens + len(draft)
        if item.request.num_uncached - item.num_tokens == 0:
            due.append(i)
            rows.extend(range(at - len(draft) - 1, at))
    return rows, due


def _holds_prompt(work: Sequence[ScheduledWork]) -> bool:
    """Whether some item of the step is more than a decode row (a prompt's tokens, or a request's first)."""
    return not all(w.num_tokens == 1 and w.request.num_cached > 0 for w in work)


def _row_reads(work: Sequence[ScheduledWork], drafts: Sequence[Sequence[int]] | None = None) -> int:
    """KV tokens the step's rows read in all, per layer, were every token (drafts included) a decode row."""
    drafts = drafts if drafts is not None else [()] * len(work)
    return sum((w.num_tokens + len(d)) * (w.request.num_cached + w.num_tokens + len(d)) for w, d in zip(work, drafts))


class ModelRunner:
    def __init__(self, model, kv: KVPool, strategy, device: torch.device, hooks=None, graphs: DecodeGraphs | None = None,
                 prompt_graphs: bool = True):
        self.model = model
        self.kv = kv
        self.strategy = strategy
        self.device = device
        self.hooks = hooks
        self.graphs = graphs  # captured decode steps, replayed for the decode batches they hold
        self.prompt_graphs = prompt_graphs  # prompt steps that fit run as decode rows and replay those graphs

    def prompt_rows(self, work: Sequence[ScheduledWork]) -> bool:
        """Whether a step of `work` holding prompt tokens runs them as decode rows, one per token (row j of a request
        at position num_cached + j reads the cache up to itself; the rows before it wrote their KV in the same
        layer), so that the step replays a decode graph instead of launching every kernel from the host: where the
        rows fit a captured size that is not split into micro-batches (a cut between a prompt's rows would read KV
        its other half has not written) and read at most PROMPT_ROW_READS cached tokens."""
        graphs = self.graphs
        if graphs is None or graphs.recording or not self.prompt_graphs:
            return False
        if not _holds_prompt(work):
            return False  # a decode batch as it is
        size = padded_size(sum(w.num_tokens for w in work), graphs.sizes)
        return size is not None and graphs.cuts.get(size) is None and _row_reads(work) <= PROMPT_ROW_READS

    def verify_rows(self, work: Sequence[ScheduledWork], drafts: Sequence[Sequence[int]]) -> bool:
        """Whether a verify step in decode rows (`decode_rows`) runs the prompt tokens sharing it as decode rows too:
        where they read at most PROMPT_ROW_READS cached tokens and the rows do not fill a captured size split into
        micro-batches. It then replays a decode graph where one holds the rows, and runs eagerly otherwise, with one
        paged decode launch a layer instead of an attention call per prompt (DeepSeek-V3 shapes on an H100, 24
        layers, 32 requests: such a step with the prompt as an extend took ~400 ms)."""
        if not _holds_prompt(work) or not self.prompt_graphs:
            return False  # (a verify batch as it is; or prompts are never rows)
        if _row_reads(work, drafts) > PROMPT_ROW_READS:
            return False
        graphs = self.graphs
        if graphs is None or graphs.recording:
            return True
        size = padded_size(sum(w.num_tokens + len(d) for w, d in zip(work, drafts)), graphs.sizes)
        return size is None or graphs.cuts.get(size) is None

    def verify_replays(self, work: Sequence[ScheduledWork], widths: Sequence[int]) -> bool:
        """Whether a verify step of `work` holding prompt tokens, with widths[i] drafts for item i, runs as decode
        rows (verify_rows) that replay a captured decode graph."""
        graphs = self.graphs
        if graphs is None or graphs.recording:
            return False
        drafts = [range(n) for n in widths]  # (only their lengths are read)
        size = padded_size(sum(w.num_tokens + n for w, n in zip(work, widths)), graphs.sizes)
        return size is not None and self.verify_rows(work, drafts)

    def prepare(self, work: Sequence[ScheduledWork], in_flight: InFlight | None = None,
                drafts: Sequence[Sequence[int]] | None = None, decode_rows: bool = False) -> ForwardBatch:
        """The batch of the scheduled work; tokens still in flight are read on the device from `in_flight`.

        A speculating request's last token and drafts are a short extend of 1 + m positions, or with
        `decode_rows` one decode row each (row j at position num_cached + j, reading the cache up to itself,
        where the rows before it wrote their KV in the same layer): a verify step is then a decode batch of
        requests x (drafts + 1) rows, which runs the paged decode kernels and replays the decode CUDA graphs;
        a prompt sharing it becomes rows too where verify_rows says so (the batch's sample_rows are then the
        rows whose logits the verify reads)."""
        verify_as_rows = drafts is not None and decode_rows and self.verify_rows(work, drafts)
        prompts_as_rows = (drafts is None and self.prompt_rows(work)) or verify_as_rows
        drafts = drafts if drafts is not None else [()] * len(work)
        seqs = []
        for w, draft in zip(work, drafts):
            request, start = w.request, w.request.num_cached
            tokens = [*request.token_ids(start, w.num_tokens), *draft]
            if (draft and decode_rows) or prompts_as_rows:
                seqs += [ScheduledSeq([t], start + j, request.pages) for j, t in enumerate(tokens)]
            else:
                seqs.append(ScheduledSeq(tokens, start, request.pages))
        batch = build_forward_batch(seqs, self.kv, self.device, rows=prompts_as_rows)
        if verify_as_rows:
            batch = attrs.evolve(batch, sample_rows=tuple(verify_logit_rows(work, drafts)[0]), overlap_split=False)
        elif prompts_as_rows:  # each request samples its last row; a micro-batch must not cut between its rows
            ends = tuple(itertools.accumulate(w.num_tokens for w in work))
            batch = attrs.evolve(batch, sample_rows=tuple(end - 1 for end in ends), overlap_split=False)
        if in_flight is not None and any(w.request.pending_rows for w in work):
            batch = attrs.evolve(batch, input_ids=fill_placeholders(batch.input_ids, in_flight.tokens))
        return batch

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, extra_rows: Sequence[int] = ()) -> torch.Tensor:
        """[B, vocab] fp32 logits of each request's last processed token; with `extra_rows` (token rows of the
        batch: prompt positions whose logprobs are asked for), (those logits, [len(extra_rows), vocab])."""
        logits, extra, _ = self._forward(batch, extra_rows, with_hidden=False)
        return (logits, extra) if extra_rows else logits

    @torch.inference_mode()
    def forward_with_hidden(self, batch: ForwardBatch, extra_rows: Sequence[int] = ()):
        """(logits, the `extra_rows` logits or None, every token's pre-norm hidden state [T, H]): the ordinary step
        of an engine whose drafter reads hidden states (its decode graphs were captured returning them)."""
        return self._forward(batch, extra_rows, with_hidden=True)

    def _forward(self, batch: ForwardBatch, extra_rows: Sequence[int], with_hidden: bool):
        rows, extra = batch.last_token_index, None
        if extra_rows:
            rows = torch.cat([rows, to_device(rows.device, torch.tensor(list(extra_rows), dtype=torch.int64))[0]])
        logits, hidden = self._run(batch, rows, with_hidden, may_replay=not extra_rows)
        if extra_rows:
            logits, extra = logits[: len(batch.last_token_index)], logits[len(batch.last_token_index) :]
        if self.hooks is not None:
            self.hooks.hook.moeplex_forward_done(batch=batch, logits=logits)
        return logits, extra, hidden

    @torch.inference_mode()
    def verify_forward(self, batch: ForwardBatch, rows: torch.Tensor, with_hidden: bool):
        """(logits of the token rows `rows`, every token's pre-norm hidden state or None): a speculative step.
        Its decode batches (verify rows included: every token row is then a request row) replay graphs, which
        return the hidden states too where they were captured for a drafter that reads them."""
        # (a batch with sample_rows holds prompt rows as well: a graph's logits are picked at `rows`)
        may_replay = len(rows) == batch.num_tokens or batch.sample_rows is not None
        logits, hidden = self._run(batch, rows, with_hidden, may_replay=may_replay)
        if self.hooks is not None:
            self.hooks.hook.moeplex_forward_done(batch=batch, logits=logits)
        return logits, hidden

    def _run(self, batch: ForwardBatch, rows: torch.Tensor, with_hidden: bool, may_replay: bool):
        """(logits of the token rows `rows`, hidden states or None): replayed from the decode graphs where
        `may_replay` (the rows are the graph's own) and a graph holds the batch (with hidden states, if asked),
        else the model run eagerly."""
        graphs = self.graphs
        if may_replay and graphs is not None and graphs.can_run(batch) and (graphs.with_hidden or not with_hidden):
            picked = rows if batch.sample_rows is not None else None  # (a graph returns every row's logits)
            return graphs.run_with_hidden(batch, picked) if with_hidden else (graphs.run(batch, picked), None)
        out = self.model(batch, self.kv, self.strategy, logits_at=rows, return_hidden=with_hidden)
        return out if with_hidden else (out, None)

    @torch.inference_mode()
    def replay_verify(self, size: int, batch: ForwardBatch, with_hidden: bool = False):
        """[size, vocab] logits of the decode graph of `size`, whose static inputs a graphed verify step wrote
        (`batch`: those inputs as a batch, for the hooks); the graph's own tensor. With `with_hidden`, (logits,
        [size, H] hidden states) from graphs captured with them."""
        out = self.graphs.replay_loaded(size, with_hidden)
        if self.hooks is not None:
            self.hooks.hook.moeplex_forward_done(batch=batch, logits=out[0] if with_hidden else out)
        return out
