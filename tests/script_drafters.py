"""Test-only drafters, registered through a real dist-info folder on sys.path (write_distribution).

Both read the continuation they are told to expect (SCRIPT: whole sequences, prompt + the output that
non-speculative greedy decoding gives): the oracle proposes exactly it (every draft accepted), the
adversary a token that differs from it at every draft (none accepted). Output must not change either way.
"""

from __future__ import annotations

from typing import Sequence

from moeplex.interfaces import DraftRequest, Drafter, DrafterCaps, Drafts

SCRIPT: list[list[int]] = []  # set by the test before it generates
VOCAB = 512  # of the tiny models; the adversary's wrong tokens stay inside it
FALLBACK = False  # the oracle repeats the last token where no sequence matches (benchmarks that force acceptance)
HEAD = 32  # tokens compared first: a cheap filter before the whole prefix is


def expected(ids: Sequence[int], count: int) -> list[int]:
    ids = list(ids)
    head = ids[:HEAD]
    for sequence in SCRIPT:
        if sequence[: len(head)] == head and sequence[: len(ids)] == ids:
            return sequence[len(ids) : len(ids) + count]
    return []


class OracleDrafter(Drafter):
    caps = DrafterCaps()

    def bind(self, context):
        self.context = context

    def propose(self, requests: Sequence[DraftRequest]) -> Drafts:
        drafts = [expected(r.token_ids, self.num_steps) for r in requests]
        if FALLBACK:
            drafts = [d or [r.token_ids[-1]] * self.num_steps for d, r in zip(drafts, requests)]
        return Drafts(drafts)


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


ENTRY_POINTS = {"moeplex.drafters": {"test-oracle": "script_drafters:OracleDrafter",
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
