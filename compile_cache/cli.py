"""`synapse cache ls|du|verify|gc|evict|clear` (and `python -m compile_cache ...`).

`ls` shows each entry's KIND (its key's `kind` field: "mlpackage" for a converted package,
"mlmodelc" / "reference-program" for a compiled form); verify, gc, evict, clear and the budget
treat every kind alike.

Every subcommand takes `--json` (one JSON object on stdout) and `--root`. Exit codes:
0 success; 1 `verify` found corrupt entries (they were evicted unless leased) or `gc` could
not reach the budget because of leases; 2 a typed error (printed with its code) or bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from compile_cache.errors import CompileCacheError, InvalidSelector
from compile_cache.model import Entry, EvictionReport, Usage, VerifyReport
from compile_cache.paths import ENV_CACHE_BUDGET, ENV_CACHE_DIR, default_budget, default_root
from compile_cache.store import CompileCache
from compile_cache.units import format_age, format_size, parse_size

EXIT_OK, EXIT_FINDINGS, EXIT_ERROR = 0, 1, 2

_ROOT_HELP = (
    f"cache root (default: ${ENV_CACHE_DIR}/compile_cache if set, "
    "else the user cache dir's synapse/compile_cache)"
)


def add_cache_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `cache` on a host CLI's subparsers; sets `func` (`args.func(args) -> int`)."""
    parser = subparsers.add_parser(
        "cache",
        help="inspect and maintain the compiled-shape cache",
        description="Inspect and maintain the compiled-shape cache.",
    )
    _configure(parser)
    return parser


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--root", type=Path, default=None, help=_ROOT_HELP)
    # Also accepted after the subcommand; SUPPRESS keeps it from overwriting the outer one.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON object")
    common.add_argument("--root", type=Path, default=argparse.SUPPRESS, help=_ROOT_HELP)
    sub = parser.add_subparsers(dest="cache_command", metavar="COMMAND", required=True)
    sub.add_parser("ls", parents=[common], help="list entries, most recently used first")
    sub.add_parser("du", parents=[common], help="total size against the budget")
    sub.add_parser("verify", parents=[common], help="re-hash every entry; evict the corrupt ones")
    gc = sub.add_parser(
        "gc", parents=[common], help="evict least recently used entries down to a budget"
    )
    gc.add_argument(
        "--budget",
        metavar="SIZE",
        default=None,
        help=f"e.g. 500M, 2GiB, 1024 (default: ${ENV_CACHE_BUDGET} or 10GiB); "
        "K/M/G and KiB/MiB/GiB are powers of 1024, KB/MB/GB powers of 1000",
    )
    ev = sub.add_parser("evict", parents=[common], help="evict one entry")
    ev.add_argument(
        "key",
        metavar="KEY",
        help="a digest prefix (at least 4 hex digits, as `ls` shows) or the key as a JSON object",
    )
    sub.add_parser("clear", parents=[common], help="evict every entry not leased")
    parser.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m compile_cache",
        description="Inspect and maintain the compiled-shape cache.",
    )
    _configure(parser)
    args = parser.parse_args(argv)
    return int(args.func(args))


def run(args: argparse.Namespace) -> int:
    root: Path = args.root if args.root is not None else default_root()
    as_json: bool = args.json
    try:
        with CompileCache(root, budget_bytes=None) as cache:
            return _COMMANDS[args.cache_command](cache, args, as_json)
    except CompileCacheError as e:
        if as_json:
            _print_json({"error": e.to_dict()})
        else:
            print(f"error: {e.message} [{e.code}]", file=sys.stderr)
        return EXIT_ERROR


# ---- commands -------------------------------------------------------------------------------


def _ls(cache: CompileCache, args: argparse.Namespace, as_json: bool) -> int:
    entries = cache.ls()
    leased = {e.digest: cache.is_leased(e) for e in entries}
    if as_json:
        _print_json(
            {
                "root": str(cache.root),
                "entries": [
                    {**e.to_json(), "kind": _kind(e), "leased": leased[e.digest]} for e in entries
                ],
            }
        )
        return EXIT_OK
    console = _console()
    if not entries:
        console.print(f"The compile cache at {cache.root} is empty.")
        return EXIT_OK
    from rich import box
    from rich.table import Table

    now = time.time()
    common, varying = _split_key_fields(entries)
    console.print(f"compile cache: {cache.root}")
    if common and len(entries) > 1:
        console.print("shared key fields: " + " ".join(f"{k}={v}" for k, v in common.items()))
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("DIGEST", no_wrap=True)
    table.add_column("KIND", no_wrap=True)
    table.add_column("SIZE", justify="right", no_wrap=True)
    table.add_column("BUILT", justify="right", no_wrap=True)
    table.add_column("LAST USED", justify="right", no_wrap=True)
    table.add_column("BUILD", justify="right", no_wrap=True)
    table.add_column("LEASED", no_wrap=True)
    table.add_column("KEY", overflow="fold", ratio=1)
    for e in entries:
        table.add_row(
            e.digest[:12],
            _kind(e),
            format_size(e.size),
            format_age(now - e.created),
            format_age(now - e.last_used),
            f"{e.build_seconds:.1f}s",
            "yes" if leased[e.digest] else "",
            " ".join(f"{k}={_fmt_value(e.key[k])}" for k in varying if k in e.key) or "-",
        )
    console.print(table)
    total = sum(e.size for e in entries)
    kinds: dict[str, int] = {}
    for e in entries:
        kinds[_kind(e)] = kinds.get(_kind(e), 0) + 1
    by_kind = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    console.print(f"{len(entries)} entries ({by_kind}), {format_size(total)}")
    return EXIT_OK


