"""Test-only drafters, registered through a real dist-info folder on sys.path (write_distribution).

Both read the continuation they are told to expect (SCRIPT: whole sequences, prompt + the output that
non-speculative greedy decoding gives): the oracle proposes exactly it (every draft accepted), the
adversary a token that differs from it at every draft (none accepted). Output must not change either way.
The device oracle proposes the same on the device (DrafterCaps.drafts_on_device), so its verify steps run under
the overlap schedule: the mechanism's ceiling there, where the host oracle's steps are synchronous.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from moeplex.interfaces import (DeviceDrafts, DeviceTokens, DraftRequest, Drafter, DrafterCaps, Drafts,
                                StaticProposer)

SCRIPT: list[list[int]] = []  # set by the test before it generates
VOCAB = 512  # of the tiny models; the adversary's wrong tokens stay inside it
FALLBACK = False  # benchmarks that force acceptance: where no sequence continues a request, the oracle repeats its
# last token, the device oracle drafts by position from the sequence closest to it (closest_row)
HEAD = 32  # tokens compared first: a cheap filter before the whole prefix is
SLOW_SECONDS = 0.1  # the slow oracle's host work per step
VERSION = 0  # moved by set_script: the device oracle copies SCRIPT to the device again


def set_script(sequences: Sequence[Sequence[int]]) -> None:
    global VERSION
    SCRIPT[:] = [list(s) for s in sequences]
    VERSION += 1


def script_row(ids: Sequence[int]) -> int:
    """The SCRIPT sequence that continues `ids` (-1: none)."""
    ids = list(ids)
    head = ids[:HEAD]
    return next((i for i, s in enumerate(SCRIPT) if s[: len(head)] == head and s[: len(ids)] == ids), -1)


def closest_row(ids: Sequence[int]) -> int:
    """The SCRIPT sequence sharing the longest prefix with `ids` (-1: none shares a token): where a benchmark forces
    acceptance, a request whose own tokens left its script (a near tie that another batch shape breaks the other
    way) still drafts from it by position."""
    def shared(sequence: list[int]) -> int:
        return next((k for k, (a, b) in enumerate(zip(sequence, ids)) if a != b), min(len(sequence), len(ids)))

    best = max(range(len(SCRIPT)), key=lambda i: shared(SCRIPT[i]), default=-1)
    return best if best >= 0 and shared(SCRIPT[best]) > 0 else -1


def expected(ids: Sequence[int], count: int) -> list[int]:
    row = script_row(ids)
    return SCRIPT[row][len(ids) : len(ids) + count] if row >= 0 else []


class OracleDrafter(Drafter):
    caps = DrafterCaps()

    def bind(self, context):
        self.context = context

    def propose(self, requests: Sequence[DraftRequest]) -> Drafts:
        drafts = [expected(r.token_ids, self.num_steps) for r in requests]
        if FALLBACK:
            drafts = [d or [r.token_ids[-1]] * self.num_steps for d, r in zip(drafts, requests)]
        return Drafts(drafts)


class SlowOracleDrafter(OracleDrafter):
    """The oracle, with host work of SLOW_SECONDS in every step it drafts for (no step-cost measurement sees it)."""

    def propose(self, requests: Sequence[DraftRequest]) -> Drafts:
        time.sleep(SLOW_SECONDS)
        return super().propose(requests)


class AdversaryDrafter(Drafter):
    caps = DrafterCaps()

    def propose(self, requests: Sequence[DraftRequest]) -> Drafts:
        tokens = []
        for r in requests:
            right = expected(r.token_ids, self.num_steps)
            tokens.append([(t + 1) % VOCAB for t in right] if right else [7] * self.num_steps)
        return Drafts(tokens)


class OutOfVocabularyDrafter(Drafter):
    """The oracle's right tokens, then an id past the vocabulary: a faulty drafter whose drafts are refused."""

    caps = DrafterCaps()

    def propose(self, requests: Sequence[DraftRequest]) -> Drafts:
        return Drafts([expected(r.token_ids, self.num_steps - 1) + [VOCAB + 3] for r in requests])


