"""Torch's CPU threads of a rank: one on a GPU rank, the node's cores shared by CPU ranks, OMP_NUM_THREADS over both."""

from __future__ import annotations

import os

import torch

from moeplex.ranks import launcher
from moeplex.ranks.launcher import set_rank_threads


def threads_set(monkeypatch, device: str, ranks_per_node: int, omp: str | None = None) -> list[int]:
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.setattr(launcher.os, "cpu_count", lambda: 16)
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    set_rank_threads(device, ranks_per_node)
    return calls


def test_a_gpu_rank_gets_one_thread_and_cpu_ranks_share_the_cores(monkeypatch):
    assert threads_set(monkeypatch, "cuda", 1) == [1]
    assert threads_set(monkeypatch, "cuda:3", 8) == [1]
    assert threads_set(monkeypatch, "cpu", 2) == [8]
    assert threads_set(monkeypatch, "cpu", 1) == []  # one CPU rank keeps torch's own choice


def test_omp_num_threads_decides_where_it_is_set(monkeypatch):
    assert threads_set(monkeypatch, "cuda", 1, omp="4") == []
    assert threads_set(monkeypatch, "cpu", 2, omp="3") == []
    assert os.environ["OMP_NUM_THREADS"] == "3"
