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

A measured decode step is slower than its reads (launch gaps, kernels below the bandwidth), and a verify step pays
that time too, so with --decode-ms (a measured plain decode step per batch) and --bandwidth (what the card's
kernels reach) the table also predicts the ratio as a verify step's time = the decode step's + its extra bytes /
bandwidth. (H100, 24 layers of 16 experts, batch 1: a plain step of 11.78 ms against 8.9 ms of reads at 3.35 TB/s;
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
    """Bytes a forward reads, by part, for a DeepSeek-V3 config."""

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
        self.kv_row = BYTES * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * context  # one row's cached KV, a layer
        self.dense_layers = c["first_k_dense_replace"]
        self.moe_layers = c["num_hidden_layers"] - self.dense_layers

    def distinct_experts(self, rows: int) -> float:
        return self.experts * (1.0 - (1.0 - self.top_k / self.experts) ** rows)

    def moe_layer(self, rows: int) -> float:
        return self.attention + self.shared + self.distinct_experts(rows) * self.expert + rows * self.kv_row

    def target(self, rows: int) -> float:
        """One forward of the target over `rows` rows (each reading its context's KV)."""
        dense = self.dense_layers * (self.attention + self.dense + rows * self.kv_row)
        return dense + self.moe_layers * self.moe_layer(rows) + self.lm_head

    def mtp_pass(self, rows: int) -> float:
        return self.eh_proj + self.moe_layer(rows) + self.lm_head

    def verify(self, batch: int, drafts: int) -> float:
        """A verify step with `drafts` drafts a request, and the MTP passes that draft the next one."""
        rows = batch * (drafts + 1)
        mtp = self.mtp_pass(rows) + max(drafts - 1, 0) * self.mtp_pass(batch) if drafts else 0.0
        return self.target(rows) + mtp


def tokens_per_step(acceptance: float, drafts: int) -> float:
    return sum(acceptance ** i for i in range(drafts + 1))


def table(args) -> str:
    parts = StepBytes(v3_config(args.layers, args.experts), args.context)
    lines = [f"DeepSeek-V3 shapes, {args.layers} layers of {parts.experts} routed experts (top-{parts.top_k}), "
             f"bf16, acceptance {args.acceptance} a position, {args.context} cached tokens a row",
             "", "| batch | drafts a request | tokens a request a step | distinct experts (decode / verify) | "
             "decode GB | verify + MTP GB | ceiling vs plain | predicted from the decode step |",
             "|---:|---:|---:|---|---:|---:|---:|---:|"]
    measured = dict(zip(args.batches, args.decode_ms or []))
    for batch in args.batches:
        decode = parts.target(batch)
        step_ms = measured.get(batch)
        for drafts in args.steps:
            verify = parts.verify(batch, drafts)
            tokens = tokens_per_step(args.acceptance, drafts)
            predicted = "-"
            if step_ms is not None:
                verify_ms = step_ms + (verify - decode) / (args.bandwidth * 1e9) * 1e3
                predicted = f"{tokens * step_ms / verify_ms:.2f}x ({verify_ms:.1f} ms a step)"
            lines.append(f"| {batch} | {drafts} | {tokens:.2f} | {parts.distinct_experts(batch):.1f} / "
                         f"{parts.distinct_experts(batch * (drafts + 1)):.1f} | {decode / 1e9:.1f} | "
                         f"{verify / 1e9:.1f} | {tokens * decode / verify:.2f}x | {predicted} |")
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
                        help="GB/s the kernels reach, for the prediction (default: %(default)s, ~0.9 of an H100's)")
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args()
    emit(table(args), args.out)


if __name__ == "__main__":
    main()
