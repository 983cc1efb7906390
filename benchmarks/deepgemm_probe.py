"""One small masked and one small contiguous DeepGEMM fp8 GEMM against a float reference: does the installed
DeepGEMM run here at all (its JIT compiles, its kernels launch), before benchmarks/deepgemm_masked.py times it?

    DG_JIT_DEBUG=1 python benchmarks/deepgemm_probe.py

4 experts, 128 rows each (counts 1, 8, 0, 128), N 512, K 512; weights and activations quantized as the deepgemm
plugin quantizes them. Prints each call's largest relative error, or the exception it raised.
"""

from __future__ import annotations

import torch

from moeplex.interfaces.kernels import dequantize_blocks, quantize_blocks, quantize_rows

EXPERTS, ROWS, N, K = 4, 128, 512, 512


def main() -> None:
    import deep_gemm as dg

    print("deep_gemm", getattr(dg, "__version__", "?"), "on", torch.cuda.get_device_name(), flush=True)
    torch.manual_seed(0)
    pairs = [quantize_blocks(torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.05) for _ in range(EXPERTS)]
    w = torch.stack([v for v, _ in pairs]).contiguous()
    ws = torch.stack([s for _, s in pairs]).float().contiguous()
    dense = torch.stack([dequantize_blocks(v, s) for v, s in pairs]).float()
    counts = torch.tensor([1, 8, 0, ROWS], dtype=torch.int32, device="cuda")
    hidden = torch.randn(EXPERTS, ROWS, K, device="cuda", dtype=torch.bfloat16)
    a = quantize_rows(hidden, counts)
    out = torch.zeros(EXPERTS, ROWS, N, device="cuda", dtype=torch.bfloat16)
    print("masked: calling", flush=True)
    try:
        dg.m_grouped_fp8_gemm_nt_masked(a, (w, ws), out, counts, 8)
        torch.cuda.synchronize()
        ref = torch.einsum("erk,enk->ern", hidden.float(), dense)
        worst = max(float(((out[e, :c].float() - ref[e, :c]).norm() / ref[e, :c].norm().clamp_min(1e-6)))
                    for e, c in enumerate(counts.tolist()) if c)
        print(f"masked: ok, largest relative error {worst:.4f}", flush=True)
    except Exception as error:  # noqa: BLE001 (the probe reports whatever DeepGEMM raises)
        print(f"masked: {type(error).__name__}: {error}", flush=True)
    index = torch.arange(EXPERTS, device="cuda", dtype=torch.int32).repeat_interleave(ROWS)
    flat = hidden.reshape(-1, K)
    out = torch.zeros(EXPERTS * ROWS, N, device="cuda", dtype=torch.bfloat16)
    print("contiguous: calling", flush=True)
    try:
        dg.m_grouped_fp8_gemm_nt_contiguous(quantize_rows(flat), (w, ws), out, index)
        torch.cuda.synchronize()
        ref = torch.einsum("rk,rnk->rn", flat.float(), dense[index.long()])
        print(f"contiguous: ok, relative error {float((out.float() - ref).norm() / ref.norm()):.4f}", flush=True)
    except Exception as error:  # noqa: BLE001
        print(f"contiguous: {type(error).__name__}: {error}", flush=True)


if __name__ == "__main__":
    main()
