"""Structured outputs: decode tokens/s with a JSON-schema constraint against unconstrained decoding, in one
process and one engine, and the grammar compile time (p50/p99, cold and cached).

    .venv/bin/python benchmarks/structured_outputs.py --runs 3                   CPU, tiny Qwen3-MoE
    python benchmarks/structured_outputs.py --device cuda --runs 3               H200: Qwen3-30B-A3B shapes, dummy weights

Both rows of a batch decode greedily exactly --output-len tokens per request: unconstrained with ignore_eos; the
constrained one under a JSON schema (an object with one string too long to close within --output-len tokens), so
both do the same number of steps; inside the string nearly every token is allowed, so both pick from about the
same tokens and reach about as many experts, and only the mask's cost differs. The mask of a vocabulary is what costs, and
what it costs depends on how many tokens can close a string or cross a JSON delimiter mid-token (xgrammar checks
those one by one at every step; the rest come from its per-state cache). No real tokenizer can be downloaded here, so
the checkpoint's tokenizer is replaced by a byte-level BPE of --tokenizer-vocab tokens (the model's size by default
on a GPU: 151,643 like Qwen's) *trained* at start on the running Python's standard library sources (with its installed packages' sources
where a trimmed library has too few merges); ~2% of its tokens hold a quote, as in released code-and-text
vocabularies; kept in ~/.cache/moeplex so a machine trains it once). `--tokenizer synthetic` takes random merges of JSON-like
pieces instead: 22% of its tokens hold a quote, which makes every mask ~20x slower than a real vocabulary's.
Decode tokens/s counts the tokens after every request's first one over the wall time of those steps; median of
--runs, min-max beside it. "step-loop CPU overhead": the step loop thread's CPU time per token, constrained over
unconstrained (median of the runs' ratios): on a shared machine the wall-time numbers move with the other
processes, this one barely; the grammar's worker thread (tokens fed, next masks filled) is not in it.
Compile: --schemas distinct schemas (nested objects, enums, patterns, bounded arrays) through a fresh compiler of
the --grammar-backend, each once cold and once from the cache.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from moeplex.config import EngineConfig
from moeplex.engine import Engine
from moeplex.grammar.book import make_backend
from moeplex.grammar.compiler import GrammarCompiler
from moeplex.interfaces import JSON_SCHEMA, Constraint
from moeplex.models.make_model import BOS, EOS, PAD, WEIGHTED_PRESETS, write_checkpoint
from moeplex.registry import lookup
from moeplex.sampling import SamplingParams
from report import emit
from timing import decode_rate

ALPHABET = list('abcdefghijklmnopqrstuvwxyz0123456789{}[]":,. _-')


def synthetic_tokenizer(size: int, seed: int = 0) -> Tokenizer:
    """A byte-level BPE of `size` ids: bytes 0-255, bos/eos/pad at 256-258, then merges of JSON-like pieces."""
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    mapping = {c: i for i, c in enumerate(sorted(byte_chars, key=_byte_of))}
    vocab = dict(mapping)
    vocab.update({BOS: 256, EOS: 257, PAD: 258})
    rng = random.Random(seed)
    pieces = [c if c != " " else "Ġ" for c in ALPHABET]
    tokens, merges = list(pieces), []
    while len(vocab) < size:
        a, b = rng.choice(tokens), rng.choice(tokens)
        if len(a) + len(b) > 12 or a + b in vocab:
            continue
        vocab[a + b] = len(vocab)
        merges.append((a, b))
        tokens.append(a + b)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([BOS, EOS, PAD])
    return tokenizer


def trained_tokenizer(size: int) -> Tokenizer:
    """A byte-level BPE of `size` ids trained on this Python's standard library sources: bytes 0-255, bos/eos/pad at
    256-258 (the ids make_model's checkpoints use), then the learned merges. Cached per Python version and size."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "moeplex"
    path = cache / f"stdlib_bpe_py{sys.version_info[0]}{sys.version_info[1]}_{size}.json"
    if not path.exists():
        learner = Tokenizer(models.BPE())
        learner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        folders = [sysconfig.get_paths()["stdlib"]]
        # a trimmed standard library (some images ship one) has too few merges for a large vocabulary: then the
        # installed packages' sources too
        for extra in (None, sysconfig.get_paths()["purelib"]):
            if extra:
                folders.append(extra)
            learner.train_from_iterator(_python_sources(folders), trainers.BpeTrainer(
                vocab_size=size - 3, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
            if learner.get_vocab_size() >= size - 3:
                break
        cache.mkdir(parents=True, exist_ok=True)
        learner.save(str(path.with_suffix(".tmp")))
        path.with_suffix(".tmp").replace(path)
    learned = json.loads(path.read_text())["model"]
    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet(), key=_byte_of)
    vocab = {c: i for i, c in enumerate(byte_chars)}
    vocab.update({BOS: 256, EOS: 257, PAD: 258})
    for piece, _ in sorted(learned["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([BOS, EOS, PAD])
    return tokenizer


def _python_sources(folders: list[str], limit: int = 40_000_000):
    """The .py files under `folders`, in order, up to about `limit` characters (training time stays ~a minute)."""
    total = 0
    for folder in folders:
        for file in sorted(Path(folder).rglob("*.py")):
            try:
                text = file.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            yield text
            total += len(text)
            if total > limit:
                return


def _byte_of(char: str) -> int:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    code = ord(char)
    return code if code in printable else [b for b in range(256) if b not in printable][code - 256]


def long_schema(tokens: int) -> Constraint:
    """An object whose one string field cannot close within `tokens` tokens (no token spells more than 12
    characters). Inside a JSON string nearly every token is allowed, so the model picks from about the same tokens
    as unconstrained and routes to about as many experts: a schema of digits only would make the constrained run
    faster on MoE models (a handful of distinct tokens reach fewer experts) and hide the mask's cost."""
    schema = {"type": "object", "properties": {"text": {"type": "string", "minLength": 12 * tokens + 1}},
              "required": ["text"], "additionalProperties": False}
    return Constraint(JSON_SCHEMA, json.dumps(schema))


def compile_schemas(count: int) -> list[Constraint]:
    out = []
    for i in range(count):
        props = {f"field_{i}_{j}": kind for j, kind in enumerate([
            {"type": "string", "pattern": "^[a-z]{1,8}$"}, {"enum": ["a", "b", f"c{i}"]},
            {"type": "integer", "minimum": 0, "maximum": 100 + i},
            {"type": "array", "items": {"type": "number"}, "maxItems": 4},
            {"type": "object", "properties": {"x": {"type": "boolean"}, "y": {"anyOf": [{"type": "null"}, {"type": "string"}]}},
             "required": ["x"], "additionalProperties": False},
        ])}
        out.append(Constraint(JSON_SCHEMA, json.dumps({"type": "object", "properties": props, "required": list(props)[:3],
                                                        "additionalProperties": False})))
    return out





def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="default: 1 8 CPU, 1 8 32 64 GPU")
    parser.add_argument("--output-len", type=int, default=None, help="tokens per request (default: 24 CPU, 128 GPU)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--grammar-backend", default="xgrammar")
    parser.add_argument("--tokenizer-vocab", type=int, default=None, help="synthetic tokenizer size (default: 4096 CPU, "
                        "151643 GPU)")
    parser.add_argument("--tokenizer", choices=("trained", "synthetic"), default="trained",
                        help="trained: a BPE learned from the Python standard library's sources (default); synthetic: "
                        "random merges of JSON-like pieces (a quote in 22%% of its tokens: slow masks)")
    parser.add_argument("--preset", default=None, help="Qwen3-MoE shapes (default: 30b-a3b on a GPU, tiny on a CPU)")
    parser.add_argument("--dummy-weights", action="store_true", default=None,
                        help="write only config.json and make random weights at load (--load-format dummy; the default "
                        "on a GPU, and for any preset but tiny and small)")
    parser.add_argument("--qwen-layers", type=int, default=None, help="decoder layers (default: the preset's; 48 for "
                        "30b-a3b)")
    parser.add_argument("--schemas", type=int, default=40, help="distinct schemas compiled (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="CPU: torch threads (default: %(default)s)")
    parser.add_argument("--out", help="also write the tables to this file")
    args = parser.parse_args()
    gpu = args.device != "cpu"
    if not gpu:
        torch.set_num_threads(args.threads)
    batches = args.batches or ([1, 8, 32, 64] if gpu else [1, 8])
    output_len = args.output_len or (128 if gpu else 24)
    vocab = args.tokenizer_vocab or (151643 if gpu else 4096)
    preset = args.preset or ("30b-a3b" if gpu else "tiny")
    dummy = args.dummy_weights if args.dummy_weights is not None else gpu or preset not in WEIGHTED_PRESETS
    overrides = {} if args.qwen_layers is None else {"num_hidden_layers": args.qwen_layers}
    if preset in WEIGHTED_PRESETS:  # a small model's logits as wide as the tokenizer (a released one has its own)
        overrides["vocab_size"] = max(vocab, 512)
    folder = tempfile.mkdtemp()
    write_checkpoint(folder, "qwen3_moe", preset, seed=0, config_only=dummy, overrides=overrides)
    tokenizer = (trained_tokenizer if args.tokenizer == "trained" else synthetic_tokenizer)(vocab)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    settings = dict(model=folder, device=args.device, show_progress=False, max_running_requests=max(batches),
                    max_total_tokens=max(batches) * (output_len + 64) + 1024, grammar_backend=args.grammar_backend)
    settings.update(dict(dtype="bf16", moe_kernel="triton") if gpu else dict(dtype="fp32"))
    if dummy:
        settings["load_format"] = "dummy"
    engine = Engine(EngineConfig(**settings))
    rng = random.Random(0)
    plain = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True,
                                 constraint=long_schema(output_len))
    decode_rate(engine, [[256, 7, 8]], constrained, args.device)  # warm-up: the backend and the schema compile
    weights = f"{preset}{', dummy weights' if dummy else ''}, {settings['dtype']}"
    lines = [f"{engine.model.hf_config.get('model_type')} ({weights}, {engine.model.hf_config['num_hidden_layers']} "
             f"layers), "
             f"{args.grammar_backend}, {args.tokenizer} tokenizer of {tokenizer.get_vocab_size()} ids, logits of "
             f"{engine.vocab_size}, {output_len} tokens per request, {args.runs} runs", "",
             "| batch | unconstrained tok/s (median) | min-max | json_schema tok/s (median) | min-max | overhead | "
             "step-loop CPU overhead | mask waits |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def run(prompts, params) -> tuple[float, float]:
        """(decode tok/s, the step loop thread's CPU seconds per generated token): the CPU time counts only this
        thread's own work, so other processes on a shared machine barely move it (the wall time they move a lot);
        work in the grammar's worker thread is not in it (it runs beside the step loop)."""
        cpu = time.thread_time()
        rate, requests = decode_rate(engine, prompts, params, args.device)
        return rate, (time.thread_time() - cpu) / sum(len(r.output_ids) for r in requests)

    for batch in batches:
        rates, cpus, waits = {"plain": [], "json": []}, [], engine.grammar.mask_waits
        for _ in range(args.runs):  # alternate, so drift in the machine hits both alike
            prompts = [[256] + [rng.randrange(3, 250) for _ in range(16)] for _ in range(batch)]
            (p, p_cpu), (j, j_cpu) = run(prompts, plain), run(prompts, constrained)
            rates["plain"].append(p)
            rates["json"].append(j)
            cpus.append(j_cpu / p_cpu - 1)
        waits = engine.grammar.mask_waits - waits
        p, j = statistics.median(rates["plain"]), statistics.median(rates["json"])
        lines.append(f"| {batch} | {p:.1f} | {min(rates['plain']):.1f}-{max(rates['plain']):.1f} | {j:.1f} | "
                     f"{min(rates['json']):.1f}-{max(rates['json']):.1f} | {100 * (1 - j / p):+.1f}% | "
                     f"{100 * statistics.median(cpus):+.1f}% | {waits} |")
    backend = make_backend(lookup("grammar_backend", args.grammar_backend), tokenizer, engine.vocab_size, {257})
    compiler = GrammarCompiler(backend)
    cold, cached = [], []
    for constraint in compile_schemas(args.schemas):
        for into in (cold, cached):
            start = time.perf_counter()
            compiler.compile(constraint)
            into.append(1000 * (time.perf_counter() - start))
    lines += ["", f"compile of {args.schemas} distinct schemas ({args.grammar_backend}, tokenizer of "
                  f"{tokenizer.get_vocab_size()} ids)", "", "| | p50 ms | p99 ms | max ms |", "|---|---:|---:|---:|"]
    for name, values in (("cold", cold), ("cached", cached)):
        lines.append(f"| {name} | {percentile(values, 0.5):.3f} | {percentile(values, 0.99):.3f} | {max(values):.3f} |")
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
