"""Core ML (Apple Neural Engine) engine: owned graph builder, shape compiler, backends.

    manifest     owned model format (ingest a HF BERT dir; digests; verification)
    builder      the encoder as a MIL program in the ANE's form (KERNEL_REVISION)
    shapes       compiled shapes and their wire ids
    compiler     shapes through the content-addressed compile cache
    executor     numpy executor of saved .mlpackages, fp16 emulated (the reference backend)
    placement    static estimate of the ANE share of a program
    backends     reference (everywhere) / coreml (macOS: coreml_backend)
    packing      placing sequences into admitted shapes; run feeds
    config       LOAD's runtime_config
    engine       AneEngine, the worker's engine
"""
