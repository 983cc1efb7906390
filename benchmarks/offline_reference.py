"""The offline side of benchmarks/serving.py: `Engine.generate` (what `moeplex generate` runs) in a process of its own.

The served engine's rank 0 is a process of its own, so the offline engine is too: neither shares an interpreter
with the load generator (its objects, its allocator's arenas, its event loop's leftovers), and the CPU time of each
is that of its own process. The process builds the engine with the server's flags, warms it up as `moeplex serve`
does, runs the warm-up requests, then times each workload it is sent.
"""

from __future__ import annotations

import multiprocessing
import time


class OfflineReference:
    def __init__(self, model: str, settings: dict, warm, threads: int | None = None):
        """`settings`: EngineConfig fields (the server's engine flags); `warm`: (prompt, new tokens) pairs run first."""
        context = multiprocessing.get_context("spawn")
        self._connection, there = context.Pipe()
        self.process = context.Process(target=_serve_runs, args=(there, model, settings, warm, threads), daemon=True)
        self.process.start()
        there.close()
        self._answer()  # the engine is built and warm

    @property
    def pid(self) -> int:
        return self.process.pid

    def run(self, work) -> dict:
        """Output tokens/s of Engine.generate on `work` (every request at once), its steps, ms and CPU ms per step."""
        self._connection.send(work)
        return self._answer()

    def close(self) -> None:
        try:
            self._connection.send(None)
        except OSError:
            pass
        self.process.join(60)
        if self.process.is_alive():
            self.process.kill()

    def _answer(self):
        try:
            answer = self._connection.recv()
        except EOFError:
            raise SystemExit(f"the offline engine's process stopped (exit code {self.process.exitcode})") from None
        if isinstance(answer, BaseException):
            raise answer
        return answer


def _serve_runs(connection, model: str, settings: dict, warm, threads: int | None) -> None:
    try:
        engine = _warm_engine(model, settings, warm, threads)
        connection.send("ready")
    except BaseException as exc:
        connection.send(exc)
        return
    while (work := connection.recv()) is not None:
        try:
            connection.send(_timed(engine, work))
        except BaseException as exc:
            connection.send(exc)
            return


def _warm_engine(model: str, settings: dict, warm, threads: int | None):
    import torch

    from moeplex.config import EngineConfig
    from moeplex.engine import Engine
    from moeplex.ranks.group import EngineGroup
    from moeplex.ranks.warmup import warm_up

    if threads:
        torch.set_num_threads(threads)
    engine = Engine(EngineConfig(model=model, show_progress=False, **settings))
    if engine.device.type == "cuda":  # as `moeplex serve` does before it serves (unless --skip-warmup)
        warm_up(EngineGroup(engine))
    _generate(engine, warm)
    return engine


def _timed(engine, work) -> dict:
    engine.reset_prefix_cache()  # the server's cache is flushed before each level too
    before = {kind: (n, t) for kind, n, t in engine.step_log.totals()}
    cpu, start = time.process_time(), time.perf_counter()
    steps = _generate(engine, work)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(n for _, n in work)
    kinds = {kind: (n - before[kind][0], t - before[kind][1]) for kind, n, t in engine.step_log.totals()}
    return {"tok_per_s": tokens / elapsed, "ms_per_step": 1e3 * elapsed / steps, "tok_per_step": tokens / steps,
            "cpu_ms_per_step": 1e3 * cpu / steps, "kinds": kinds}


def _generate(engine, work) -> int:
    """Engine.generate on `work`; the steps it took (counted on the instance, so generate itself is what runs)."""
    from moeplex.sampling import SamplingParams

    step, steps = engine.step, [0]

    def counted():
        steps[0] += 1
        return step()

    engine.step = counted
    try:
        engine.generate([p for p, _ in work], [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for _, n in work])
    finally:
        del engine.step  # the class's own again
    if engine.device.type == "cuda":
        import torch

        torch.cuda.synchronize()
    return steps[0]
