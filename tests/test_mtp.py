"""DeepSeek-V3's MTP (NextN) layers: what make-model writes, what loads, and the layer's logits.

The reference is built outside moeplex: transformers' DeepseekV3DecoderLayer holding the MTP layer's
weights (transformers loads the checkpoint with one more layer, so its layer N is the MTP decoder), its
RMSNorm, embedding and LM head, and the published formula
    new_hidden = shared_head.norm(decoder(eh_proj(cat(enorm(embed(next token)), hnorm(hidden)))))
    logits = lm_head(new_hidden)
with `hidden` the target's final-norm hidden states (transformers' last_hidden_state).
"""

from __future__ import annotations

import json
import os
import shutil
import socket

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import mtp_ranks
from model_helpers import assert_matches, no_overlap, scattered_pages, token_sequence
from moeplex.batch_builder import ScheduledSeq, build_forward_batch
from moeplex.cli import main
from moeplex.config import EngineConfig
from moeplex.executor import run_layers
from moeplex.kv_cache import KVPool
from moeplex.models.loader import SCALE_SUFFIX
from moeplex.models.mtp import target_hidden_and_logits
from moeplex.models.setup import load_model
from moeplex.parallel import ParallelConfig, ParallelState
from moeplex.ranks.launcher import launch
from moeplex.quant import FP8, dequantize_blocks
from moeplex.selection import resolve
from moeplex.targets import CheckpointError

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf  # noqa: E402

N = 3  # the tiny preset's num_hidden_layers: the MTP layer is model.layers.3
MTP = f"model.layers.{N}."
PAGE_SIZE = 4


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def make(folder: str, *args: str) -> str:
    assert main(["make-model", folder, "--arch", "deepseek_v3", "--seed", "4", *args]) == 0
    return folder


def load(folder: str, mtp: bool = True, **settings):
    config = EngineConfig(model=folder, dtype="fp32", show_progress=False, **settings)
    return load_model(folder, config, resolve(config), mtp=mtp)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make(str(tmp_path_factory.mktemp("mtp") / "ckpt"), "--mtp", "1")


@pytest.fixture(scope="module")
def ours(folder):
    return load(folder)


