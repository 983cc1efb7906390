"""Built-in grammar backends (`moeplex.grammar_backends`): xgrammar (default) and llguidance."""
