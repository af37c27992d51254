"""Heads that run in the worker on the engine's final token states (numpy only)."""
