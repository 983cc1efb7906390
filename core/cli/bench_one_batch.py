"""`moeplex bench-one-batch`: prefill one static batch, then decode it, and time both (no server, one rank)."""

from __future__ import annotations

import json
import random
import statistics
import time

import torch

from ..engine import Engine
from ..sampling import SamplingParams
from .flags import add_engine_flags, engine_config


def add_parser(sub) -> None:
    p = sub.add_parser("bench-one-batch", help="time the prefill and decode of one static batch")
    p.add_argument("--batch-size", type=int, nargs="+", default=[1], help="requests in the batch (several: one run each)")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens per request (default: 256)")
    p.add_argument("--output-len", type=int, default=32, help="tokens decoded per request (default: 32); decode tok/s "
                   "counts the tokens the decode steps produced (several per request and step with "
                   "--speculative-algorithm), accept length the tokens a verify step gained per request")
    p.add_argument("--json", action="store_true", help="print one JSON object per batch size")
    add_engine_flags(p, serving=False)
    p.set_defaults(run=run)


def _sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def measure(engine: Engine, batch_size: int, input_len: int, output_len: int) -> dict:
    """Prefill time of the whole batch (one step), the median decode step after it, and the decode tokens
    produced per second: with speculative decoding a step emits 1..steps+1 tokens per request, so tokens per
    second is the tokens the decode steps produced over their time (batch / step time without speculation),
    and accept_length is the tokens a verify step gained per request (accepted drafts + 1; 0 without drafts).

    Decode steps are timed from one return of engine.step() to the next, without a device sync in
    between: under the overlap schedule a step returns while the GPU still runs the next one, and a
    sync per step would serialize them. In steady state that interval is the time per step.
    """
    rng = random.Random(batch_size)
    vocab = min(engine.vocab_size, 256)
    # the prompts repeat from call to call: an earlier call's pages in the prefix cache would make the prefill a
    # lookup, so the cache starts empty and the prefill computes every prompt token
    engine.flush_cache()
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    requests = [engine.add_request([rng.randrange(vocab) for _ in range(input_len)], params) for _ in range(batch_size)]
    _sync(engine)
    start = time.perf_counter()
    engine.step()  # the whole batch fits the step's token budget: one prefill step
    _sync(engine)
    prefill_s = time.perf_counter() - start
    steps = []
    start = time.perf_counter()
    while engine.has_work:
        engine.step()
        now = time.perf_counter()
        steps.append(now - start)
        start = now
    _sync(engine)
    decode_s = statistics.median(steps) if steps else float("nan")
    produced = sum(len(r.output_ids) for r in requests) - batch_size  # each request's first token: the prefill's
    verify_steps = sum(r.spec_verify_steps for r in requests)
    gained = sum(r.spec_accepted_tokens for r in requests) + verify_steps
    return {
        "batch_size": batch_size,
        "input_len": input_len,
        "output_len": output_len,
        "prefill_ms": round(prefill_s * 1e3, 3),
        "prefill_tok_s": round(batch_size * input_len / prefill_s, 1),
        "decode_step_ms": round(decode_s * 1e3, 3),
        "decode_tok_s": round(produced / sum(steps), 1) if steps else float("nan"),
        "decode_steps": len(steps),
        "accept_length": round(gained / verify_steps, 3) if verify_steps else 0.0,
    }


def run(args) -> int:
    largest = max(args.batch_size)
    config = engine_config(
        args,
        show_progress=False,
        max_running_requests=largest,
        max_batched_tokens=largest * args.input_len,
        chunked_prefill_size=args.input_len,
    )
    if config.parallel.distributed:
        raise ValueError("bench-one-batch runs one rank; time several ranks with benchmarks/overlap.py or benchmarks/dispatch.py")
    engine = Engine(config)
    measure(engine, 1, min(args.input_len, 16), 2)  # warm-up: first-call allocations and kernel compilation
    setup = {"attention_backend": engine.model.attention_backend.name, "cuda_graph": engine.runner.graphs is not None}
    if not args.json:
        graphs = f"CUDA graphs for batches up to {engine.runner.graphs.sizes[-1]}" if setup["cuda_graph"] else "no CUDA graphs"
        print(f"{setup['attention_backend']} attention, {graphs}\n")
        print("| batch | input | output | prefill ms | prefill tok/s | decode step ms | decode tok/s | decode steps "
              "| accept length |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for batch_size in args.batch_size:
        row = measure(engine, batch_size, args.input_len, args.output_len)
        if args.json:
            print(json.dumps({**row, **setup}))
        else:
            print(" | ".join(["", *(str(row[k]) for k in row), ""]).strip())
    return 0
