"""Runnable recipes: `python -m recipes.<name> --help`."""
