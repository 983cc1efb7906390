"""moeplex's hand-written CPU kernels (csrc/*.cpp), compiled on first use with torch's JIT extension builder.

Each kernel is one small translation unit that registers its ops under `torch.ops.moeplex_cpu`, built with
`-O3 -march=native` (its inner loops over the head or hidden width vectorize to the processor's widest
registers) into a folder per processor and torch version under the machine cache (`machine_cache_dir`), so it
is built once per machine and every later process, test worker or server rank loads it (torch's builder holds
a lock there while one process compiles). Where the build cannot run (no compiler, no ninja, a compile error)
`load_kernel` returns None, logs one line saying why, and the callers simply do not offer the kernel's ways.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import time

import torch

from .cpu import _machine, machine_cache_dir

log = logging.getLogger(__name__)

SOURCES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
# fused multiply-adds in the vector loops; OpenMP, or at::parallel_for (whose parallel region is compiled into the
# kernel from torch's headers) runs on one thread whatever torch's thread count (the runtime is torch's own libgomp,
# already loaded under the same name)
FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp"]


def build_directory(name: str) -> str:
    """One folder per kernel, processor (its instruction sets: -march=native code may not run on another), torch
    and source text (the shared headers too, which torch's own check of the sources does not cover)."""
    key = hashlib.sha1(f"{_machine()}|torch {torch.__version__}|{' '.join(FLAGS)}".encode())
    for file in [f"{name}.cpp"] + sorted(f for f in os.listdir(SOURCES) if f.endswith(".h")):
        with open(os.path.join(SOURCES, file), "rb") as f:
            key.update(f.read())
    return os.path.join(machine_cache_dir(), "cpu_kernels", f"{name}-{key.hexdigest()[:12]}")


def load_kernel(name: str) -> bool:
    """Build (once per machine) and load csrc/`name`.cpp; True when its ops are in torch.ops.moeplex_cpu."""
    return _load(name) is None


def ops(name: str):
    """torch.ops.moeplex_cpu with csrc/`name`.cpp's ops loaded (built first if need be); RuntimeError where it cannot build."""
    reason = _load(name)
    if reason is not None:
        raise RuntimeError(f"moeplex's CPU kernel {name} is not available here: {reason}")
    return torch.ops.moeplex_cpu


def why_not(name: str) -> str | None:
    """None where the kernel loads, else why it does not (for logs and test skips)."""
    return _load(name)


def kernel_names() -> list[str]:
    """Every kernel in csrc/ (one .cpp each)."""
    return sorted(f.removesuffix(".cpp") for f in os.listdir(SOURCES) if f.endswith(".cpp"))


def build_all(names: list[str] | None = None) -> None:
    """Build the kernels this machine has not built yet, each in its own process at once (one compiler each; one
    after the other they take the sum of their compile times), so that later `load_kernel` calls only load them.
    A process rather than a thread per kernel: torch's loader switches the process's dlopen flags around each
    load, which two threads loading at once could leave switched. A build that fails here fails again, and says
    why, where the kernel is first loaded."""
    todo = [name for name in (kernel_names() if names is None else names) if not os.path.exists(_library(name))]
    if len(todo) < 2:  # nothing to overlap: the first load_kernel builds it as before
        return
    code = "import sys; from moeplex.kernels import cpu_ext; cpu_ext.load_kernel(sys.argv[1])"
    builds = [subprocess.Popen([sys.executable, "-c", code, name], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
              for name in todo]
    for build in builds:
        build.wait()


def _library(name: str) -> str:
    return os.path.join(build_directory(name), f"moeplex_cpu_{name}.so")


@functools.cache
def _load(name: str) -> str | None:
    try:
        from torch.utils import cpp_extension

        _find_ninja()
        folder = build_directory(name)
        os.makedirs(folder, exist_ok=True)
        _clear_stale_lock(folder)
        start = time.perf_counter()
        cpp_extension.load(
            name=f"moeplex_cpu_{name}",
            sources=[os.path.join(SOURCES, f"{name}.cpp")],
            extra_cflags=FLAGS,
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[SOURCES],
            build_directory=folder,
            is_python_module=False,
            verbose=False,
        )
        took = time.perf_counter() - start
        if took > 2:  # compiled now (a built kernel loads in a fraction of a second): say why start-up took longer
            log.info("CPU kernel %s built in %.0f s (once per machine, kept in %s)", name, took, folder)
        return None
    except Exception as error:  # no compiler, no ninja, a compile error: the kernel's ways are not offered
        reason = f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}"
        log.warning("CPU kernel %s not built (%s): its ways are not offered", name, reason)
        return reason


STALE_LOCK_S = 600  # no build takes this long: an older lock is a build that was killed


def _clear_stale_lock(folder: str) -> None:
    """torch's builder waits for as long as its lock file exists; a process killed while building (Ctrl-C, a CI
    timeout) leaves it behind, and every later process would wait forever."""
    lock = os.path.join(folder, "lock")
    try:
        if time.time() - os.path.getmtime(lock) > STALE_LOCK_S:
            os.remove(lock)
            log.warning("removed a stale build lock in %s (a build was killed)", folder)
    except FileNotFoundError:
        pass


def _find_ninja() -> None:
    """torch's builder runs `ninja` from PATH; pip's ninja package (a dependency) puts it beside this Python, which
    is not on PATH when the venv's python is run by its full path."""
    if shutil.which("ninja"):
        return
    here = os.path.dirname(sys.executable)
    if os.path.exists(os.path.join(here, "ninja")):
        os.environ["PATH"] = here + os.pathsep + os.environ.get("PATH", "")
