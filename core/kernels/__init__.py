"""Small Triton kernels that more than one plugin uses (they run under TRITON_INTERPRET=1 on the CPU)."""
