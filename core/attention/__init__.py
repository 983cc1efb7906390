"""Attention over the paged KV cache: the torch reference and the Triton kernels, chosen by `--attention-backend`."""

from .backend import ATTENTION_BACKENDS, AUTO, AttentionBackend, TorchAttention, make_attention_backend
from .torch_ref import gather_kv, write_kv

__all__ = [
    "ATTENTION_BACKENDS",
    "AUTO",
    "AttentionBackend",
    "TorchAttention",
    "gather_kv",
    "make_attention_backend",
    "write_kv",
]
