"""Torch's CPU threads of a node's ranks: its cores shared by them, OMP_NUM_THREADS over that, one rank left alone."""

from __future__ import annotations

import torch

from moeplex.ranks import launcher
from moeplex.ranks.launcher import set_rank_threads


def threads_set(monkeypatch, ranks_per_node: int, omp: str | None = None) -> list[int]:
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.setattr(launcher.os, "cpu_count", lambda: 16)
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    set_rank_threads(ranks_per_node)
    return calls


def test_ranks_share_the_cores_and_omp_num_threads_decides_where_it_is_set(monkeypatch):
    assert threads_set(monkeypatch, 2) == [8]
    assert threads_set(monkeypatch, 32) == [1]
    assert threads_set(monkeypatch, 1) == []  # one rank keeps torch's own choice
    assert threads_set(monkeypatch, 2, omp="3") == []  # torch took OMP_NUM_THREADS at start-up
