"""`python -m service [--host H] [--port P] [--config FILE]`."""

from __future__ import annotations

import argparse
import logging
import sys

from service.cli import add_serve_arguments, run_serve


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m service", description=__doc__)
    add_serve_arguments(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return run_serve(args)


if __name__ == "__main__":
    sys.exit(main())
