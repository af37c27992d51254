"""`python -m host.serve [--host H] [--port P] [--config FILE]`."""

from __future__ import annotations

import argparse
import logging
import sys

from host.cli import lane_policy
from host.serve.cli import add_serve_arguments, run_serve


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m host.serve", description=__doc__)
    add_serve_arguments(parser)
    args = parser.parse_args()
    args.lane_policy = lane_policy
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return run_serve(args)


if __name__ == "__main__":
    sys.exit(main())
