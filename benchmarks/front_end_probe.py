"""How long /health takes while one heavy but in-limit request is handled (the hardening probe, re-runnable).

    .venv/bin/python benchmarks/front_end_probe.py --url http://127.0.0.1:30000

Each case posts one request (an ~8 MB prompt; 10,000 long stop strings; a lone surrogate; a temperature of
1e-40 beside ordinary requests) and meanwhile times GET /health every 20 ms. It prints the request's
status, its time, and the slowest /health seen while it ran: a front end that keeps CPU work off its event
loop answers /health in milliseconds whatever one request carries. Last, 32 requests at once, every other
one with a degenerate sampling value, must all answer 200 (one bad row once failed the whole batch).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import httpx

CASES = {
    "~8 MB prompt (under the 8 MiB body limit)": {"prompt": "experts " * 1_040_000, "max_tokens": 4},
    "10,000 stop strings of 500 chars": {"prompt": "Hello", "max_tokens": 4, "stop": ["x" * 500] * 10_000},
    "lone surrogate": {"prompt": "a\ud800b", "max_tokens": 4},
    "temperature 1e-40": {"prompt": "Hello", "max_tokens": 4, "temperature": 1e-40},
    "top_p 1e-50": {"prompt": "Hello", "max_tokens": 4, "top_p": 1e-50},
}


def probe(url: str, body: dict) -> tuple[int, float, float, float]:
    samples, done = [], threading.Event()

    def health():
        with httpx.Client(timeout=120) as client:
            while not done.is_set():
                start = time.perf_counter()
                client.get(f"{url}/health")
                samples.append(time.perf_counter() - start)
                time.sleep(0.02)

    watcher = threading.Thread(target=health)
    watcher.start()
    time.sleep(0.1)
    start = time.perf_counter()
    content = json.dumps(body).encode()  # json.dumps escapes a lone surrogate as JSON allows
    r = httpx.post(f"{url}/v1/completions", content=content, headers={"content-type": "application/json"}, timeout=300)
    took = time.perf_counter() - start
    done.set()
    watcher.join()
    return r.status_code, took, max(samples), statistics.median(samples)


def mixed_batch(url: str, size: int = 32) -> tuple[list[int], float]:
    """`size` requests at once, every other one with a degenerate value: the statuses, and the seconds taken."""
    odd = [{"temperature": 1e-40}, {"top_p": 1e-50}, {"temperature": 5e-324}]
    bodies = [{"prompt": f"Hello {i}", "max_tokens": 16, **(odd[i % 3] if i % 2 else {})} for i in range(size)]
    statuses = [0] * size

    def post(i: int) -> None:
        statuses[i] = httpx.post(f"{url}/v1/completions", json=bodies[i], timeout=300).status_code

    start = time.perf_counter()
    threads = [threading.Thread(target=post, args=(i,)) for i in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statuses, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:30000", help="a running `moeplex serve`")
    args = parser.parse_args()
    print("| case | status | request s | slowest /health ms | median /health ms |\n|---|---|---|---|---|")
    for name, body in CASES.items():
        status, took, worst, median = probe(args.url, body)
        print(f"| {name} | {status} | {took:.2f} | {worst * 1e3:.1f} | {median * 1e3:.1f} |")
    statuses, took = mixed_batch(args.url)
    print(f"\n32 concurrent requests, half with degenerate sampling values: statuses {sorted(set(statuses))}, {took:.2f} s")


if __name__ == "__main__":
    main()
