"""Built-in overlap, registered through moeplex's entry points like any third-party plugin."""
