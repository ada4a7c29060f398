"""Runnable recipes: ``python -m forgelab.recipes.<name> --help``."""
