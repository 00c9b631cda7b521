"""The documentation site, held to the code (flags, metrics, diagrams, code samples, rendering)."""
