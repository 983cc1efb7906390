"""The most a verify step can give on a memory-bound GPU: bytes read per token, plain decode against speculation.

    python benchmarks/spec_ceiling.py [--layers 24] [--experts 16] [--acceptance 0.8] [--steps 3 4 5] [--batches 1 8 32]

A decode step of B requests reads every weight it uses once: attention, the dense and shared MLPs, lm_head, and each
routed expert that at least one of its rows picked, plus each row's cached KV. A verify step of B requests with n
drafts each runs B * (n + 1) rows, so it picks more distinct experts (at small B the dearest part of speculating on
an MoE), and the MTP layer runs once over the positions the step kept (B * (n + 1) rows) and n - 1 more times over
one row a request to draft the next step, each pass reading that layer and lm_head again. With a per-position
acceptance a, a request gains 1 + a + ... + a^n tokens a step, so on a card whose steps are bound by memory reads
speculation gives at most

    ceiling(B, n) = (1 + a + ... + a^n) * bytes(decode step, B) / bytes(verify step, B, n).

Each kernel group (a layer's attention weights, its KV, its dense or shared MLP, its routed experts, lm_head) takes
the slower of its reads at --bandwidth and its arithmetic at --peak-tflops: at 32 requests a verify step's 128
rows make the attention projections and lm_head cost arithmetic too. A measured decode step is slower than its
roofline (launch gaps, kernels below the bandwidth), and a verify step pays that time too, so with --decode-ms (a
measured plain decode step per batch) the table also predicts the ratio, a verify step's time being the decode
step's plus the difference of their rooflines. (H100, 24 layers of 16 experts, batch 1: a plain step of 11.78 ms against 8.9 ms of reads at 3.35 TB/s;
the prediction at 3 drafts, 1.78x, against decode-only steps measured at 1.80x.)

Rows pick experts as independent uniform draws of top-k from E (what the synthetic checkpoints' random gates do:
each row's routing is a function of its token), so r rows touch E * (1 - (1 - k/E)^r) experts on average. Compute,
launches and the host are left out: a ceiling, which measured steps approach where the step is bound by reads
(H100, DeepSeek-V3 shapes with 24 layers of 16 experts, batch 1: decode-only steps 1.80x with 3 steps, against a
ceiling printed here, 1.66x: that step is not bound by its reads alone, hence --decode-ms). The shapes are DeepSeek-V3's (make-model's v3 preset) with --layers and --experts.
"""

from __future__ import annotations

import argparse
import sys
import os

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import emit  # noqa: E402

BYTES = 2  # bf16


def v3_config(layers: int, experts: int | None) -> dict:
    from moeplex.models.deepseek_v3 import PRESETS

    config = dict(PRESETS["v3"], num_hidden_layers=layers)
    if experts:
        config["n_routed_experts"] = experts
    return config


class StepBytes:
    """What a forward reads and computes, by kernel group, for a DeepSeek-V3 config."""

    def __init__(self, c: dict, context: int):
        h, heads = c["hidden_size"], c["num_attention_heads"]
        qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
        self.attention = BYTES * (h * c["q_lora_rank"] + c["q_lora_rank"] * heads * qk
                                  + h * (c["kv_lora_rank"] + c["qk_rope_head_dim"])
                                  + c["kv_lora_rank"] * heads * (c["qk_nope_head_dim"] + c["v_head_dim"])
                                  + heads * c["v_head_dim"] * h)
        self.dense = BYTES * 3 * h * c["intermediate_size"]
        self.shared = BYTES * 3 * h * c["moe_intermediate_size"] * c["n_shared_experts"]
        self.expert = BYTES * 3 * h * c["moe_intermediate_size"]
        self.experts, self.top_k = c["n_routed_experts"], c["num_experts_per_tok"]
        self.lm_head = BYTES * c["vocab_size"] * h
        self.eh_proj = BYTES * 2 * h * h
        self.latent, self.heads, self.context = c["kv_lora_rank"] + c["qk_rope_head_dim"], heads, context
        self.kv_row = BYTES * self.latent * context  # one row's cached KV, a layer
        self.dense_layers = c["first_k_dense_replace"]
        self.moe_layers = c["num_hidden_layers"] - self.dense_layers

    def distinct_experts(self, rows: int) -> float:
        return self.experts * (1.0 - (1.0 - self.top_k / self.experts) ** rows)

    def _layer(self, rows: int, mlp: str) -> list[tuple[float, float]]:
        """(bytes, flops) of each kernel group of one layer over `rows` rows: a weight's flops are 2 a parameter a
        row (an expert's, a row that picked it), the KV's those of absorbed MLA over the row's context."""
        kv = (rows * self.kv_row, 2 * rows * self.heads * self.context * self.latent)
        parts = [self._dense(self.attention, rows), kv]
        if mlp == "dense":
            return parts + [self._dense(self.dense, rows)]
        experts = (self.distinct_experts(rows) * self.expert, 2 * self.expert / BYTES * rows * self.top_k)
        return parts + [self._dense(self.shared, rows), experts]

    @staticmethod
    def _dense(weight_bytes: float, rows: int) -> tuple[float, float]:
        return weight_bytes, 2 * weight_bytes / BYTES * rows

    def target(self, rows: int) -> list[tuple[float, float]]:
        """One forward of the target over `rows` rows (each reading its context's KV)."""
        return self.dense_layers * self._layer(rows, "dense") + self.moe_layers * self._layer(rows, "moe") + \
            [self._dense(self.lm_head, rows)]

    def mtp_pass(self, rows: int) -> list[tuple[float, float]]:
        return [self._dense(self.eh_proj, rows), *self._layer(rows, "moe"), self._dense(self.lm_head, rows)]

    def verify(self, batch: int, drafts: int) -> list[tuple[float, float]]:
        """A verify step with `drafts` drafts a request, and the MTP passes that draft the next one: one over the
        positions the step kept, then one a further draft over a row a request."""
        rows = batch * (drafts + 1)
        mtp = self.mtp_pass(rows) + max(drafts - 1, 0) * self.mtp_pass(batch) if drafts else []
        return self.target(rows) + mtp


