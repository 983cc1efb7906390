"""Expert-load recorder: tokens routed to each logical expert of each MoE layer, counted on the device.

Recording is one scatter-add into a device tensor per MoE layer: no host sync, nothing a CUDA
graph could not capture. Counts reach the host only when someone reads them (a dump, a rebalance).
Each rank counts the tokens it routed; summing over the EP ranks is the reader's business.
"""

from __future__ import annotations

import torch

from ..config import OFF, PER_STEP, STAT


class LoadRecorder:
    """Token counts [layers, logical experts] in one of three modes.

    off: records nothing. stat: one running total since `start`. per-step: a ring that keeps the
    counts of the last `window` steps separately (a sliding window, and per-step dumps).
    """

    def __init__(self, num_layers: int, num_experts: int, device: torch.device, window: int = 1000):
        if window < 1:
            raise ValueError(f"the recorder's window must hold at least one step, got {window}")
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.device = torch.device(device)
        self.window = window
        self.mode = OFF  # what the counts are: stays stat / per-step after `stop`, so they remain readable
        self.recording = False
        self.steps = 0  # steps ended since `start`
        self._cursor = 0  # the ring row the current step writes to
        self._counts = self._zeros(1)

    def _zeros(self, rows: int) -> torch.Tensor:
        return torch.zeros(rows, self.num_layers, self.num_experts, dtype=torch.int64, device=self.device)

    @property
    def started(self) -> bool:
        """Whether there are counts to read (a recording was started, and may since have stopped)."""
        return self.mode != OFF

    def start(self, mode: str = STAT) -> None:
        """Forget what was recorded and count from now on in `mode`."""
        if mode not in (STAT, PER_STEP):
            raise ValueError(f"recording mode must be {STAT} or {PER_STEP}, got {mode!r}")
        # per-step: the finished steps kept, plus the row the current step writes to
        self._counts = self._zeros(1 if mode == STAT else self.window + 1)
        self.mode, self.recording, self.steps, self._cursor = mode, True, 0, 0

    def stop(self) -> None:
        """Stop counting; what was recorded stays readable until the next `start`."""
        self.recording = False

    def record(self, layer: int, logical_ids: torch.Tensor) -> None:
        """Count one MoE layer's routing choices (ids of -1 are padding and count nothing)."""
        if not self.recording:
            return
        ids = logical_ids.reshape(-1)
        row = self._counts[self._cursor, layer]
        row.scatter_add_(0, ids.clamp_min(0), (ids >= 0).to(row.dtype))

    def end_step(self) -> None:
        """Close the current step; in per-step mode the next one starts on a cleared ring row."""
        if not self.recording:
            return
        self.steps += 1
        if self.mode == PER_STEP:
            self._cursor = (self._cursor + 1) % len(self._counts)
            self._counts[self._cursor].zero_()

    def counts(self) -> torch.Tensor:
        """stat (and off): [L, E] since `start`; per-step: [steps kept, L, E] of the finished steps, oldest first."""
        if self.mode != PER_STEP:
            return self._counts[0]
        kept = min(self.steps, self.window)
        rows = [(self._cursor - kept + i) % len(self._counts) for i in range(kept)]
        return self._counts[rows]

    def total(self) -> torch.Tensor:
        """[L, E] summed over every step kept."""
        counts = self.counts()
        return counts if counts.dim() == 2 else counts.sum(0)
