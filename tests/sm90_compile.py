"""Compiles the decode-path Triton kernels of issue 22 for Hopper (sm90) on any machine, GPU or not: Triton's
front end and ptxas (shipped in the triton wheel) run without a device. The interpreter that runs the CPU
tests never compiles, so it lets through what only the compiler refuses (a name rebound to another type
inside a runtime `if`, a shape the GPU layout cannot take). Run as a script with TRITON_INTERPRET unset
(tests/test_kernels_compile_sm90.py does)."""
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget

from moeplex.kernels.router_gemv import _router_kernel
from moeplex.kernels.rope import _rope_kernel
from moeplex.attention.triton_decode import _split_kernel
from moeplex.plugins.moe_kernels.triton_moe.align import _align_one_launch_kernel
from moeplex.plugins.moe_kernels.triton_moe.group import _count_kernel, _place_kernel
from moeplex.kernels.gemv import _gemv_kernel

target = GPUTarget("cuda", 90, 32)


def compile_(fn, sig, constexprs) -> str:
    """Compile `fn` with argument types `sig` and constexprs; its name on success (raises otherwise)."""
    names = fn.arg_names
    signature = {}
    for n in names:
        signature[n] = "constexpr" if n in constexprs else sig[n]
    src = ASTSource(fn, signature, {(names.index(k),): v for k, v in constexprs.items()})
    k = triton.compile(src, target=target)
    return f"{fn.__name__} compiled, shared memory {k.metadata.shared}"



