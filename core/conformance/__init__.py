"""Conformance suites: the contracts of DESIGN.md as tests that every plugin, built-in or third-party, passes.

Run them on an installed plugin with

    pytest --pyargs moeplex.conformance --moeplex-plugin moe_kernel:NAME

(`moeplex.conformance.plugin` is the pytest plugin behind `--moeplex-plugin`; see docs/plugins.md).
"""
