"""Built-in KV transfer backends, registered through moeplex's entry points like any third-party plugin."""