def jobs() -> list[tuple]:
    """(kernel, argument types, constexprs) of every compile, in the order they are reported."""
    found = []

    def add(fn, sig, constexprs):
        found.append((fn, sig, constexprs))

    add(_router_kernel, dict(x_ptr="*bf16", w_ptr="*fp32", bias_ptr="*fp32", logits_ptr="*fp32", counter_ptr="*i32",
                             ids_ptr="*i64", weights_ptr="*fp32", num_tokens="i32", num_experts="i32", hidden="i32",
                             scaling_factor="fp32", stride_xt="i32", stride_we="i32"),
        dict(TOP_K=8, SIGMOID=False, HAS_BIAS=False, NORMALIZE=True, NUM_GROUPS=1, GROUP_SIZE=128, TOPK_GROUPS=1,
             K_PAD=8, BLOCK_T=16, BLOCK_E=1, BLOCK_H=2048))
    add(_router_kernel, dict(x_ptr="*bf16", w_ptr="*fp32", bias_ptr="*fp32", logits_ptr="*fp32", counter_ptr="*i32",
                             ids_ptr="*i64", weights_ptr="*fp32", num_tokens="i32", num_experts="i32", hidden="i32",
                             scaling_factor="fp32", stride_xt="i32", stride_we="i32"),
        dict(TOP_K=8, SIGMOID=True, HAS_BIAS=True, NORMALIZE=True, NUM_GROUPS=8, GROUP_SIZE=32, TOPK_GROUPS=4,
             K_PAD=8, BLOCK_T=1, BLOCK_E=1, BLOCK_H=4096))
    for write in (False, True):
        add(_rope_kernel, dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", positions_ptr="*i64", inv_freq_ptr="*fp32",
                               q_norm_ptr="*bf16", k_norm_ptr="*bf16", slots_ptr="*i64", k_cache_ptr="*bf16",
                               v_cache_ptr="*bf16", q_heads="i32", k_heads="i32", head_dim="i32", stride_qt="i32",
                               stride_qh="i32", stride_kt="i32", stride_kh="i32", stride_vt="i32", stride_vh="i32",
                               stride_kcs="i32", stride_kch="i32", stride_vcs="i32", stride_vch="i32", scale="fp32",
                               eps="fp32"),
            dict(INTERLEAVED=False, NORM=True, WRITE_KV=write, BLOCK_H=8, BLOCK_HALF=64))
    split_signature = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", page_table_ptr="*i32", seq_lens_ptr="*i32",
                           out_ptr="*fp32", lse_ptr="*fp32", final_ptr="*bf16", counter_ptr="*i32", scale="fp32",
                           page_size="i32", group="i32", head_blocks="i32", dv="i32", tail="i32",
                           **{n: "i32" for n in ("stride_qb", "stride_qh", "stride_ks", "stride_kh", "stride_vs",
                                                 "stride_vh", "stride_pb", "stride_ob", "stride_oh", "stride_os",
                                                 "stride_lb", "stride_lh", "stride_fb", "stride_fh")})
    for merge in (False, True):  # MHA (Qwen3) with and without the merge in the split kernel
        add(_split_kernel, split_signature,
            dict(NUM_SPLITS=32, BLOCK_H=16, BLOCK_N=64, BLOCK_D=128, BLOCK_T=16, HAS_TAIL=False, SHARED_KV=False,
                 DOT_PRECISION="tf32", MERGE=merge, BLOCK_S=32))
    add(_split_kernel, split_signature,  # MLA's latent (DeepSeek-V3), merged
        dict(NUM_SPLITS=8, BLOCK_H=16, BLOCK_N=32, BLOCK_D=512, BLOCK_T=64, HAS_TAIL=True, SHARED_KV=True,
             DOT_PRECISION="tf32", MERGE=True, BLOCK_S=8))
    add(_align_one_launch_kernel, dict(topk_ids_ptr="*i64", sorted_ids_ptr="*i32", block_expert_ptr="*i32",
                                       num_padded_ptr="*i32", shift_ptr="*i32", num_pairs="i32", num_experts="i32",
                                       num_slots="i32", num_tiles="i32"),
        dict(BLOCK_M=16, PAIRS=256, EXPERTS=128, SLOTS_PER_STEP=1024, TILES_PER_STEP=32))
    add(_align_one_launch_kernel, dict(topk_ids_ptr="*i64", sorted_ids_ptr="*i32", block_expert_ptr="*i32",
                                       num_padded_ptr="*i32", shift_ptr="*i32", num_pairs="i32", num_experts="i32",
                                       num_slots="i32", num_tiles="i32"),
        dict(BLOCK_M=64, PAIRS=1024, EXPERTS=256, SLOTS_PER_STEP=1024, TILES_PER_STEP=32))
    # the library path's counting sort (issue 31 target 5): EP8's 32 local experts, and 256 (two place steps); unpadded
    # for the gather, padded to the gated GEMM 1's 64-row tiles
    for ids, experts, tile in (("*i32", 32, 1), ("*i32", 32, 64), ("*i64", 256, 1)):
        add(_count_kernel, dict(ids_ptr=ids, counts_ptr="*i32", num_pairs="i32", num_experts="i32", num_chunks="i32"),
            dict(CHUNK=128, EXPERTS=experts))
        add(_place_kernel, dict(ids_ptr=ids, cum_ptr="*i32", row_ptr="*i32", pair_row_ptr="*i32", offs_ptr="*i32",
                                block_expert_ptr="*i32", num_pairs="i32", num_experts="i32", num_chunks="i32",
                                num_rows="i32", num_tiles="i32", row_div="i32"),
            dict(TILE=tile, CHUNK=128, EXPERTS_PER_STEP=min(experts, 64), TILES_PER_STEP=64))
    # the dense projections' GEMV at one and four rows (moeplex.kernels.gemv), with a bias and without
    for rows, block_n, bias in ((1, 8, False), (4, 16, True)):
        add(_gemv_kernel, dict(x_ptr="*bf16", w_ptr="*bf16", bias_ptr="*bf16", out_ptr="*bf16", rows="i32", n="i32",
                               k="i32", stride_xm="i32", stride_wn="i32", stride_om="i32"),
            dict(HAS_BIAS=bias, BLOCK_M=rows, BLOCK_N=block_n, BLOCK_K=512))
    return found


def compile_job(index: int) -> str:
    return compile_(*jobs()[index])


def main() -> None:
    """The compiles side by side, one process per core (each is independent and single-threaded); their lines
    in the order of jobs()."""
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1, mp_context=multiprocessing.get_context("fork")) as pool:
        for line in pool.map(compile_job, range(len(jobs()))):
            print(line, flush=True)


if __name__ == "__main__":
    main()
