"""DeepEP dispatchers: `deepep-normal` (prefill), `deepep-ll` (decode, CUDA-graph safe), `deepep-auto` (both).

DeepEP (deepseek-ai/DeepEP, the v1 `Buffer` API) is a dependency the user installs; these
modules import it only when a dispatcher is made, so the start-up check can name it.
"""
