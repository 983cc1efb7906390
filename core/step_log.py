"""The engine's steps by kind since start-up, for /metrics and /get_server_info: how many of each kind ran, the host
seconds `Engine.step` took for them, and how often the overlap schedule was broken (a step in flight read before
the next one was launched), by reason.

Kinds (what a step launched):
  prompt          prompt tokens only (prefills and prompt chunks)
  decode          decode rows only
  mixed           both in one step
  verify          a speculative verify step on the synchronous path (drafts from the host, tokens read in the step)
  verify_overlap  a verify step under the overlap schedule (speculation/overlap.py)
  verify_idle     one that verifies no draft: a run of them going on while that costs less than ending it
                  (AdaptivePolicy.keeps_run)
  none            nothing launched (a step that only read the step in flight, or found no work)

Under the overlap schedule `step()` waits for the step launched before it, so the seconds a kind gets are the
wall time of the steps that launched it: with the host hidden they are about the device's time of the step
before. The breaks say where the host and the device ran one after the other instead (a broken step's `exposed`
seconds: from the tokens of the step it read reaching the host to the step's end, the host work the device waited
for; 0.0 where the device does not run ahead of the host):
  drafts_wanted     a plain step was in flight when the draft policy wanted drafts (the drafts need its tokens)
  verify_run_ended  a verify step was in flight when the next could not follow it (an admission, a preemption,
                    or the policy drafting for no request), and nothing was launched before it was read
"""

from __future__ import annotations

import attrs

KINDS = ("prompt", "decode", "mixed", "verify", "verify_overlap", "verify_idle", "none")
BREAKS = ("drafts_wanted", "verify_run_ended")
VERIFY_KINDS = frozenset({"verify", "verify_overlap", "verify_idle"})  # the kinds of a step that verifies
PROMPT_KINDS = frozenset({"prompt", "mixed"})  # the kinds of a step that holds prompt tokens


@attrs.frozen
class TimedStep:
    """One engine step: what it launched (StepLog's kind), its shape, its wall seconds, and whether the overlap
    schedule broke during it."""

    kind: str
    requests: int
    rows: int
    seconds: float
    broken: bool
    wanted_drafts: bool = False  # the break was a read of the step in flight because drafts were wanted
    exposed: float = 0.0  # a broken step: seconds from the read step's tokens reaching the host to this step's end
    prompt: bool = False  # a verify step that held prompt tokens too (requests and rows count its decodes only)


@attrs.define
class StepLog:
    steps: dict[str, int] = attrs.Factory(lambda: dict.fromkeys(KINDS, 0))
    seconds: dict[str, float] = attrs.Factory(lambda: dict.fromkeys(KINDS, 0.0))
    breaks: dict[str, int] = attrs.Factory(lambda: dict.fromkeys(BREAKS, 0))
    kind: str = "none"  # what the step under way launched (the last launch wins: a step launches at most one)
    shape: tuple[int, int] = (0, 0)  # ... its requests and rows (verify steps: the rows the policy chose)
    prompt: bool = False  # ... a verify step holding prompt tokens too
    broken: bool = False  # whether the overlap schedule broke during the step under way
    wanted_drafts: bool = False  # ... because drafts were wanted (the step in flight read for them)
    last: TimedStep | None = None  # the step that ended last
    arrived_at: float | None = None  # when the first step read in the step under way had its tokens on the host

    def launched(self, kind: str, requests: int = 0, rows: int = 0, prompt: bool = False) -> None:
        self.kind, self.shape, self.prompt = kind, (requests, rows), prompt

    def broke(self, reason: str) -> None:
        self.breaks[reason] += 1
        self.broken = True
        self.wanted_drafts |= reason == "drafts_wanted"

    def arrived(self, now: float) -> None:
        """The tokens of a step read in the step under way reached the host at `now` (perf_counter; the first
        read counts: in a broken step it is the break's)."""
        if self.arrived_at is None:
            self.arrived_at = now

    def timed(self, seconds: float, now: float | None = None) -> TimedStep:
        """The step under way ended after `seconds`, at `now` (perf_counter): counted for what it launched."""
        exposed = now - self.arrived_at if self.broken and now is not None and self.arrived_at is not None else 0.0
        self.steps[self.kind] += 1
        self.seconds[self.kind] += seconds
        self.last = TimedStep(self.kind, *self.shape, seconds, self.broken, self.wanted_drafts, max(exposed, 0.0),
                              self.prompt)
        self.kind, self.shape, self.broken, self.wanted_drafts, self.arrived_at = "none", (0, 0), False, False, None
        self.prompt = False
        return self.last

    def totals(self) -> tuple[tuple[str, int, float], ...]:
        """(kind, steps, seconds) per kind, for GroupStats."""
        return tuple((kind, self.steps[kind], self.seconds[kind]) for kind in KINDS)

    def break_totals(self) -> tuple[tuple[str, int], ...]:
        return tuple((reason, self.breaks[reason]) for reason in BREAKS)


def launch_kind(work) -> str:
    """The kind of a plain step of this scheduled work (before it runs): a row is a prompt row where it computes
    several tokens or a request's prompt is not all cached yet."""
    prompts = sum(1 for item in work if item.num_tokens > 1 or item.request.num_cached < len(item.request.prompt_ids))
    return "decode" if prompts == 0 else "prompt" if prompts == len(work) else "mixed"
