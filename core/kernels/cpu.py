"""What CPU paths choose by: whether oneDNN runs a dtype on this processor, the clock to time candidates with,
and whether a packed copy of some weights fits beside them.

Kernels on a CPU are chosen by measuring them at start-up (processors differ: a Xeon with AMX, an EPYC
without it), never by the processor's name; these two helpers are what every such measurement shares.
"""

from __future__ import annotations

import fcntl
import functools
import json
import logging
import os
import time
from typing import Callable

import torch

log = logging.getLogger(__name__)

def onednn_runs(dtype: torch.dtype) -> bool:
    """Whether oneDNN has kernels for this dtype on this processor (fp32 wherever torch was built with it;
    bf16 and fp16 where the processor has the instructions: AVX-512-BF16 / AMX, AVX-512-FP16)."""
    return _onednn_runs(dtype)


@functools.cache
def _onednn_runs(dtype: torch.dtype) -> bool:
    if dtype == torch.float32:
        return torch.backends.mkldnn.is_available()
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float16 and torch.ops.mkldnn._is_mkldnn_fp16_supported()


def measuring_clock() -> Callable[[], float]:
    """The calling thread's CPU time where torch runs its ops on that thread alone (time other jobs on the
    machine take from it is not counted), else the wall clock."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def packed_copy_fits(nbytes: int) -> bool:
    """Whether a packed copy of `nbytes` of weights leaves room: at most a quarter of the host memory free now (a
    copy doubles those weights' footprint, and the KV pool is sized from what is left after loading)."""
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # no such figure on this system: assume the copy fits
        return True
    return 4 * nbytes <= free


def machine_cache_dir() -> str:
    """Where measurements of this machine are kept between processes (as autotuners keep theirs)."""
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "moeplex")


class MeasuredChoices:
    """Results of start-up measurements, kept per machine in a JSON file, so that every process on the machine
    (a server's ranks, a prefill and a decode server, the same command run twice) computes alike: the first
    process to need a choice measures it while holding the file's lock, the others wait and read it. A choice
    is keyed by what it depends on: the processor (model name and instruction sets), torch's version and
    threads, and the caller's own key (a shape, a dtype). Unreadable or unwritable files fall back to
    measuring in the process (a warning once)."""

    def __init__(self, path: str | None = None):
        self.path = path or os.path.join(machine_cache_dir(), "cpu_choices.json")
        self.known: dict[str, object] = {}
        self._warned = False

    def get(self, kind: str, key: str, measure: Callable[[], object]):
        full = self._full(kind, key)
        if full in self.known:
            return self.known[full]
        try:
            value = self._from_file(full, measure)
        except OSError as error:
            if not self._warned:
                log.warning("cannot keep CPU kernel choices in %s (%s): measuring in this process only", self.path, error)
                self._warned = True
            value = measure()
        self.known[full] = value
        return value

    def stored(self, kind: str, key: str):
        """What `get` would return if this machine has measured (kind, key) already, else None; measures nothing."""
        full = self._full(kind, key)
        if full not in self.known:
            try:
                stored = self._read()
            except OSError:
                return None
            if full not in stored:
                return None
            self.known[full] = stored[full]
        return self.known[full]

    @staticmethod
    def _full(kind: str, key: str) -> str:
        return f"{kind}|{key}|{_machine()}|torch {torch.__version__}|threads {torch.get_num_threads()}"

    def _from_file(self, full: str, measure: Callable[[], object]):
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                stored = self._read()
                if full in stored:
                    return stored[full]
                value = stored[full] = measure()
                tmp = f"{self.path}.{os.getpid()}.tmp"
                with open(tmp, "w") as f:
                    json.dump(stored, f, indent=0, sort_keys=True)
                os.replace(tmp, self.path)
                return value
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _read(self) -> dict:
        try:
            with open(self.path) as f:
                stored = json.load(f)
            return stored if isinstance(stored, dict) else {}
        except FileNotFoundError:
            return {}
        except ValueError:  # a damaged file: measured again and rewritten
            return {}


@functools.cache
def _machine() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        name = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
        flags = sorted(next(line.split(":", 1)[1] for line in lines if line.startswith("flags")).split())
    except (OSError, StopIteration):
        import platform

        return platform.processor() or platform.machine()
    isa = [f for f in flags if f.startswith(("avx", "amx", "fma", "f16c"))]
    return f"{name} [{' '.join(isa)}]"


_CHOICES = MeasuredChoices()


def measured_choice(kind: str, key: str, measure: Callable[[], object]):
    """`measure()` once per machine for (kind, key), its JSON-able result kept for every later process (MeasuredChoices)."""
    return _CHOICES.get(kind, key, measure)


def stored_choice(kind: str, key: str):
    """This machine's earlier measured_choice for (kind, key), or None where none was made yet (measures nothing)."""
    return _CHOICES.stored(kind, key)
