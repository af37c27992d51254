"""Handlers of the model-facing CLI commands: models, embed, rerank, generate, quickstart.

Each handler returns an exit code and lets typed errors through to `cli.main`, which prints
`error[<code>]: message` on stderr and exits 2 (caller's fault) or 3 (engine/host fault), so
scripts can tell them apart.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from cli.sources import ingest_reference, is_model_reference, print_available, pull_model
from common.errors import InvalidRequest
from host.module import Module, ModuleConfig
from ingest.defaults import ensure_defaults
from ingest.precision import embed_precision, lane_precisions
from ingest.store import DEFAULT_EMBED, ArtifactStore

console = Console()

QUICKSTART_SENTENCES = [
    "The cat sits on the mat.",
    "A kitten is resting on a rug.",
    "Stock markets fell sharply on Monday.",
    "Le chat dort sur le tapis.",
]


def add_model_commands(sub: argparse._SubParsersAction) -> None:
    models = sub.add_parser(
        "models", help="the artifact store: ls | pull ORG/NAME | ingest PATH | rm NAME"
    )
    models_sub = models.add_subparsers(dest="models_command", required=True)
    ls = models_sub.add_parser("ls", help="list installed models")
    ls.add_argument("--json", action="store_true")
    ls.add_argument(
        "--available",
        action="store_true",
        help="list the embedding and rerank models Ollama, LM Studio and the Hugging Face "
        "cache already hold (what `models ingest` takes)",
    )
    ls.set_defaults(func=_models_ls)
    ingest = models_sub.add_parser(
        "ingest",
        help="add a model: a Hugging Face / sentence-transformers dir (BERT, "
        "XLM-RoBERTa, ModernBERT, Qwen3, Gemma 3 embedding; converted to GGUF), a GGUF file, "
        "ORG/NAME from the Hugging Face cache, ollama:NAME[:TAG] or lmstudio:PUBLISHER/REPO",
    )
    ingest.add_argument(
        "path",
        nargs="?",
        help="model dir, .gguf file, ORG/NAME[@REVISION] (Hugging Face cache), "
        "ollama:NAME[:TAG], lmstudio:PUBLISHER/REPO[/FILE]; omit to install the defaults",
    )
    ingest.add_argument("--name")
    ingest.add_argument(
        "--dtype", choices=["f16", "f32"], help="default: this platform's (see `models ls`)"
    )
    ingest.add_argument(
        "--kind",
        choices=["embed", "rerank"],
        help="GGUF only: default from its metadata (a classifier head reranks)",
    )
    ingest.add_argument(
        "--pooling",
        choices=["mean", "cls", "last"],
        help="GGUF only: an embedder's pooling, when its metadata does not say",
    )
    ingest.add_argument(
        "--max-tokens", type=int, help="GGUF only: default truncation (default: the model's limit)"
    )
    _add_encode_options(ingest)
    ingest.add_argument(
        "--true-token",
        metavar="TOKEN",
        help="directory of an LLM reranker: the token whose logit means relevant (default yes)",
    )
    ingest.add_argument(
        "--false-token",
        metavar="TOKEN",
        help="directory of an LLM reranker: the token whose logit means not relevant (default no)",
    )
    ingest.set_defaults(func=_models_ingest)
    pull = models_sub.add_parser(
        "pull",
        help="download a model from the Hugging Face Hub (into its cache) and ingest it",
        description="Download ORG/NAME[@REVISION] with huggingface_hub into the Hugging Face "
        "cache (only the files the model needs; resumable; HF_TOKEN, HF_ENDPOINT and "
        "HF_HUB_OFFLINE apply) and ingest it as `models ingest DIR` does. A model already "
        "pulled at the commit the revision names is left as it is.",
    )
    pull.add_argument("repo", metavar="ORG/NAME[@REVISION]")
    pull.add_argument("--name", help="store name (default: NAME, lowercased)")
    pull.add_argument(
        "--dtype", choices=["f16", "f32"], help="default: this platform's (see `models ls`)"
    )
    _add_encode_options(pull)
    pull.set_defaults(func=_models_pull)
    rm = models_sub.add_parser("rm", help="remove a model")
    rm.add_argument("name")
    rm.set_defaults(func=_models_rm)

    embed = sub.add_parser("embed", help="embed texts")
    embed.add_argument("texts", nargs="+")
    embed.add_argument("--model")
    embed.add_argument("--no-normalize", action="store_true")
    embed.add_argument("--no-truncate", action="store_true")
    embed.add_argument("--json", action="store_true", help="print the vectors as JSON")
    embed.add_argument("--lane", choices=["ane", "llama"], help=_LANE_HELP)
    for flag, what in (
        ("--sparse", "the learned sparse vector (a sparse model)"),
        ("--multi-vector", "the per-token output vectors (a multi-vector model)"),
        ("--tokens", "every token's final state"),
    ):
        embed.add_argument(flag, action="store_true", help=f"print {what}; with others: one pass")
    embed.add_argument(
        "--query", action="store_true", help="the query side of a sparse or multi-vector model"
    )
    prompt = embed.add_mutually_exclusive_group()
    prompt.add_argument(
        "--prompt-name",
        metavar="NAME",
        help="prepend the model's prompt NAME (default: its default prompt)",
    )
    prompt.add_argument(
        "--prompt", metavar="TEXT", help="prepend TEXT to every input instead ('' for none)"
    )
    embed.set_defaults(func=_embed)

    rerank = sub.add_parser("rerank", help="rank documents against a query")
    rerank.add_argument("query")
    rerank.add_argument("documents", nargs="+")
    rerank.add_argument("--model")
    rerank.add_argument("--json", action="store_true")
    rerank.add_argument("--lane", choices=["ane", "llama"], help=_LANE_HELP)
    rerank.add_argument(
        "--instruction", help="LLM rerankers: the instruction (default: the model's own)"
    )
    rerank.set_defaults(func=_rerank)

    gen = sub.add_parser("generate", help="short greedy generation")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--grammar", type=Path, help="a GBNF grammar file")
    gen.add_argument("--model")
    gen.add_argument("--json", action="store_true")
    gen.set_defaults(func=_generate)

    quick = sub.add_parser("quickstart", help="install the default models and embed a few texts")
    quick.set_defaults(func=_quickstart)


# One model on either lane: how a user compares the Core ML graph with llama.cpp on it.
_LANE_HELP = (
    "serve on this lane: ane (the Core ML graph), llama (llama.cpp); default: the "
    "lane the certificates choose"
)


def _add_encode_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prompt",
        action="append",
        type=_named_prompt,
        metavar="NAME=TEXT",
        help="a prompt prepended to inputs embedded with --prompt-name NAME; adds to or "
        "replaces the model's own (repeatable)",
    )
    parser.add_argument(
        "--default-prompt", metavar="NAME", help="the prompt applied when a call names none"
    )
    parser.add_argument(
        "--matryoshka-dims",
        type=_widths,
        metavar="D1,D2,...",
        help="widths the model was trained to be cut to (Matryoshka), e.g. 512,256,128",
    )


def _named_prompt(text: str) -> tuple[str, str]:
    name, sep, prompt = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=TEXT")
    return name, prompt


def _widths(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected comma-separated widths, e.g. 512,256,128"
        ) from None


def _module(args: argparse.Namespace) -> Module:
    """The Module a command serves with: certified Core ML lanes, else llama.cpp."""
    from certification.modules import build_module  # late: only commands that serve load it

    return build_module(ModuleConfig())


def _store() -> ArtifactStore:
    return ArtifactStore()


def _models_ls(args: argparse.Namespace) -> int:
    if getattr(args, "available", False):
        return print_available(args.json)
    records = _store().ls()
    if args.json:
        print(json.dumps([{"name": r.name, **_manifest_dict(r)} for r in records]))
        return 0
    # The precision each lane computes with: the GGUF's on llama.cpp, fp16 on Core ML.
    table = Table("name", "kind", "dims", "llama", "ane", "size", "digest")
    table.columns[0].no_wrap = True
    for r in records:
        man = r.manifest
        precisions = lane_precisions(man.kind, man.dtype)
        table.add_row(
            r.name,
            man.kind,
            str(man.dims),
            precisions["llama"],
            precisions.get("ane", "-"),
            f"{man.size_bytes / 2**20:.1f} MiB",
            man.digest[:12],
        )
    console.print(table)
    # Below the table, which has no room left in 80 columns.
    for r in records:
        if r.manifest.prompts or r.manifest.matryoshka_dims:
            console.print(escape(f"{r.name}: {_encode_options_line(r.manifest)}"))
        if r.manifest.provenance is not None:
            console.print(escape(f"{r.name}: from {r.manifest.provenance.label()}"))
    choice = embed_precision()
    console.print(f"[dim]{DEFAULT_EMBED} is {choice.dtype} on this machine: {choice.reason}[/]")
    return 0


def _encode_options_line(man) -> str:
    names = [f"{n} (default)" if n == man.default_prompt_name else n for n in sorted(man.prompts)]
    parts = [f"prompts {', '.join(names)}"] if names else []
    if man.matryoshka_dims:
        parts.append(f"Matryoshka dims {','.join(map(str, man.matryoshka_dims))}")
    return "; ".join(parts)


def _manifest_dict(record) -> dict:
    import msgspec

    man = record.manifest
    # The manifest omits empty fields; a script reading the list finds them on every model.
    return {
        **msgspec.to_builtins(man),
        "prompts": man.prompts,
        "default_prompt_name": man.default_prompt_name,
        "matryoshka_dims": man.matryoshka_dims,
        "precision": lane_precisions(man.kind, man.dtype),
        "provenance": msgspec.to_builtins(man.provenance),
    }


def _models_ingest(args: argparse.Namespace) -> int:
    if args.path is None:
        if args.prompt or args.default_prompt or args.matryoshka_dims:
            raise InvalidRequest(
                "--prompt, --default-prompt and --matryoshka-dims need a model PATH"
            )
        ensure_defaults()
    elif not Path(args.path).exists() and is_model_reference(args.path):
        ingest_reference(args)
    elif Path(args.path).is_file():
        if args.true_token or args.false_token:
            raise InvalidRequest(
                "--true-token/--false-token apply to a directory; a GGUF names its two labels"
            )
        if args.dtype is not None:
            raise InvalidRequest(
                "--dtype converts a Hugging Face directory; a GGUF keeps its own precision"
            )
        from certification.tokenizer_proof import prove_gguf_tokenizer  # spawns llama.cpp

        rec = _store().ingest_gguf(
            args.path,
            name=args.name,
            kind=args.kind,
            pooling=args.pooling,
            max_tokens=args.max_tokens,
            prove=prove_gguf_tokenizer,
            prompts=dict(args.prompt) if args.prompt else None,
            default_prompt_name=args.default_prompt,
            matryoshka_dims=args.matryoshka_dims,
        )
        console.print(
            f"ingested {rec.name} ({rec.kind}, {rec.manifest.pooling} pooling, "
            f"{rec.manifest.dims} dims; tokenizer proven equal to llama.cpp's)"
        )
    else:
        if args.kind or args.pooling or args.max_tokens:
            raise InvalidRequest(
                "--kind, --pooling and --max-tokens apply to GGUF files; a directory says its own"
            )
        rec = _store().ingest_hf_dir(
            args.path,
            name=args.name,
            dtype=args.dtype,
            prompts=dict(args.prompt) if args.prompt else None,
            default_prompt_name=args.default_prompt,
            matryoshka_dims=args.matryoshka_dims,
            true_token=args.true_token,
            false_token=args.false_token,
        )
        console.print(f"ingested {rec.name} ({rec.kind}, {rec.manifest.dims} dims)")
    return _models_ls(argparse.Namespace(json=False))


def _models_pull(args: argparse.Namespace) -> int:
    pull_model(args)
    return _models_ls(argparse.Namespace(json=False))


def _models_rm(args: argparse.Namespace) -> int:
    _store().rm(args.name)
    return 0


def _token_kinds(args: argparse.Namespace) -> list[str]:
    kinds = [
        kind
        for kind, on in (
            ("sparse", args.sparse),
            ("multivector", args.multi_vector),
            ("tokens", args.tokens),
        )
        if on
    ]
    return kinds


def _embed_tokens(args: argparse.Namespace, kinds: list[str]) -> int:
    """`--sparse / --multi-vector / --tokens`: those outputs of one forward pass."""

    async def go() -> int:
        ensure_defaults()
        async with _module(args) as mod:
            got = await mod.encode_outputs(
                args.texts,
                kinds,
                args.model,
                normalize=not args.no_normalize,
                truncate=not args.no_truncate,
                lane=getattr(args, "lane", None),
                side="query" if args.query else "document",
                prompt_name=getattr(args, "prompt_name", None),
                prompt=getattr(args, "prompt", None),
            )
        data = []
        for i in range(len(args.texts)):
            item: dict = {"index": i, "n_tokens": got.n_tokens[i]}
            if got.sparse is not None:
                idx, val = got.sparse[i]
                item["sparse"] = {"indices": idx.tolist(), "values": val.tolist()}
            if got.multivector is not None:
                item["multivector"] = got.multivector[i].tolist()
            if got.tokens is not None:
                item["tokens"] = got.tokens[i].tolist()
            data.append(item)
        if args.json:
            print(json.dumps({"model": got.model, "data": data}))
            return 0
        console.print(f"model [bold]{got.model}[/]: {', '.join(kinds)} from one pass")
        for text, item in zip(args.texts, data, strict=True):
            parts = []
            if "sparse" in item:
                pairs = sorted(
                    zip(item["sparse"]["indices"], item["sparse"]["values"], strict=True),
                    key=lambda p: -p[1],
                )
                top = ", ".join(f"{i}:{v:.3f}" for i, v in pairs[:5])
                parts.append(f"sparse {len(pairs)} active [{top}]")
            for kind in ("multivector", "tokens"):
                if kind in item:
                    rows = item[kind]
                    parts.append(f"{kind} {len(rows)} x {len(rows[0]) if rows else 0}")
            console.print(f"  {escape(repr(text[:50]))}: " + "; ".join(parts))
        return 0

    return asyncio.run(go())


def _embed(args: argparse.Namespace) -> int:
    kinds = _token_kinds(args)
    if kinds:
        return _embed_tokens(args, kinds)

    async def go() -> int:
        ensure_defaults()
        async with _module(args) as mod:
            result = await mod.embed(
                args.texts,
                args.model,
                normalize=not args.no_normalize,
                truncate=not args.no_truncate,
                lane=getattr(args, "lane", None),
                prompt_name=getattr(args, "prompt_name", None),
                prompt=getattr(args, "prompt", None),
            )
            lane = _served_lane(mod, result.model, args)
        if args.json:
            print(
                json.dumps(
                    {
                        "model": result.model,
                        "lane": lane,
                        "prompt": result.prompt,
                        "usage": {
                            "prompt_tokens": result.usage.prompt_tokens,
                            "total_tokens": result.usage.total_tokens,
                        },
                        "data": [v.tolist() for v in result.vectors],
                    }
                )
            )
            return 0
        _print_embeddings(args.texts, result, lane)
        return 0

    return asyncio.run(go())


def _served_lane(mod: Module, model: str, args: argparse.Namespace) -> str:
    """The lane that served the call: the one asked for, else the one the policy chose."""
    return getattr(args, "lane", None) or mod.default_lane(model).lane


def _print_embeddings(texts: list[str], result, lane: str) -> None:
    v = result.vectors
    console.print(
        f"model [bold]{result.model}[/] ({lane} lane): {v.shape[0]} vectors x {v.shape[1]} dims, "
        f"{result.usage.total_tokens} tokens"
    )
    if result.prompt:
        console.print(f"  each input prefixed with the prompt {escape(repr(result.prompt))}")
    for text, row, cut in zip(texts, v, result.truncated, strict=True):
        head = ", ".join(f"{x:+.3f}" for x in row[:4])
        note = " (truncated)" if cut else ""
        console.print(f"  [{head}, ...] |v|={np.linalg.norm(row):.3f}  {text[:60]!r}{note}")
    if len(texts) > 1:
        sims = v @ v.T
        table = Table("cosine", *[str(i) for i in range(len(texts))])
        for i, row in enumerate(sims):
            table.add_row(str(i), *[f"{x:.3f}" for x in row])
        console.print(table)


def _rerank(args: argparse.Namespace) -> int:
    async def go() -> int:
        ensure_defaults()
        async with _module(args) as mod:
            result = await mod.rerank(
                args.query,
                args.documents,
                args.model,
                lane=getattr(args, "lane", None),
                instruction=getattr(args, "instruction", None),
            )
            lane = _served_lane(mod, result.model, args)
        if args.json:
            print(
                json.dumps(
                    {
                        "model": result.model,
                        "lane": lane,
                        "method": result.method,
                        "results": [{"index": i, "score": s} for i, s in result.results],
                    }
                )
            )
            return 0
        console.print(f"model [bold]{result.model}[/] ({result.method}, {lane} lane)")
        for rank, (i, score) in enumerate(result.results, 1):
            console.print(f"  {rank}. {score:+.4f}  [{i}] {args.documents[i][:70]!r}")
        return 0

    return asyncio.run(go())


def _generate(args: argparse.Namespace) -> int:
    async def go() -> int:
        try:
            grammar = args.grammar.read_text() if args.grammar else None
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidRequest(f"cannot read grammar {args.grammar}: {exc}") from None
        ensure_defaults()
        async with _module(args) as mod:
            result = await mod.generate(args.prompt, args.max_tokens, grammar, args.model)
        if args.json:
            print(
                json.dumps(
                    {
                        "model": result.model,
                        "text": result.text,
                        "finish_reason": result.finish_reason,
                        "usage": {
                            "prompt_tokens": result.n_prompt,
                            "completion_tokens": result.n_gen,
                        },
                    }
                )
            )
            return 0
        console.print(f"{args.prompt}[bold]{result.text}[/]")
        console.print(
            f"[dim]{result.model}: {result.n_prompt} prompt + {result.n_gen} generated tokens, "
            f"finish_reason={result.finish_reason}[/]"
        )
        return 0

    return asyncio.run(go())


def _quickstart(args: argparse.Namespace) -> int:
    console.rule("installing the default models (once)")
    ensure_defaults()
    _models_ls(argparse.Namespace(json=False))
    console.rule("embedding through a supervised llama.cpp worker")
    # Through the embed command's own parser, so the call carries every flag it has (a
    # hand-built Namespace missed the ones added later, and quickstart failed on them).
    parser = argparse.ArgumentParser(prog="synapse")
    add_model_commands(parser.add_subparsers(dest="command"))
    code = _embed(parser.parse_args(["embed", *QUICKSTART_SENTENCES]))
    console.print("next: `synapse rerank QUERY DOC...`, `synapse generate PROMPT`")
    sys.stdout.flush()
    return code
