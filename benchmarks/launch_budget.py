"""Kernel launches of one decode step, per decoder layer, with the launch-cutting fusions on and off.

    python benchmarks/launch_budget.py [--batch 1 8 32] [--out FILE]

Counts what a decode step launches on the GPU path (triton MoE kernel, triton attention, fused
norms/rope/routing; fp16 stands in for bf16: the same casts), run here on tiny models: every aten op
that computes (views, reshapes and allocations launch nothing and are not counted) and every Triton
kernel launch (the ops a Triton launch issues itself, under the CPU interpreter, are not counted).
A layer's count is the step's count with two MoE layers minus the step's with one; the rest is the
step's fixed part (embedding, final norm, lm_head; with fewer launches the last layer's residual add
too). The step counted is the second decode step, as a replayed graph holds it (the first makes what
is made once). The tiny models keep the real models' top-k (8) so that the MoE alignment takes the
path the real ones take at the same batch. cuBLAS may split a GEMM into more than one kernel on the
GPU; each F.linear counts one here.

Without CUDA this runs under Triton's interpreter (TRITON_INTERPRET=1 is set before the kernels load).
"""

from __future__ import annotations

import argparse
import collections
import os
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from report import emit  # noqa: E402  (benchmarks/report.py, beside this file)

from moeplex.attention.triton_backend import TritonAttention  # noqa: E402
from moeplex.batch_builder import ScheduledSeq, build_forward_batch  # noqa: E402
from moeplex.config import EngineConfig  # noqa: E402
from moeplex.kv_cache import KVPool  # noqa: E402
from moeplex.models.make_model import write_checkpoint  # noqa: E402
from moeplex.models.setup import load_model  # noqa: E402
from moeplex.plugins.moe_kernels.triton_moe.align import ONE_LAUNCH_MAX_PAIRS  # noqa: E402
from moeplex.registry import lookup  # noqa: E402
from moeplex.selection import resolve  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PROMPT = 24  # with splits of 8 tokens, the decode attention splits into parts as at e2e_gpu.py's 128-token context
PAGE = 16
# ops that only view or allocate memory: no kernel
NO_KERNEL = {
    "view", "_unsafe_view", "reshape", "split", "split_with_sizes", "slice", "select", "unsqueeze", "squeeze",
    "expand", "t", "transpose", "permute", "as_strided", "detach", "alias", "empty", "empty_strided", "empty_like",
    "new_empty", "lift_fresh", "unbind", "narrow", "_reshape_alias", "flatten", "unflatten", "contiguous",
    "new_empty_strided", "chunk", "view_as", "numpy_T", "is_nonzero", "item", "_local_scalar_dense", "clone_noop",
}
# (arch, overrides): every layer MoE, top-8 as in the real models
MODELS = {
    "qwen3_moe": {"mlp_only_layers": [], "num_experts": 16, "num_experts_per_tok": 8},
    "deepseek_v3": {"first_k_dense_replace": 0, "n_routed_experts": 16, "num_experts_per_tok": 8},
}


class LaunchCounter(TorchDispatchMode):
    """Counts computing aten ops and Triton launches (not the aten ops a launch makes itself)."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self._in_triton = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        copied = name != "to" or out is not args[0]  # a cast to the tensor's own dtype returns it: no kernel
        if not self._in_triton and name not in NO_KERNEL and copied:
            self.counts[f"aten.{name}"] += 1
        return out

    def wrap_triton(self):
        counter = self
        originals = {cls: cls.run for cls in (JITFunction, InterpretedFunction)}

        def counting(original):
            def run(self, *args, **kwargs):
                counter.counts[f"triton.{self.fn.__name__ if hasattr(self, 'fn') else self.__name__}"] += 1
                counter._in_triton += 1
                try:
                    return original(self, *args, **kwargs)
                finally:
                    counter._in_triton -= 1
            return run

        for cls, original in originals.items():
            cls.run = counting(original)
        return lambda: [setattr(cls, "run", original) for cls, original in originals.items()]


def step_launches(folder: str, batch: int, fewer_launches: bool) -> collections.Counter:
    config = EngineConfig(model=folder, dtype="fp16", device=str(DEVICE), moe_kernel="triton", show_progress=False)
    model = load_model(config.model, config, resolve(config))
    # the H200's 132 SMs: the split count (and whether a reduce runs) that the GPU run has
    model.set_attention_backend(TritonAttention(DEVICE, torch.float16, target_programs=2 * 132, min_split_tokens=8))
    model.use_fused_kernels(True, fewer_launches=fewer_launches)
    model.moe_runtime.kernel.one_launch_align_pairs = ONE_LAUNCH_MAX_PAIRS if fewer_launches else 0
    model.attention_backend.merge_in_split_kernel = fewer_launches
    prompt = PROMPT
    kv = KVPool(batch * (prompt // PAGE + 2), PAGE, model.kv_shapes(), torch.float16, DEVICE)
    strategy = lookup("overlap", "none")()
    pages = [kv.allocate(kv.pages_for(prompt + 2)) for _ in range(batch)]
    with torch.inference_mode():
        prefill = build_forward_batch([ScheduledSeq(list(range(1, prompt + 1)), 0, p) for p in pages], kv, DEVICE)
        model(prefill, kv, strategy)
        # a first decode step makes what is made once (the attention's merge counters), as graph capture's warm-up does
        model(build_forward_batch([ScheduledSeq([7], prompt, p) for p in pages], kv, DEVICE), kv, strategy)
        decode = build_forward_batch([ScheduledSeq([8], prompt + 1, p) for p in pages], kv, DEVICE)
        counter = LaunchCounter()
        restore = counter.wrap_triton()
        try:
            with counter:
                model(decode, kv, strategy)
        finally:
            restore()
    return counter.counts


def budget(arch: str, batch: int, fewer_launches: bool) -> tuple[collections.Counter, collections.Counter]:
    """(launches of one decoder layer by kind, launches outside the layers)."""
    counts = []
    for layers in (1, 2):
        folder = write_checkpoint(tempfile.mkdtemp(), arch, "tiny", overrides={**MODELS[arch], "num_hidden_layers": layers})
        counts.append(step_launches(folder, batch, fewer_launches))
    per_layer = counts[1] - counts[0]
    return per_layer, counts[0] - per_layer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32], help="decode batch sizes")
    parser.add_argument("--arch", choices=list(MODELS), nargs="+", default=list(MODELS), help="models to count")
    parser.add_argument("--out", help="also write the Markdown here")
    args = parser.parse_args()
    lines = ["| model | batch | fewer launches | launches per layer | outside the layers | per layer, by kernel |",
             "|---|---:|---|---:|---:|---|"]
    for arch in args.arch:
        for batch in args.batch:
            for fewer in (False, True):
                layer, fixed = budget(arch, batch, fewer)
                kinds = ", ".join(f"{name} {n}" if n > 1 else name for name, n in sorted(layer.items()))
                lines.append(f"| {arch} | {batch} | {'on' if fewer else 'off'} | {sum(layer.values())} | "
                             f"{sum(fixed.values())} | {kinds} |")
                print(lines[-1], flush=True)
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
