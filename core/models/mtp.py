"""DeepSeek-V3's multi-token-prediction (MTP, "NextN") layers, as one-layer draft models.

What a checkpoint holds. config.json's `num_nextn_predict_layers` (D) counts them; MTP layer i is stored
as `model.layers.{num_hidden_layers + i}.*`:
  enorm.weight, hnorm.weight           RMSNorms (rms_norm_eps) of the token embedding and of the hidden state
  eh_proj.weight [H, 2H]               Linear without bias on cat(enorm(embed(token)), hnorm(hidden)), in that
                                       order (SGLang's deepseek_nextn.py and vLLM's deepseek_mtp.py agree)
  input_layernorm, self_attn.*, post_attention_layernorm, mlp.*
                                       a whole decoder layer: MLA attention and an MoE MLP (router, routed and
                                       shared experts), the same kind as the main model's MoE layers
  shared_head.norm.weight              RMSNorm before the head
  shared_head.head.weight, embed_tokens.weight
                                       optional copies of the main model's lm_head and embed_tokens (DeepSeek's
                                       release stores them); never read: the layer uses the main model's own
In fp8 checkpoints the attention and expert projections are fp8 with block scales like the main layers';
eh_proj stays bf16 in DeepSeek's release (an fp8 eh_proj with scales also loads, dequantized).

Built only on request: `load_model(..., mtp=True)` (models/setup.py) builds and loads all D layers as
`model.mtp_layers` (an nn.ModuleList of MTPLayer; empty otherwise, and a checkpoint's MTP tensors are then
ignored). `mtp=True` is refused in one sentence when config.json declares no MTP layer or the checkpoint
holds none (`require_mtp_weights`). Their MoE layers take the Placement's last layer rows (moe_index after
the main model's MoE layers), so EP, expert balancing and --load-format dummy treat them like any MoE layer.

KV. MTP layer i caches like a main MLA layer, one [kv_lora_rank + qk_rope_head_dim] row per token, in its own
KV pool layer `layer.layer_id` = num_hidden_layers + i, in the same pages and slots as the target's KV of
the same positions. The model's `kv_shapes()` lists the main layers only; `model.mtp_kv_shapes()` lists the
MTP layers' (one entry each, [[(kv_lora_rank + qk_rope_head_dim,)]]; [] when none is built). Build the pool
from `model.kv_shapes() + model.mtp_kv_shapes()` (the `nextn` drafter's `kv_layers(model)` returns
`model.mtp_kv_shapes()`), so pool layer num_hidden_layers + i is MTP layer i's.

API (what the `nextn` drafter calls):

    hidden0 = layer.from_target(target_hidden)       # first step: the target's final norm of its hidden
    new_hidden, logits = layer(hidden, batch, kv, input_ids=None, logits_at=None, strategy=None)

  hidden     [T, H] in the model dtype: row t represents the token at position batch.positions[t] at the
             depth before. First step: the target's hidden states AFTER its final norm (what lm_head reads;
             Megatron-LM's MTP training, SGLang and vLLM all feed these): `layer.from_target(h)` of the
             pre-final-norm h the engine keeps (TargetStep.hidden), or `target_hidden_and_logits`'s first
             result. Later chained steps: the `new_hidden` of the step before, as it is.
  batch      a ForwardBatch of T tokens, EXTEND or DECODE, whose positions, out_cache_loc, kv_indices and
             seq_lens are those of the target's tokens at the same positions (build it with
             build_forward_batch from ScheduledSeq(next_ids, start, pages)): the layer writes the KV row of
             position p into slot out_cache_loc[t] of ITS OWN pool layer and attends over kv_indices of it.
  input_ids  [T] int64: row t is the token at position batch.positions[t] + 1 (in a prompt, the next prompt
             token; at the end, the token sampled or accepted after it); default batch.input_ids. The MTP
             batch is the target's with the ids shifted left by one and the next token appended.
  kv         the KVPool built as above.
  logits_at  [R] int64 rows of T whose logits to compute; default each request's last new token
             (batch.last_token_index, R = batch size).
  strategy   an overlap strategy (default None: the layer's operations in order, as `none` runs them).
  returns    new_hidden [T, H] = shared_head.norm(decoder layer output), model dtype: the `hidden` of the
             next chained step (this layer again, or MTP layer i + 1), at the same rows; logits [R, vocab]
             fp32 = lm_head(new_hidden[logits_at]): the distribution of the token at position p + 2.

A chain, for a decoding request whose last token x (not yet through the target) sits at position p, the
target's pre-norm hidden h of position p - 1 known from its last forward and the MTP KV filled up to
position p - 2: step 1 runs position p - 1 with (from_target(h), x) and proposes d1, the token of position
p + 1; step j > 1 runs position p + j - 2 with (new_hidden of step j - 1, d_{j-1}) and proposes d_j. After
the target verifies, the MTP rows of the positions it kept must be written again from the target's own
hidden states (one extend over them, as in a prompt): rows written from a draft's hidden differ.

The main model's embed_tokens, final norm and lm_head are used by reference (not parameters of the layer).
Under attention TP and EP the layer runs like a main layer (eh_proj is replicated on every rank; tested
over tp2 ep2 ranks); its MoE layer's collectives mean every rank of a step must run it, as for any layer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..executor import StepState, run_layers, run_program
from ..forward_batch import ForwardBatch
from ..kv_cache import KVPool
from ..targets import CheckpointError
from .base import DecoderLayer, RMSNorm

# checkpoint names under an MTP layer's prefix that copy the main model's weights (read from the main model)
SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


class MTPLayer(DecoderLayer):
    """One MTP depth: eh_proj(cat(enorm(embed(next token)), hnorm(hidden))) -> decoder layer -> shared_head."""

    def __init__(
        self,
        layer_id: int,
        self_attn: nn.Module,
        mlp: nn.Module,
        hidden_size: int,
        eps: float,
        embed_tokens: nn.Embedding,
        lm_head: nn.Linear,
        final_norm: RMSNorm,
    ):
        super().__init__(layer_id, self_attn, mlp, hidden_size, eps)
        self.enorm = RMSNorm(hidden_size, eps)
        self.hnorm = RMSNorm(hidden_size, eps)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(hidden_size, eps)
        # the main model's modules: in a tuple, so they are not registered as this layer's parameters
        self.shared = (embed_tokens, lm_head)
        self.target_norm = (final_norm,)

    def from_target(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's hidden states before its final norm [T, H] (what the engine hands drafters) as the
        `hidden` of a first MTP step: the target's final norm of them."""
        return self.target_norm[0](hidden)

    def combine(self, hidden: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """The decoder layer's input [T, H]: the next tokens' embeddings joined with the depth-before hidden."""
        embed, _ = self.shared
        return self.eh_proj(torch.cat((self.enorm(embed(input_ids)), self.hnorm(hidden)), dim=-1))

    def forward(
        self,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        kv: KVPool,
        input_ids: torch.Tensor | None = None,
        logits_at: torch.Tensor | None = None,
        strategy: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(new_hidden [T, H], logits [R, vocab] fp32); see the module docstring."""
        x = self.combine(hidden, batch.input_ids if input_ids is None else input_ids)
        if strategy is None:
            state = StepState(x, batch, kv)
            for _ in self.program(state):
                pass
            out = state.settle()
        else:
            out = run_program(self.program, x, batch, kv, strategy)
        new_hidden = self.shared_head.norm(out)
        rows = batch.last_token_index if logits_at is None else logits_at
        _, lm_head = self.shared
        return new_hidden, lm_head(new_hidden[rows]).float()


def target_hidden_and_logits(
    model, batch: ForwardBatch, kv: KVPool, strategy, logits_at: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's forward keeping what the first MTP step reads: (final-norm hidden [T, H], fp32 logits
    [R, vocab] of `logits_at`, default each request's last token), the logits equal to `model(...)`'s."""
    hidden = model.model.norm(run_layers(model, batch, kv, strategy))
    rows = batch.last_token_index if logits_at is None else logits_at
    return hidden, model.lm_head(hidden[rows]).float()


def mtp_layer_count(config: dict) -> int:
    """num_nextn_predict_layers of a config.json (0 when absent or null)."""
    return int(config.get("num_nextn_predict_layers") or 0)


def require_mtp_weights(folder: str, names: set[str], config: dict) -> None:
    """Refuse, in one sentence, a checkpoint that has none of the MTP layers its model is asked to load."""
    first = f"model.layers.{config['num_hidden_layers']}."
    if not any(name.startswith(first) and not name.endswith(SHARED_COPIES) for name in names):
        raise CheckpointError(
            f"checkpoint {folder} holds no MTP (NextN) layer weights ({first}*) although config.json declares "
            f"num_nextn_predict_layers={mtp_layer_count(config)}; write one with `moeplex make-model --arch "
            "deepseek_v3 --mtp 1` or choose a drafter that needs no weights"
        )


def checkpoint_name(name: str, num_hidden_layers: int) -> str:
    """A parameter name of the model -> its checkpoint name: mtp_layers.{i}.X -> model.layers.{N + i}.X."""
    if not name.startswith("mtp_layers."):
        return name
    index, _, rest = name[len("mtp_layers.") :].partition(".")
    return f"model.layers.{num_hidden_layers + int(index)}.{rest}"

