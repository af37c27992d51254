"""Running one command's coroutine: typed errors become one stderr line and an exit code.

Every command line that drives a Module (the `synapse` subcommands, `certify`, bulk jobs)
reports errors the same way: `error[<code>]: <message>`, exit 2 for the caller's mistakes
(4xx-class codes, bad artifacts), 3 for the platform's (5xx-class: a crashed engine...).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from rich.console import Console
from rich.markup import escape

from host.errors import SynapseError
from ingest.errors import ArtifactError

err_console = Console(stderr=True)


def run_command(coro: Coroutine[Any, Any, int]) -> int:
    try:
        return asyncio.run(coro)
    except SynapseError as exc:
        err_console.print(escape(f"error[{exc.code}]: {exc.message}"))
        return 2 if exc.http_status < 500 else 3
    except ArtifactError as exc:
        err_console.print(escape(f"error[{exc.code}]: {exc.msg}"))
        return 2
