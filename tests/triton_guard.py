"""Shared by the tests of Triton kernels: the device they run on, and a module-level skip where they cannot run.

On a machine without CUDA the conftest sets TRITON_INTERPRET=1 before any kernel is decorated, so the
kernels run under Triton's interpreter; a session that imported them earlier cannot run them at all.
"""

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def skip_unless_runnable(kernel) -> None:
    """Skip the calling test module when `kernel` was compiled for a GPU that is not there."""
    if not torch.cuda.is_available() and not isinstance(kernel, InterpretedFunction):
        pytest.skip("the triton kernels were imported before TRITON_INTERPRET=1 was set and cannot run on this CPU",
                    allow_module_level=True)
