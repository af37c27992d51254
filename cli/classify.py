"""`synapse classify TEXT... --model M`: a sequence classifier's label scores for each text,
or, with `--pair`, for each (text, text_pair) pair (the texts read two at a time)."""

from __future__ import annotations

import argparse
import asyncio
import json

from rich.console import Console
from rich.markup import escape

from common.errors import InvalidRequest
from host.classify import ClassifyInput

console = Console()


def add_classify_parser(sub: argparse._SubParsersAction) -> None:
    cls = sub.add_parser(
        "classify",
        help="score texts (or text pairs) with a sequence classifier",
        description="Every label's score for each input, best first: the model's softmax "
        "(single-label) or sigmoid (multi-label), as transformers' text-classification "
        "pipeline scores it, or the raw logits with --raw-scores.",
    )
    cls.add_argument("texts", nargs="+", metavar="TEXT")
    cls.add_argument("--model", required=True, help="the sequence classifier")
    cls.add_argument(
        "--pair",
        action="store_true",
        help="read the texts two at a time as (text, text_pair) pairs",
    )
    cls.add_argument("--raw-scores", action="store_true", help="the head's logits")
    cls.add_argument(
        "--lane", choices=["llama", "ane"], help="llama (default) or the Core ML graph"
    )
    cls.add_argument("--no-truncate", action="store_true", help="refuse an over-long input")
    cls.add_argument("--json", action="store_true", help="print the scores as JSON")
    cls.set_defaults(func=run_classify)


def inputs_of(texts: list[str], pair: bool) -> list[ClassifyInput]:
    if not pair:
        return list(texts)
    if len(texts) % 2:
        raise InvalidRequest(
            f"--pair reads the texts two at a time; {len(texts)} is an odd count", param="texts"
        )
    return [(texts[i], texts[i + 1]) for i in range(0, len(texts), 2)]


def run_classify(args: argparse.Namespace) -> int:
    from certification.modules import build_module  # late: only commands that serve load it
    from host.module import ModuleConfig

    inputs = inputs_of(args.texts, args.pair)

    async def go():
        async with build_module(ModuleConfig()) as mod:
            return await mod.classify(
                inputs, args.model, truncate=not args.no_truncate, lane=args.lane
            )

    result = asyncio.run(go())
    ranked = result.ranked(args.raw_scores)
    if args.json:
        rows = [[{"label": label, "score": score} for label, score in row] for row in ranked]
        print(json.dumps({"model": result.model, "activation": result.activation, "data": rows}))
        return 0
    what = "raw logits" if args.raw_scores else result.activation
    console.print(f"model [bold]{escape(result.model)}[/] ({what}, {args.lane or 'llama'} lane)")
    for item, row, cut in zip(inputs, ranked, result.truncated, strict=True):
        shown = " | ".join(map(str, item)) if isinstance(item, tuple) else str(item)
        note = " (truncated)" if cut else ""
        console.print(f"  {escape(repr(shown)[:70])}{note}")
        console.print("    " + "  ".join(f"{escape(label)} {score:.4f}" for label, score in row))
    return 0
