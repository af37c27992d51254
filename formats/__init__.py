"""File formats that both sides read: the host (ingest, tokenizer derivation) and the workers.

This package imports nothing from `host`, `workers` or any other project package, so either
side may import it without breaking the dependency direction.
"""
