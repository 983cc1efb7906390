"""One layer's GPU costs, and the same layer as the host launches it in an eager step (host.py walks the ops).

The order and counts follow the code of an extend step: the input norm and MLA's norms, rope and cache writes
(`small_before_attention` of the launch budget), the projections, then the attention kernel, whose extend path
(core/attention/torch_ref.py `ragged_attention`) reads `kv_indptr` on the host: a sync in every layer. After it
o_proj, the rest of the small kernels, the router, the MoE kernel, the shared experts. DeepEP normal mode syncs
twice more in each MoE layer: its wait for the received counts and the `nonzero` that starts `plan_contiguous`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .host import Op

EXPERT_LAUNCHES = 3  # align, gate/up GEMM, down GEMM (the triton kernel; DeepGEMM's grouped GEMMs are as many)


@dataclass(frozen=True)
class LayerCosts:
    """GPU µs of one layer's parts on one GPU (the busiest rank's share for dispatch, combine, grouping)."""

    projections: float  # attention GEMMs before the attention kernel
    core: float  # the attention kernel
    o_proj: float
    small_before: float
    small_after: float
    router: float = 0.0
    experts: float = 0.0
    idle: float = 0.0  # the busiest rank's extra expert time
    shared: float = 0.0
    group: float = 0.0  # contiguous layout: received rows grouped per expert
    summing: float = 0.0  # and summed back per token
    dispatch: float = 0.0
    combine: float = 0.0
    normal_mode: bool = False  # DeepEP normal (host syncs, contiguous layout)

    def attention(self) -> float:
        return self.projections + self.core + self.o_proj

    def compute(self) -> float:
        """Everything but the transfers."""
        return (self.attention() + self.small_before + self.small_after + self.router + self.experts + self.idle
                + self.shared + self.group + self.summing)

    def split(self) -> dict[str, float]:
        other = self.small_before + self.small_after + self.router + self.shared + self.group + self.summing
        return {"attention": self.attention(), "dense": 0.0, "dispatch": self.dispatch, "experts": self.experts,
                "combine": self.combine, "idle": self.idle, "other": other}

    def dense_layer(self, mlp: float) -> "LayerCosts":
        """The same attention block followed by a dense MLP in place of the MoE block."""
        return LayerCosts(self.projections, self.core, self.o_proj, self.small_before, self.small_after, shared=mlp)


def _attention_ops(layer: LayerCosts, counts: dict, gemm_launches: int, decode: bool) -> list[Op]:
    return [
        Op("input norms, rope, cache writes", counts["small_before_attention"], layer.small_before),
        Op("attention projections", gemm_launches, layer.projections),
        Op("attention kernel", 1, layer.core, sync_before=not decode),  # extend reads kv_indptr on the host
        Op("o_proj", 1, layer.o_proj),
    ]


def _after_attention_small(counts: dict) -> int:
    return counts["small_per_layer"] - counts["small_before_attention"] - 1  # the attention kernel counted above


def dense_layer_ops(layer: LayerCosts, counts: dict, decode: bool) -> list[Op]:
    return _attention_ops(layer, counts, 2, decode) + [
        Op("norms, activation", _after_attention_small(counts), layer.small_after),
        Op("dense MLP", 2, layer.shared),
    ]


def layer_ops(layer: LayerCosts, counts: dict, hw, decode: bool) -> list[Op]:
    """A MoE layer's launches in code order."""
    ops = _attention_ops(layer, counts, 2, decode) + [
        Op("norms, top-k, sums", _after_attention_small(counts), layer.small_after),
        Op("router", 1, layer.router),
    ]
    if layer.normal_mode:
        ops += normal_dispatch_ops(layer, hw.launches["deepep-normal"], hw.deepep_normal_fixed_us)
    else:
        ops += [Op("dispatch", 1 if layer.dispatch else 0, layer.dispatch), Op("experts", EXPERT_LAUNCHES, layer.experts + layer.idle),
                Op("combine", 1 if layer.combine else 0, layer.combine)]
    if layer.shared:
        ops.append(Op("shared experts", 2, layer.shared))
    return ops


def normal_dispatch_ops(layer: LayerCosts, launches: dict, layout_us: float) -> list[Op]:
    """DeepEP normal dispatch, grouping, experts, summing and combine, with its two host syncs.

    `layer.dispatch` carries the layout/notify kernels' fixed time (costs.deepep_normal_us); they run before
    the wait, the transfer after it.
    """
    transfer = max(layer.dispatch - layout_us, 0.0)
    return [
        Op("DeepEP layout and notify", launches["launches_before_wait"], min(layout_us, layer.dispatch)),
        Op("DeepEP dispatch (after the host waits for the counts)", 1, transfer, sync_before=True),
        Op("plan_contiguous (starts with a nonzero: a host sync)", launches["plan_launches"], 0.0, sync_before=True),
        Op("grouping rows per expert", launches["group_launches"], layer.group),
        Op("experts", EXPERT_LAUNCHES if layer.experts else 0, layer.experts + layer.idle),
        Op("weighted sum per token", launches["sum_launches"], layer.summing),
        Op("DeepEP combine", launches["combine_launches"], layer.combine),
    ]


def overlapped_layer_ops(half: LayerCosts, layer_gpu: float, host_us: float, counts: dict, hw) -> list[Op]:
    """A `tbo` layer in an eager step: the GPU streams overlap (layer_gpu), the host launches both micro-batches.

    Each micro-batch's syncs are covered by the other's queued work (why dispatch_finish holds DeepEP's wait),
    so the host's share is its launches alone; the layer takes the longer of the two, after the layer before.
    """
    launches = sum(op.launches for op in layer_ops(half, counts, hw, decode=False))
    return [Op("tbo layer (both micro-batches)", 0, max(layer_gpu, 2 * launches * host_us), sync_before=True)]
