"""The public plugin API: every contract a dispatcher, MoE kernel, balancer, overlap strategy, KV transfer
backend, drafter or grammar backend implements.

A plugin imports moeplex only through the modules in PUBLIC_MODULES: this one (contracts,
capabilities, layouts, ForwardBatch, PluginError) and `moeplex.interfaces.kernels` (fp8
quantization, row permutation, layout planning; it imports Triton, so it is not imported here).
Everything else in moeplex may change under a plugin. tests/test_plugin_imports.py holds
every plugin shipped with moeplex to this.
"""

from ..forward_batch import ForwardBatch, ForwardMode
from . import deprecation
from .balancer import Balancer, BalancerCaps, Placement
from .context import MoEContext
from .dispatcher import Dispatcher, DispatcherCaps
from .drafter import (DeviceDrafts, DeviceTokens, DraftRequest, Drafter, DrafterCaps, DrafterContext, Drafts,
                      StaticProposer, TargetStep)
from .errors import PluginError
from .grammar import (
    CONSTRAINT_KINDS,
    EBNF,
    JSON_OBJECT,
    JSON_SCHEMA,
    REGEX,
    Constraint,
    GrammarBackend,
    GrammarBackendCaps,
    GrammarError,
    GrammarMatcher,
    GrammarVocab,
)
from .kv_transfer import KVRegion, KVTransfer, KVTransferCaps, TransferStatus, kv_regions, page_runs
from .layouts import (
    ALL_LAYOUTS,
    CONTIGUOUS,
    MASKED,
    STANDARD,
    ContiguousLayout,
    Dispatched,
    ExpertOutput,
    Fp8Payload,
    Layout,
    MaskedLayout,
    StandardLayout,
    placeholder,
    reduce_standard,
)
from .moe_kernel import BF16, FP8_BLOCK, WEIGHT_FORMATS, ExpertWeights, KernelCaps, MoEKernel
from .overlap import BatchMeta, OverlapCaps, OverlapStrategy

# The version of this contract, an integer: 1 is the API moeplex 0.1.0 shipped. Every release whose API differs
# in a way a plugin can notice (an addition, a deprecation, a removal, a changed meaning) ships the next
# integer; main carries it from the first such change on (CHANGELOG.md, "Unreleased" -> "API"). A plugin that
# needs something added in API n checks `API_VERSION >= n`.
API_VERSION = 2

PUBLIC_MODULES = ("moeplex.interfaces", "moeplex.interfaces.kernels")  # all a plugin may import of moeplex

__all__ = [name for name in dir() if not name.startswith("_")]
