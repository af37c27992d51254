"""The Core ML lane's owned artifact: manifest.json (with its digest), f32 weights and the
tokenizer, built from a Hugging Face directory or a GGUF file.

It lives here, not in the Core ML worker package, because both sides read it: the host builds
an artifact on a model's first Core ML load (ingest/owned.py, in a thread off the event loop)
and the worker loads it. It needs only numpy, safetensors, msgspec and gguf's constants.
"""
