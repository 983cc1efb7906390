"""The decode-path kernels of issue 22 (one-launch router, rope with the KV write, split attention that merges
its own splits, one-launch MoE pair sort, the library path's counting sort, the dense projections' GEMV) compile for Hopper, on this machine
whether or not it has a GPU."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia")


def test_kernels_compile_for_sm90(tmp_path):
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path)}  # compiled now, not found in a cache
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("sm90_compile.py"))], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    names = [line.split()[0] for line in done.stdout.splitlines() if "compiled" in line]
    assert names == (["_router_kernel"] * 2 + ["_rope_kernel"] * 2 + ["_split_kernel"] * 3
                     + ["_align_one_launch_kernel"] * 2 + ["_count_kernel", "_place_kernel"] * 3 + ["_gemv_kernel"] * 2)