class Reference:
    """transformers' pieces holding the checkpoint's weights, and the MTP formula around them."""

    def __init__(self, folder: str):
        load_kwargs = {"dtype": torch.float32}
        self.main = transformers.AutoModelForCausalLM.from_pretrained(folder, **load_kwargs).eval()
        stack = transformers.AutoModelForCausalLM.from_pretrained(folder, num_hidden_layers=N + 1, **load_kwargs).eval()
        self.decoder, self.rotary = stack.model.layers[N], stack.model.rotary_emb
        config = self.main.config
        with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
            self.eh_proj = f.get_tensor(MTP + "eh_proj.weight")
            self.norms = {}
            for name in ("enorm", "hnorm", "shared_head.norm"):
                norm = hf.DeepseekV3RMSNorm(config.hidden_size, config.rms_norm_eps)
                norm.weight.data.copy_(f.get_tensor(f"{MTP}{name}.weight"))
                self.norms[name] = norm

    @torch.no_grad()
    def target_hidden(self, tokens: list[int]) -> torch.Tensor:
        return self.main.model(torch.tensor([tokens])).last_hidden_state[0]

    @torch.no_grad()
    def mtp(self, hidden: torch.Tensor, next_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(new_hidden, logits) of rows at positions 0..m-1, each attending to the rows before it."""
        m = len(next_ids)
        embedded = self.main.model.embed_tokens(torch.tensor(next_ids))
        x = torch.nn.functional.linear(torch.cat((self.norms["enorm"](embedded), self.norms["hnorm"](hidden)), -1), self.eh_proj)
        positions = torch.arange(m)[None]
        mask = torch.full((m, m), float("-inf")).triu(1)[None, None]
        out = self.decoder(x[None], attention_mask=mask, position_ids=positions, position_embeddings=self.rotary(x[None], positions))
        new_hidden = self.norms["shared_head.norm"](out[0] if isinstance(out, tuple) else out)[0]
        return new_hidden, self.main.lm_head(new_hidden).float()


@pytest.fixture(scope="module")
def reference(folder):
    return Reference(folder)


def pool(model, pages: int = 64) -> KVPool:
    return KVPool(pages, PAGE_SIZE, model.kv_shapes() + model.mtp_kv_shapes(), torch.float32, "cpu")


def target_step(model, kv, seqs):
    batch = build_forward_batch(seqs, kv, "cpu")
    with torch.no_grad():
        return target_hidden_and_logits(model, batch, kv, no_overlap(), torch.arange(batch.num_tokens))


def mtp_step(model, kv, seqs, hidden, layer: int = 0):
    """The MTP layer over `seqs` (their tokens: the NEXT ids, their starts: the positions), every row's logits."""
    batch = build_forward_batch(seqs, kv, "cpu")
    with torch.no_grad():
        return model.mtp_layers[layer](hidden, batch, kv, logits_at=torch.arange(batch.num_tokens))


def test_make_model_writes_the_mtp_layer(folder):
    with open(os.path.join(folder, "config.json")) as f:
        assert json.load(f)["num_nextn_predict_layers"] == 1
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        names = set(f.keys())
    expected = {"eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight", "input_layernorm.weight",
                "self_attn.kv_b_proj.weight", "mlp.gate.weight", "mlp.experts.15.down_proj.weight",
                "mlp.shared_experts.up_proj.weight"}
    assert {MTP + name for name in expected} <= names
    assert not any(name.startswith(f"model.layers.{N + 1}.") for name in names)


def test_layer_and_its_kv(ours):
    """One MTP layer, an MoE layer after the main ones, its KV one more MLA layer at index num_hidden_layers."""
    [layer] = ours.mtp_layers
    assert layer.layer_id == N == len(ours.kv_shapes())
    assert ours.mtp_kv_shapes() == [[(32 + 8,)]] and ours.kv_shapes() == [[(32 + 8,)]] * N
    assert layer.mlp.moe_index == len(ours.moe_layers()) - 1 == 2
    assert layer.eh_proj.weight.shape == (64, 128)
    assert layer.self_attn.backend is ours.attention_backend, "the MTP layer attends through the model's backend"
    assert not any(name.startswith("mtp_layers") for name in ours.weight_targets())


def test_target_hidden_and_logits_equal_the_forward(ours, reference):
    tokens = token_sequence(9, seed=1)
    kv = pool(ours)
    hidden, logits = target_step(ours, kv, [ScheduledSeq(tokens, 0, kv.allocate(3))])
    assert_matches(hidden, reference.target_hidden(tokens), "final-norm hidden")
    batch = build_forward_batch([ScheduledSeq(tokens, 0, kv.allocate(3))], kv, "cpu")
    with torch.no_grad():  # the engine keeps pre-norm hidden states; from_target gives the layer's input
        prenorm = run_layers(ours, batch, kv, no_overlap())
        assert torch.equal(ours.mtp_layers[0].from_target(prenorm), hidden)
    assert_matches(logits, reference.main(torch.tensor([tokens])).logits[0].detach(), "target logits")


def test_extend_of_a_batch_matches_the_reference(ours, reference):
    """Two sequences in one MTP extend over scattered pages: row p gets hidden p and token p + 1."""
    sequences = [token_sequence(n, seed=10 + n) for n in (7, 13)]
    kv = pool(ours)
    pages = [scattered_pages(kv, kv.pages_for(len(s))) for s in sequences]
    hidden, _ = target_step(ours, kv, [ScheduledSeq(s, 0, p) for s, p in zip(sequences, pages)])
    rows = torch.tensor([len(s) for s in sequences]).cumsum(0)
    inputs = torch.cat([hidden[end - len(s) : end - 1] for s, end in zip(sequences, rows.tolist())])
    new_hidden, logits = mtp_step(ours, kv, [ScheduledSeq(s[1:], 0, p) for s, p in zip(sequences, pages)], inputs)
    expected = [reference.mtp(reference.target_hidden(s)[:-1], s[1:]) for s in sequences]
    assert_matches(new_hidden, torch.cat([h for h, _ in expected]), "MTP new hidden")
    assert_matches(logits, torch.cat([lg for _, lg in expected]), "MTP logits")


def test_chunks_decode_and_a_chained_step_read_its_own_kv(ours, reference):
    """MTP extend in chunks, then decode steps at the next positions, then a step fed its own new hidden."""
    tokens = token_sequence(12, seed=3)
    n = len(tokens)
    kv = pool(ours)
    pages = scattered_pages(kv, kv.pages_for(n + 1))
    target_hidden, target_logits = target_step(ours, kv, [ScheduledSeq(tokens, 0, pages)])
    main_kv = [buffer.clone() for (buffer,) in kv.buffers[:N]]
    ref_hidden = reference.target_hidden(tokens)
    ref_new, ref_logits = reference.mtp(ref_hidden[:-1], tokens[1:])
    for start, end in ((0, 5), (5, 9)):  # extends of positions 0..8
        _, logits = mtp_step(ours, kv, [ScheduledSeq(tokens[start + 1 : end + 1], start, pages)], target_hidden[start:end])
        assert_matches(logits, ref_logits[start:end], f"MTP chunk {start}..{end}")
    for position in (9, 10):  # decode: one row each
        seq = ScheduledSeq([tokens[position + 1]], position, pages)
        assert build_forward_batch([seq], kv, "cpu").mode.name == "DECODE"
        _, logits = mtp_step(ours, kv, [seq], target_hidden[position : position + 1])
        assert_matches(logits, ref_logits[position : position + 1], f"MTP decode at {position}")
    # position 11: the target's last token with its sampled next one; then position 12 chained on its output
    first = int(target_logits[-1].argmax())
    new1, logits1 = mtp_step(ours, kv, [ScheduledSeq([first], n - 1, pages)], target_hidden[-1:])
    ref_new1, ref_logits1 = reference.mtp(ref_hidden, tokens[1:] + [first])
    assert_matches(logits1, ref_logits1[-1:], "MTP step 1")
    second = int(logits1[0].argmax())
    _, logits2 = mtp_step(ours, kv, [ScheduledSeq([second], n, pages)], new1)
    _, ref_logits2 = reference.mtp(torch.cat((ref_hidden, ref_new1[-1:])), tokens[1:] + [first, second])
    assert_matches(logits2, ref_logits2[-1:], "MTP chained step 2")
    assert all(torch.equal(before, buffer) for before, (buffer,) in zip(main_kv, kv.buffers[:N])), "MTP wrote main KV"


def test_dummy_weights_are_the_checkpoint_weights(folder, ours):
    dummy = load(folder, load_format="dummy", seed=4)
    tokens = token_sequence(6, seed=5)
    results = []
    for model in (ours, dummy):
        kv = pool(model)
        pages = kv.allocate(2)
        hidden, _ = target_step(model, kv, [ScheduledSeq(tokens, 0, pages)])
        results.append(mtp_step(model, kv, [ScheduledSeq(tokens[1:], 0, pages)], hidden[:-1])[1])
    assert torch.equal(*results)


def test_a_checkpoint_with_mtp_loads_without_it(folder, ours, reference):
    plain = load(folder, mtp=False)
    assert len(plain.mtp_layers) == 0 and plain.mtp_kv_shapes() == [] and len(plain.kv_shapes()) == N
    tokens = token_sequence(8, seed=6)
    kv = pool(plain)
    _, logits = target_step(plain, kv, [ScheduledSeq(tokens, 0, kv.allocate(2))])
    assert_matches(logits, reference.main(torch.tensor([tokens])).logits[0].detach(), "main model without MTP")


def test_a_checkpoint_without_mtp_loads_and_refuses_mtp(tmp_path):
    folder = make(str(tmp_path / "plain"))
    with open(os.path.join(folder, "config.json")) as f:
        assert json.load(f)["num_nextn_predict_layers"] == 0
    assert len(load(folder, mtp=False).mtp_layers) == 0
    with pytest.raises(ValueError, match="declares no multi-token-prediction"):
        load(folder)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**config, "num_nextn_predict_layers": 1}, f)  # declared, but no weights
    with pytest.raises(CheckpointError, match=r"holds no MTP \(NextN\) layer weights \(model\.layers\.3\.\*\)"):
        load(folder)