def reads(parts: list[tuple[float, float]]) -> float:
    return sum(b for b, _ in parts)


def roofline_s(parts: list[tuple[float, float]], bandwidth: float, peak: float) -> float:
    """Seconds with each kernel group at the slower of its reads and its arithmetic."""
    return sum(max(b / bandwidth, f / peak) for b, f in parts)


def tokens_per_step(acceptance: float, drafts: int) -> float:
    return sum(acceptance ** i for i in range(drafts + 1))


def table(args) -> str:
    parts = StepBytes(v3_config(args.layers, args.experts), args.context)
    bandwidth, peak = args.bandwidth * 1e9, args.peak_tflops * 1e12
    lines = [f"DeepSeek-V3 shapes, {args.layers} layers of {parts.experts} routed experts (top-{parts.top_k}), "
             f"bf16, acceptance {args.acceptance} a position, {args.context} cached tokens a row; kernels at "
             f"{args.bandwidth:.0f} GB/s and {args.peak_tflops:.0f} TFLOP/s",
             "", "| batch | drafts a request | tokens a request a step | distinct experts (decode / verify) | "
             "GB read (decode / verify + MTP) | roofline ms (decode / verify + MTP) | ceiling vs plain | "
             "predicted from the measured decode step |", "|---:|---:|---:|---|---|---|---:|---:|"]
    measured = dict(zip(args.batches, args.decode_ms or []))
    for batch in args.batches:
        decode = parts.target(batch)
        decode_ms = roofline_s(decode, bandwidth, peak) * 1e3
        for drafts in args.steps:
            verify = parts.verify(batch, drafts)
            verify_ms = roofline_s(verify, bandwidth, peak) * 1e3
            tokens = tokens_per_step(args.acceptance, drafts)
            predicted = "-"
            if batch in measured:  # the verify step pays the decode step's time beyond its roofline too
                step_ms = measured[batch] + verify_ms - decode_ms
                predicted = f"{tokens * measured[batch] / step_ms:.2f}x ({step_ms:.1f} ms a step)"
            lines.append(f"| {batch} | {drafts} | {tokens:.2f} | {parts.distinct_experts(batch):.1f} / "
                         f"{parts.distinct_experts(batch * (drafts + 1)):.1f} | {reads(decode) / 1e9:.1f} / "
                         f"{reads(verify) / 1e9:.1f} | {decode_ms:.1f} / {verify_ms:.1f} | "
                         f"{tokens * decode_ms / verify_ms:.2f}x | {predicted} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24, help="num_hidden_layers (default: %(default)s)")
    parser.add_argument("--experts", type=int, default=16, help="n_routed_experts (default: %(default)s; 0: "
                        "DeepSeek-V3's 256)")
    parser.add_argument("--acceptance", type=float, default=0.8, help="per-position acceptance (default: %(default)s)")
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 2, 3, 4, 5], help="drafts a request a step")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=160, help="cached tokens a row reads (default: %(default)s)")
    parser.add_argument("--decode-ms", type=float, nargs="+", help="a measured plain decode step's ms, one per batch")
    parser.add_argument("--bandwidth", type=float, default=3000.0,
                        help="GB/s the kernels reach (default: %(default)s, ~0.9 of an H100's)")
    parser.add_argument("--peak-tflops", type=float, default=660.0,
                        help="bf16 TFLOP/s the kernels reach (default: %(default)s, ~2/3 of an H100's dense peak)")
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args()
    emit(table(args), args.out)


if __name__ == "__main__":
    main()