def _du(cache: CompileCache, args: argparse.Namespace, as_json: bool) -> int:
    usage = cache.du()
    budget = default_budget()
    usage = Usage(usage.root, usage.entries, usage.total_bytes, budget, usage.tmp_bytes)
    if as_json:
        _print_json(usage.to_json())
        return EXIT_OK
    from rich.table import Table

    share = f" ({100 * usage.total_bytes / budget:.1f}% of budget)" if budget else ""
    table = Table(show_header=False, box=None)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("root", str(usage.root))
    table.add_row("entries", str(usage.entries))
    table.add_row("total", format_size(usage.total_bytes) + share)
    table.add_row("budget", format_size(budget))
    table.add_row("builds in flight / leftovers", format_size(usage.tmp_bytes))
    _console().print(table)
    return EXIT_OK


def _verify(cache: CompileCache, args: argparse.Namespace, as_json: bool) -> int:
    report: VerifyReport = cache.verify()
    code = EXIT_FINDINGS if report.corrupt else EXIT_OK
    if as_json:
        _print_json(report.to_json())
        return code
    console = _console()
    console.print(
        f"checked {report.checked} entries: {report.ok} ok, {len(report.corrupt)} corrupt"
    )
    if report.corrupt:
        from rich.table import Table

        table = Table()
        table.add_column("DIGEST", no_wrap=True)
        table.add_column("ACTION", no_wrap=True)
        table.add_column("PROBLEMS", overflow="fold")
        for c in report.corrupt:
            action = "evicted" if c.evicted else "kept (leased; rerun verify later)"
            table.add_row(c.digest[:12], action, "; ".join(c.reasons))
        console.print(table)
    return code


def _gc(cache: CompileCache, args: argparse.Namespace, as_json: bool) -> int:
    budget = parse_size(args.budget) if args.budget is not None else default_budget()
    report = cache.gc(budget)
    code = EXIT_FINDINGS if report.after_bytes > budget else EXIT_OK
    if as_json:
        _print_json(report.to_json())
        return code
    _print_eviction(report, what="gc")
    return code


def _evict(cache: CompileCache, args: argparse.Namespace, as_json: bool) -> int:
    selector: Any = args.key
    if selector.lstrip().startswith("{"):
        try:
            selector = json.loads(selector)
        except json.JSONDecodeError as e:
            raise InvalidSelector(f"KEY looks like JSON but does not parse: {e}") from e
    report = cache.evict(selector)
    if as_json:
        _print_json(report.to_json())
    else:
        _print_eviction(report, what="evict")
    return EXIT_OK


def _clear(cache: CompileCache, args: argparse.Namespace, as_json: bool) -> int:
    report = cache.clear()
    if as_json:
        _print_json(report.to_json())
    else:
        _print_eviction(report, what="clear")
    return EXIT_OK


_COMMANDS = {"ls": _ls, "du": _du, "verify": _verify, "gc": _gc, "evict": _evict, "clear": _clear}


# ---- output helpers ----------------------------------------------------------------------------


def _console() -> Any:
    from rich.console import Console

    return Console(highlight=False)


def _print_json(obj: object) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _print_eviction(report: EvictionReport, *, what: str) -> None:
    console = _console()
    n = len(report.evicted)
    names = ", ".join(d[:12] for d in report.evicted[:8]) + (" ..." if n > 8 else "")
    line = f"{what}: evicted {n} {'entry' if n == 1 else 'entries'}"
    if n:
        line += f" ({names}), freed {format_size(report.freed_bytes)}"
    console.print(line)
    total = f"total now {format_size(report.after_bytes)}"
    if what == "gc" and report.budget_bytes is not None:
        total += f" (budget {format_size(report.budget_bytes)})"
    console.print(total)
    if report.skipped_leased:
        k = len(report.skipped_leased)
        console.print(
            f"[yellow]kept {k} leased {'entry' if k == 1 else 'entries'} in use by live processes"
            "[/yellow]"
        )


def _kind(entry: Entry) -> str:
    kind = entry.key.get("kind")
    return kind if isinstance(kind, str) else "-"


def _fmt_value(value: object) -> str:
    if isinstance(value, str):
        if len(value) > 16 and all(c in "0123456789abcdef" for c in value):
            return value[:12] + "…"  # a digest: its prefix identifies it
        return value
    return json.dumps(value, separators=(",", ":"))


def _split_key_fields(entries: list[Entry]) -> tuple[dict[str, str], list[str]]:
    """Key fields equal in every entry (shown once) and the ones that tell entries apart."""
    names = sorted({k for e in entries for k in e.key} - {"kind"})  # KIND has its column
    common: dict[str, str] = {}
    varying: list[str] = []
    for name in names:
        values = {json.dumps(e.key.get(name), sort_keys=True) for e in entries}
        if len(values) == 1 and name in entries[0].key:
            common[name] = _fmt_value(entries[0].key[name])
        else:
            varying.append(name)
    if len(entries) == 1:
        return {}, names
    return common, varying
