"""Built-in drafters for speculative decoding, registered through moeplex's entry points like any third-party plugin."""
