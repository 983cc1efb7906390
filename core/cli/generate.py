"""`moeplex generate`: run prompts through the engine and print the completions."""

from __future__ import annotations

import json
import sys

from ..ranks.offline import generate
from ..sampling import SamplingParams
from ..tokenizer import load_tokenizer
from .flags import add_engine_flags, engine_config


RANDOM_DEFAULT_NOTE = (
    "moeplex generate: note: without --model this runs the embedded default, a tiny DeepSeek-V3 with random "
    "weights, so its text is meaningless; pass --model DIR for a real checkpoint"
)


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate completions for prompts (offline, batched)")
    inputs = p.add_mutually_exclusive_group(required=True)
    inputs.add_argument("--prompt", nargs="+", metavar="TEXT", help="one or more prompts (needs a tokenizer)")
    inputs.add_argument(
        "--input-ids", nargs="+", metavar="IDS", help="one or more prompts as comma-separated token ids, e.g. 1,2,3"
    )
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per prompt (default: 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0)")
    p.add_argument("--top-k", type=int, default=-1, help="sample among the k most likely tokens; -1 is off")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p * the top probability")
    p.add_argument("--stop", nargs="*", default=[], help="stop strings")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating after the eos token")
    p.add_argument("--logprobs", type=int, default=0, metavar="K", help="report the top-K log-probabilities per step")
    p.add_argument("--prompt-logprobs", type=int, default=None, metavar="K",
                   help="report every prompt token's log-probability and the top-K (prompt_logprobs in the output)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, metavar="X",
                   help="in [-2, 2]: subtract it times each generated token's count from its logit (default: 0)")
    p.add_argument("--presence-penalty", type=float, default=0.0, metavar="X",
                   help="in [-2, 2]: subtract it from the logit of every token generated so far (default: 0)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, metavar="X",
                   help="> 0: divide positive (multiply negative) logits of prompt and output tokens by it (default: 1, off)")
    p.add_argument("--min-tokens", type=int, default=0, metavar="N", help="generate at least this many tokens before eos may end it")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_engine_flags(p, serving=False)
    p.set_defaults(run=run)


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--input-ids expects comma-separated integers, got {text!r}") from None


def run(args) -> int:
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed if args.temperature > 0 else None,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
        prompt_logprobs=args.prompt_logprobs,
        frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty,
        repetition_penalty=args.repetition_penalty,
        min_tokens=args.min_tokens,
    )
    config = engine_config(args, show_progress=not args.json)
    if not args.model:
        print(RANDOM_DEFAULT_NOTE, file=sys.stderr)
    tokenizer = load_tokenizer(config.model)
    if args.prompt and tokenizer is None:
        raise ValueError(f"{config.model} has no tokenizer.json; pass --input-ids instead of --prompt")
    prompts = [_parse_ids(t) for t in args.input_ids] if args.input_ids else [tokenizer.encode(t).ids for t in args.prompt]
    results = generate(config, prompts, params)
    if results is None:  # a node other than 0 ran its ranks; node 0 prints the completions
        return 0
    for i, result in enumerate(results):
        result = {"index": i, **result}
        if not args.logprobs:
            del result["logprobs"]
        if args.json:
            print(json.dumps(result))
        else:
            shown = result.get("text", result["output_ids"])
            prompt = args.prompt[i] if args.prompt else args.input_ids[i]
            print(f"[{i}] {prompt!r} -> {shown!r} ({result['finish_reason']})")
    return 0
