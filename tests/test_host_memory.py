"""keep_freed_host_memory: a large CPU tensor allocated again after a free reuses the freed pages
(few page faults), where glibc's defaults hand them back to the kernel and fault every page anew."""

import subprocess
import sys

import pytest

PROBE = """
import resource, sys, torch
if sys.argv[1] == "keep":
    from moeplex.host_memory import keep_freed_host_memory
    assert keep_freed_host_memory()
def step():  # temporaries like a prefill chunk's MoE layer's: 40 + 80 + 48 MiB (above glibc's 32 MiB
    a = torch.zeros(80 << 18, dtype=torch.bfloat16)  # most mmap threshold), each freed at the end
    return a.float().sum() + torch.ones(48 << 18).sum()
for _ in range(8):  # the first rounds grow the heap (2-4 of them, by the order the blocks come back in)
    step()
rounds = []
for _ in range(5):  # the quietest round: the kernel reclaiming idle pages now and then spoils one, not all
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    rounds.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(min(rounds))  # faults per round
"""


def faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's (Linux)")
def test_freed_memory_is_reused_instead_of_faulted_in_again():
    pages = (168 << 20) // 4096
    assert faults("default") > pages // 2  # glibc's defaults: each block is mmapped and unmapped every time
    assert faults("keep") < pages // 20
