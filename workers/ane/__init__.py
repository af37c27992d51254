"""Core ML (Apple Neural Engine) engine: owned graph builder, shape compiler, backends.

manifest       owned model format (ingest a HF BERT dir; digests; verification)
identity       KERNEL_REVISION, precision, target, coremltools version (no coremltools)
build_options  test-only graph degradations (no coremltools)
builder        the encoder as a MIL program in the ANE's form
shapes         compiled shapes and their wire ids
compiler       admission: package and compiled form, two kinds of compile-cache entry
program_ir     a saved program as plain objects; the reference backend's compiled form
executor       numpy executor of saved programs, fp16 emulated (the reference backend)
placement      static estimate of the ANE share of a program
compute_plan   the ANE share from Core ML's compute plan (pure walk; tested on Linux)
backends       reference (everywhere) / coreml (macOS: coreml_backend)
apple_device   macOS adapter: chip, macOS version/build, Neural Engine presence
import_guard   keeps coremltools from importing torch / sklearn in the worker
packing        placing sequences into admitted shapes; run feeds
config         LOAD's runtime_config (compute_units and its environment override)
engine         AneEngine, the worker's engine
"""
