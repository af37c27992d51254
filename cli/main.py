"""The `synapse` command line.

Every command's typed error (`common.errors.SynapseError`) ends here, as one stderr line
`error[<code>]: <message>` and exit 2 (the caller's to fix) or 3 (an engine or host fault);
see `exit_status`.


Every command that serves a model builds its Module with `certification.modules.build_module`
(the certificate-backed lane policy), as `synapse serve` and `synapse batch embed` do.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.markup import escape

from common.errors import StorageFull, SynapseError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="synapse", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log host events")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="supervise real worker processes through real faults")
    demo.set_defaults(func=_demo)

    doctor = sub.add_parser("doctor", help="what this machine can run")
    doctor.add_argument("--json", action="store_true")
    doctor.set_defaults(func=lambda args: _doctor(args.json))

    from cli.commands import add_model_commands

    add_model_commands(sub)

    from cli.classify import add_classify_parser

    add_classify_parser(sub)

    from batch.cli import add_batch_parser

    add_batch_parser(sub)

    from service.cli import add_serve_parser

    add_serve_parser(sub)

    # The CLI sits above both packages; certification.cli imports host only when it runs.
    from certification.cli import add_certify_parser

    add_certify_parser(sub)

    try:
        from compile_cache.cli import add_cache_parser
    except ImportError:  # the cache tool is optional to the rest of the CLI
        pass
    else:
        add_cache_parser(sub)
    return parser


def _demo(args: argparse.Namespace) -> int:
    from cli.demo import main as demo_main

    return demo_main()


def _doctor(as_json: bool) -> int:
    from cli.doctor import main as doctor_main

    return doctor_main(as_json)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.ERROR,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except SynapseError as exc:
        # soft_wrap: one line whatever the terminal's width, for scripts reading it.
        Console(stderr=True).print(escape(f"error[{exc.code}]: {exc.message}"), soft_wrap=True)
        return exit_status(exc)


def exit_status(exc: SynapseError) -> int:
    """2: the command cannot succeed until the caller changes something (an argument, the
    input, a model name, the disk's free space); 3: the engine or the host failed, and the
    same command may succeed again. A full disk is the caller's to fix: a script retrying on
    3 must not spin on it."""
    if exc.http_status < 500 or isinstance(exc, StorageFull):
        return 2
    return 3


if __name__ == "__main__":
    sys.exit(main())
