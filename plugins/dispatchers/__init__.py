"""Built-in dispatchers, registered through moeplex's entry points like any third-party plugin."""
