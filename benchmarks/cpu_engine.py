"""What the CPU-time benchmarks share: their flags and the engine offline_throughput.py runs, on one torch thread."""

from __future__ import annotations

import argparse

import torch

from moeplex.config import EngineConfig
from moeplex.engine import Engine


def parser(doc: str, num_requests: int, requests_help: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="DIR", help="checkpoint folder (moeplex make-model)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="weights and compute")
    p.add_argument("--num-requests", type=int, default=num_requests, help=requests_help)
    return p


def one_thread_engine(model: str, dtype: str) -> Engine:
    """offline_throughput.py's engine (the same scheduler limits), on one torch thread."""
    torch.set_num_threads(1)
    return Engine(EngineConfig(model=model, dtype=dtype, show_progress=False, max_running_requests=64,
                               max_batched_tokens=4096, chunked_prefill_size=1024))
