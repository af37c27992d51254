"""Models named by where they come from: `models pull ORG/NAME`, `models ingest ORG/NAME`
(the Hugging Face cache), `models ingest ollama:NAME` / `lmstudio:PUBLISHER/REPO`, and
`models ls --available`. The work is `ingest.hub`'s, `ingest.local_models`' and
`ingest.available`'s; this module parses, prints and lets typed errors through to
`cli.main`."""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from common.errors import InvalidRequest
from ingest.store import ArtifactStore, ModelRecord

console = Console()


def is_model_reference(text: str) -> bool:
    """`ORG/NAME[@REV]`, `ollama:...` or `lmstudio:...` (asked only of a path that does not
    exist: a directory named like a repository is still a directory)."""
    from ingest.hub import parse_ref
    from ingest.local_models import is_local_ref

    # A missing `dir/model.gguf` is a mistyped path, not a repository.
    return is_local_ref(text) or (parse_ref(text) is not None and not text.endswith(".gguf"))


def _options(args: argparse.Namespace) -> dict:
    return {
        "prompts": dict(args.prompt) if args.prompt else None,
        "default_prompt_name": args.default_prompt,
        "matryoshka_dims": args.matryoshka_dims,
    }


def pull_model(args: argparse.Namespace) -> ModelRecord:
    from ingest.hub import pull, require_ref

    ref = require_ref(args.repo)
    result = pull(ArtifactStore(), ref, name=args.name, dtype=args.dtype, **_options(args))
    _said(result.record, result.action)
    return result.record


def ingest_reference(args: argparse.Namespace) -> ModelRecord:
    from ingest.local_models import is_local_ref

    if is_local_ref(args.path):
        if args.dtype is not None:
            raise InvalidRequest("--dtype converts a Hugging Face directory; a GGUF keeps its own")
        from certification.tokenizer_proof import prove_gguf_tokenizer  # spawns llama.cpp
        from ingest.local_models import ingest_local

        rec, new = ingest_local(
            ArtifactStore(),
            args.path,
            args.name,
            prove_gguf_tokenizer,
            kind=args.kind,
            pooling=args.pooling,
            max_tokens=args.max_tokens,
            **_options(args),
        )
        _said(rec, "linked" if new else "present")
        return rec
    if args.kind or args.pooling or args.max_tokens:
        raise InvalidRequest(
            "--kind, --pooling and --max-tokens apply to GGUF files; a repository says its own"
        )
    from ingest.hub import ingest_cached, require_ref

    result = ingest_cached(
        ArtifactStore(), require_ref(args.path), args.name, args.dtype, **_options(args)
    )
    _said(result.record, result.action)
    return result.record


_ACTIONS = {
    "present": "already in the store, nothing to do",
    "cached": "built from the Hugging Face cache (nothing downloaded)",
    "downloaded": "downloaded and built",
    "linked": "ingested in place (no copy)",
}


def _said(rec: ModelRecord, action: str) -> None:
    man = rec.manifest
    origin = f" from {man.provenance.label()}" if man.provenance else ""
    line = f"{rec.name} ({man.kind}, {man.dims} dims){origin}: {_ACTIONS[action]}"
    console.print(escape(line), soft_wrap=True)


def print_available(as_json: bool) -> int:
    from ingest.available import available_models

    found = available_models()
    if as_json:
        print(json.dumps([vars(a) for a in found]))
        return 0
    table = Table("ingest as", "kind", "what", "size")
    table.columns[0].no_wrap = True
    for a in found:
        table.add_row(escape(a.ref), a.kind, escape(a.detail), f"{a.size_bytes / 2**20:.1f} MiB")
    console.print(table)
    if not found:
        console.print("[dim]none found in Ollama's store, LM Studio's folder or the HF cache[/]")
    return 0
