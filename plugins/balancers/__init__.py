"""Built-in balancers, registered through moeplex's entry points like any third-party plugin."""
