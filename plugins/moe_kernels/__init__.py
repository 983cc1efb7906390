"""Built-in moe_kernels, registered through moeplex's entry points like any third-party plugin."""
