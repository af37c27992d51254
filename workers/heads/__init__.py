"""Heads the worker runs on the engine's per-token final states (or on the token ids alone):
numpy only, since a worker has no torch. Each head's weights are files ingest wrote beside
the model (`formats`' readers), so the worker loads them without the checkpoint."""
