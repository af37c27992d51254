"""`synapse certify`: certify a lane, list and show certificates.

    synapse certify --model NAME --lane llama|ane [--shapes 8x128,4x256p] [--json]
                    [--report PATH.html] [--threshold NAME=VALUE ...]
                    [--placement-threshold X] [--sample K] [--no-curve] [--reference-dir DIR]
                    [--reference sentence-transformers|numpy]
    synapse certify ls [--json]
    synapse certify show ID [--json] [--report PATH.html]

An embedder is judged on every output it serves (dense; sparse, multi-vector, late chunking
against their own references), one verdict per output; a refused output is "not served".

Exit status of a run: 0 certified, 4 provisional, 1 failed; typed errors 2 (caller's fault)
or 3 (engine/host fault), as the other commands.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import msgspec
from rich.console import Console

from certification.shapes import parse_shapes

EXIT = {"certified": 0, "failed": 1, "provisional": 4}


def add_certify_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "certify",
        help="certify a lane: quality and placement gated together",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", help="model name in the artifact store")
    p.add_argument("--lane", choices=["llama", "ane"], default="llama")
    p.add_argument(
        "--shapes",
        help="Core ML shapes to admit: ROWSxSEQ[p[/SEGS]],... "
        "(p = packed); default: the worker's default shapes",
    )
    p.add_argument("--json", action="store_true", help="print the certificate as JSON")
    p.add_argument("--report", metavar="PATH.html", help="write the HTML report here")
    p.add_argument(
        "--threshold",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override one threshold of the gate table (recorded in the "
        "certificate), e.g. min_cosine=0.99999",
    )
    p.add_argument(
        "--placement-threshold",
        type=float,
        metavar="SHARE",
        help="minimum Neural Engine share (default from the table: 0.9)",
    )
    p.add_argument(
        "--sample",
        type=int,
        default=1,
        metavar="K",
        help="judge every K-th corpus item only (smoke runs; recorded)",
    )
    p.add_argument("--batch-size", type=int, default=8, help="items per lane request")
    p.add_argument(
        "--no-curve",
        action="store_true",
        help="skip the latency curve (smoke runs: routing measures a certificate's missing "
        "curve when it loads the lane)",
    )
    p.add_argument(
        "--reference-dir",
        help="HF directory of the fp32 reference "
        "(default: the one the artifact was converted from; required for a model "
        "ingested from a GGUF file)",
    )
    p.add_argument(
        "--reference",
        choices=["sentence-transformers", "numpy"],
        help="the forward that judges the lane (default: sentence-transformers "
        "where installed, else the numpy BERT reference, which covers BERT only)",
    )
    p.add_argument("--no-save", action="store_true", help="do not store the certificate")
    p.set_defaults(func=main)
    csub = p.add_subparsers(dest="certify_command")
    ls = csub.add_parser("ls", help="list certificates")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=main)
    show = csub.add_parser("show", help="show one certificate (id or unique prefix)")
    show.add_argument("id")
    show.add_argument("--json", action="store_true")
    show.add_argument("--report", metavar="PATH.html")
    show.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from certification.store import CertificateStore
    from common.errors import InvalidRequest, SynapseError

    console = Console(stderr=bool(getattr(args, "json", False)))
    err = Console(stderr=True)
    store = CertificateStore()
    command = getattr(args, "certify_command", None)
    try:
        if command == "ls":
            return _ls(store, args, console)
        if command == "show":
            return _show(store, args, console)
        return _run(store, args, console, err)
    except SynapseError:
        raise  # typed already: the command line's boundary (cli.main) reports it
    except ValueError as exc:  # a bad argument found by a parser that raises untyped
        raise InvalidRequest(str(exc)) from None


def parse_overrides(items: list[str], placement: float | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--threshold {item!r}: expected NAME=VALUE")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--threshold {item!r}: {value!r} is not a number") from None
    if placement is not None:
        out["placement_share"] = placement
    return out


def _run(store, args: argparse.Namespace, console: Console, err: Console) -> int:

    from certification.modules import build_module
    from certification.runner import RunOptions, certify
    from certification.terminal import RichProgress
    from host.module import ModuleConfig
    from ingest.defaults import ensure_defaults

    if not args.model:
        raise ValueError("--model is required (or use `certify ls` / `certify show ID`)")
    options = RunOptions(
        model=args.model,
        lane=args.lane,
        shapes=parse_shapes(args.shapes),
        sample_stride=args.sample,
        batch_size=args.batch_size,
        curve=not args.no_curve,
        reference_dir=args.reference_dir,
        reference=args.reference,
        overrides=parse_overrides(args.threshold, args.placement_threshold),
        save=not args.no_save,
    )

    async def go():
        ensure_defaults()
        async with build_module(ModuleConfig()) as mod:
            with RichProgress(console if not args.json else err) as progress:
                return await certify(mod, options, store, progress)

    cert = asyncio.run(go())
    _output(cert, args, console)
    return EXIT[cert.status]


def _ls(store, args: argparse.Namespace, console: Console) -> int:
    from certification.terminal import print_list

    certs = store.ls()
    if args.json:
        sys.stdout.write(
            msgspec.json.encode(
                [
                    {
                        "id": c.id,
                        "status": c.status,
                        "failing": c.failing,
                        "created_at": c.created_at,
                        "key": msgspec.to_builtins(c.key),
                    }
                    for c in certs
                ]
            ).decode()
            + "\n"
        )
        return 0
    if not certs:
        console.print(f"no certificates in {store.root}")
        return 0
    print_list(console, certs)
    return 0


def _show(store, args: argparse.Namespace, console: Console) -> int:
    cert = store.find(args.id)
    _output(cert, args, console)
    return 0


def _output(cert, args: argparse.Namespace, console: Console) -> None:
    from certification import report
    from certification.terminal import print_certificate

    if args.json:
        sys.stdout.write(msgspec.json.encode(cert).decode() + "\n")
    else:
        print_certificate(console, cert)
    if getattr(args, "report", None):
        path = report.write(cert, args.report)
        (console if not args.json else Console(stderr=True)).print(f"report: {path}")