def _rewritten(folder: str, target: str, edit) -> str:
    shutil.copytree(folder, target)
    path = os.path.join(target, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)
    return target


BROKEN = {
    "missing": (MTP + "hnorm.weight", lambda t, n: t.pop(n)),
    "mis-shaped": (MTP + "eh_proj.weight", lambda t, n: t.update({n: torch.zeros(64, 64)})),
    "missing expert": (MTP + "mlp.experts.7.gate_proj.weight", lambda t, n: t.pop(n)),
    "non-finite": (MTP + "shared_head.norm.weight", lambda t, n: t.update({n: torch.full((64,), float("nan"))})),
}


@pytest.mark.parametrize("fault", list(BROKEN))
def test_a_broken_mtp_tensor_is_named(folder, tmp_path, fault):
    name, edit = BROKEN[fault]
    broken = _rewritten(folder, str(tmp_path / "broken"), lambda t: edit(t, name))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load(broken)


def test_stored_copies_of_embedding_and_head_are_accepted(folder, ours, tmp_path):
    """DeepSeek's release stores embed_tokens and shared_head.head inside the MTP layer; the main model's are used."""

    def add_copies(tensors):
        tensors[MTP + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[MTP + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()

    model = load(_rewritten(folder, str(tmp_path / "copies"), add_copies))
    assert torch.equal(model.mtp_layers[0].eh_proj.weight, ours.mtp_layers[0].eh_proj.weight)


def test_fp8_checkpoint_with_mtp_equals_its_dequantized_twin(tmp_path):
    fp8 = make(str(tmp_path / "fp8"), "--mtp", "1", "--fp8")
    tensors = load_file(os.path.join(fp8, "model.safetensors"))
    assert tensors[MTP + "self_attn.kv_b_proj.weight"].dtype == FP8
    assert tensors[MTP + "mlp.experts.0.down_proj.weight"].dtype == FP8
    assert tensors[MTP + "eh_proj.weight"].dtype == torch.float32, "eh_proj stays unquantized, as DeepSeek stores it"
    assert MTP + "eh_proj.weight" + SCALE_SUFFIX not in tensors
    twin = str(tmp_path / "twin")
    os.makedirs(twin)
    plain = {
        name: t if name + SCALE_SUFFIX not in tensors else dequantize_blocks(t, tensors[name + SCALE_SUFFIX])
        for name, t in tensors.items()
        if not name.endswith(SCALE_SUFFIX)
    }
    save_file(plain, os.path.join(twin, "model.safetensors"))
    with open(os.path.join(fp8, "config.json")) as f:
        config = json.load(f)
    del config["quantization_config"]
    with open(os.path.join(twin, "config.json"), "w") as f:
        json.dump(config, f)
    tokens = token_sequence(8, seed=7)
    results = []
    for model in (load(fp8), load(twin)):
        kv = pool(model)
        pages = kv.allocate(2)
        hidden, _ = target_step(model, kv, [ScheduledSeq(tokens, 0, pages)])
        results.append(mtp_step(model, kv, [ScheduledSeq(tokens[1:], 0, pages)], hidden[:-1])[1])
    assert_matches(results[0], results[1], "fp8 MTP vs its dequantized twin")


def test_make_model_refuses_mtp_for_other_architectures(tmp_path, capsys):
    assert main(["make-model", str(tmp_path / "q"), "--arch", "qwen3_moe", "--mtp", "1"]) != 0
    assert "multi-token-prediction layers exist for deepseek_v3 only" in capsys.readouterr().err


@pytest.mark.slow
def test_tp2_ep2_ranks_give_the_same_mtp_logits(folder):
    """Attention heads split over 2 gloo ranks, experts sharded over them (naive dispatcher): same MTP logits."""
    sequences = [token_sequence(n, seed=20 + n) for n in (6, 11)]
    alone = mtp_ranks.mtp_logits(0, ParallelConfig(), folder, sequences)
    parallel = ParallelConfig(tp_size=2, ep_size=2, dist_init_addr=free_address(), timeout_s=120)
    assert_matches(launch(mtp_ranks.mtp_logits, parallel, parallel, folder, sequences), alone, "MTP over tp2 ep2")


def test_two_mtp_layers_each_with_its_own_kv_layer(tmp_path):
    model = load(make(str(tmp_path / "two"), "--mtp", "2"))
    assert [layer.layer_id for layer in model.mtp_layers] == [N, N + 1]
    assert [layer.mlp.moe_index for layer in model.mtp_layers] == [2, 3] and len(model.mtp_kv_shapes()) == 2
    tokens = token_sequence(7, seed=8)
    kv = pool(model)
    pages = kv.allocate(2)
    hidden, _ = target_step(model, kv, [ScheduledSeq(tokens, 0, pages)])
    first, _ = mtp_step(model, kv, [ScheduledSeq(tokens[1:], 0, pages)], hidden[:-1], layer=0)
    untouched = kv.buffers[N + 1][0].clone()
    assert torch.equal(untouched, torch.zeros_like(untouched)), "layer 1's KV is written by layer 1 only"
    mtp_step(model, kv, [ScheduledSeq(tokens[2:], 0, pages)], first[:-1], layer=1)
    written = kv.buffers[N + 1][0][build_forward_batch([ScheduledSeq(tokens[2:], 0, pages)], kv, "cpu").out_cache_loc]
    assert written.abs().sum() > 0


def test_released_shapes_build_on_the_meta_device(tmp_path):
    """What the GPU benchmark runs (--config-only --mtp 1, --load-format dummy): DeepSeek-V3's MTP layer shapes."""
    from moeplex.models.setup import build_model

    folder = make(str(tmp_path / "v3"), "--preset", "v3", "--config-only", "--mtp", "1", "--set", "num_hidden_layers=4")
    config = EngineConfig(model=folder, device="meta", load_format="dummy", show_progress=False)
    model = build_model(folder, config, resolve(config), mtp=True)
    [layer] = model.mtp_layers
    assert layer.layer_id == 4 and layer.eh_proj.weight.shape == (7168, 2 * 7168)
    assert layer.mlp.w13.shape == (256, 2 * 2048, 7168) and model.mtp_kv_shapes() == [[(512 + 64,)]]
    assert sum(p.numel() for p in layer.parameters()) / 1e9 == pytest.approx(11.6, abs=0.1)


def drafts_from_scratch(reference: Reference, seq: list[int], k: int) -> list[int]:
    """k greedy chained drafts after `seq` (its last token not yet through the target), from whole sequences:
    rows 0..p-1 from the target's hidden states, then one row per draft from the row before's new hidden."""
    hidden, ids, drafts = reference.target_hidden(seq[:-1]), list(seq[1:]), []
    for _ in range(k):
        new, logits = reference.mtp(hidden, ids)
        drafts.append(int(logits[-1].argmax()))
        hidden, ids = torch.cat((hidden, new[-1:])), ids + drafts[-1:]
    return drafts


@pytest.mark.slow
def test_draft_rounds_as_documented_equal_drafting_from_scratch(ours, reference):
    """The protocol of models/mtp.py's docstring over two rounds: chain k drafts, verify, write the kept
    positions' MTP rows again from the target's hidden states; each round's drafts equal those computed from
    the whole sequence. The target verifies its own greedy continuation (all k accepted), so the rewrite
    covers k rows; without it the second round's drafts would read rows written from draft hidden states."""
    k, seq = 3, token_sequence(9, seed=9)
    kv = pool(ours)
    pages = kv.allocate(8)
    hidden, logits = target_step(ours, kv, [ScheduledSeq(seq, 0, pages)])
    mtp_step(ours, kv, [ScheduledSeq(seq[1:], 0, pages)], hidden[:-1])  # the prompt's MTP rows
    seq = seq + [int(logits[-1].argmax())]
    last_hidden = hidden[-1:]
    for round_ in range(2):
        p = len(seq) - 1  # the last token, not yet through the target
        drafts, h = [], last_hidden
        for j in range(k):
            h, step_logits = mtp_step(ours, kv, [ScheduledSeq([seq[-1], *drafts][-1:], p - 1 + j, pages)], h)
            drafts.append(int(step_logits[0].argmax()))
        assert drafts == drafts_from_scratch(reference, seq, k), f"round {round_}"
        with torch.no_grad():
            continuation = reference.main.generate(torch.tensor([seq]), max_new_tokens=k + 1, do_sample=False,
                                                   eos_token_id=None, pad_token_id=258)[0, len(seq):].tolist()
        verified_hidden, verify_logits = target_step(ours, kv, [ScheduledSeq([seq[-1], *continuation[:k]], p, pages)])
        assert verify_logits.argmax(-1).tolist() == continuation  # all k accepted, plus the bonus token
        mtp_step(ours, kv, [ScheduledSeq(continuation[:k], p, pages)], verified_hidden[:k])  # rows p .. p+k-1 again
        seq, last_hidden = seq + continuation, verified_hidden[k:]


def test_rebalancing_moves_the_mtp_layers_experts_too(folder):
    """The MTP MoE layer is the placement's last row: EPLB gives its hot experts replicas, the logits stay."""
    from moeplex.hooks import make_plugin_manager
    from moeplex.moe.rebalance import ExpertBalancing

    model = load(folder, balancer="eplb", ep_num_redundant_experts=4)
    assert [layer.moe_index for layer in model.moe_layers()] == [0, 1, 2]
    tokens = token_sequence(8, seed=11)

    def mtp_logits():
        kv = pool(model)
        pages = kv.allocate(2)
        hidden, _ = target_step(model, kv, [ScheduledSeq(tokens, 0, pages)])
        return mtp_step(model, kv, [ScheduledSeq(tokens[1:], 0, pages)], hidden[:-1])[1]

    before = mtp_logits()
    config = EngineConfig(model=folder, dtype="fp32", balancer="eplb", ep_num_redundant_experts=4)
    balancing = ExpertBalancing(model.moe_runtime, model.moe_layers(), resolve(config).balancer(), config,
                                ParallelState(ParallelConfig()), make_plugin_manager())
    load_ = torch.ones(3, 16)
    load_[2, 5] = 1000  # only the MTP layer's expert 5 is hot
    report = balancing.rebalance(load=load_)
    assert 2 in report.layers_changed and report.placement.logcnt[2, 5] > 1
    assert_matches(mtp_logits(), before, "MTP logits after rebalancing")