class ScriptTable:
    """SCRIPT on the device, at a fixed size (graphs captured before a benchmark sets SCRIPT read this tensor), and
    each request's row in it; the last row is all -1 (no sequence, and padding rows)."""

    def __init__(self, device, rows: int = 2048, width: int = 1024):
        self.ids = torch.full((rows + 1, width), -1, dtype=torch.int64, device=device)
        self.none = rows
        self.version = None
        self.row_of: dict[str, int] = {}

    def rows(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """Per request: [its row, its known length]."""
        if self.version != VERSION:
            if len(SCRIPT) > self.none or max(map(len, SCRIPT), default=0) > self.ids.shape[1]:
                raise ValueError(f"SCRIPT holds more than {self.none} x {self.ids.shape[1]} ids")
            host = torch.full(self.ids.shape, -1, dtype=torch.int64)
            for i, sequence in enumerate(SCRIPT):
                host[i, : len(sequence)] = torch.tensor(sequence, dtype=torch.int64)
            self.ids.copy_(host)
            self.version, self.row_of = VERSION, {}
        out = []
        for r in requests:
            row = self.row_of.get(r.rid)
            if row is None:
                row = script_row(r.token_ids)
                if row < 0 and FALLBACK:
                    row = closest_row(r.token_ids)
                self.row_of[r.rid] = row = self.none if row < 0 else row
            out.append([row, len(r.token_ids)])
        return out

    def propose(self, meta: torch.Tensor, pending: DeviceTokens | None, steps: int) -> DeviceDrafts:
        """Drafts from [R, 2] (row, known length) after each row's pending tokens: no host value read."""
        row, known = meta.unbind(1)
        if pending is not None:
            known = known + pending.counts
        k = torch.arange(steps, device=meta.device)[None, :]
        cols = (known[:, None] + k).clamp_max(self.ids.shape[1] - 1)
        drafts = self.ids[row[:, None], cols]
        counts = torch.cumprod((drafts >= 0).to(torch.int64), dim=1).sum(dim=1)
        return DeviceDrafts(torch.where(k < counts[:, None], drafts, -1), counts)


class DeviceOracleDrafter(OracleDrafter):
    """The oracle drafting on the device: its verify steps run under the overlap schedule."""

    caps = DrafterCaps(cheap_proposals=True, drafts_on_device=True)

    def bind(self, context):
        self.context = context
        self.table = ScriptTable(torch.device(context.device))

    def propose_on_device(self, requests: Sequence[DraftRequest], pending: DeviceTokens | None = None) -> DeviceDrafts:
        meta = torch.tensor(self.table.rows(requests), dtype=torch.int64).to(self.table.ids.device)
        return self.table.propose(meta, pending, self.num_steps)

    def static_proposer(self, max_rows: int, pending_width: int) -> StaticProposer:
        return StaticOracle(self.table, max_rows, self.num_steps)


class StaticOracle(StaticProposer):
    def __init__(self, table: ScriptTable, max_rows: int, steps: int):
        self.table, self.steps = table, steps
        self.meta = torch.tensor([[table.none, 0]] * max_rows, dtype=torch.int64, device=table.ids.device)

    def stage(self, requests: Sequence[DraftRequest], rows: int) -> None:
        staged = self.table.rows(requests) + [[self.table.none, 0]] * (rows - len(requests))
        self.meta[:rows].copy_(torch.tensor(staged, dtype=torch.int64))

    def propose(self, pending: DeviceTokens) -> DeviceDrafts:
        return self.table.propose(self.meta[: pending.tokens.shape[0]], pending, self.steps)


ENTRY_POINTS = {"moeplex.drafters": {"test-oracle": "script_drafters:OracleDrafter",
                                     "test-oracle-device": "script_drafters:DeviceOracleDrafter",
                                     "test-slow-oracle": "script_drafters:SlowOracleDrafter",
                                     "test-adversary": "script_drafters:AdversaryDrafter",
                                     "test-oov": "script_drafters:OutOfVocabularyDrafter"}}


def write_distribution(folder) -> None:
    info = folder / "script_drafters-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: script-drafters\nVersion: 0.1\n")
    lines = []
    for group, entries in ENTRY_POINTS.items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {target}" for name, target in entries.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
