"""`synapse serve`: OpenAI-compatible HTTP over the host `Module`.

Kept import-light: the CLI registers `serve` without importing starlette or uvicorn; they
load only when the server runs (`service.app`, `service.run`).
"""
