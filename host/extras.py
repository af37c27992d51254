"""Optional features behind pip extras: a feature whose packages are missing fails with one
typed error naming the extra that installs them, before anything starts."""

from __future__ import annotations

import importlib

from host.errors import MissingExtra


def require_extra(extra: str, module: str, feature: str) -> None:
    """Import `module` (the feature is about to), or raise `MissingExtra` for `extra`.

    The import itself is the test, not a spec lookup: `ray` may be present without what
    `ray.data` or `ray.serve` need, and the error then names the piece that is missing."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        missing = exc.name or module
        raise MissingExtra(
            f"{feature} needs the '{extra}' extra ({missing} is not installed): "
            f"pip install 'synapse[{extra}]'",
            extra=extra,
            missing=missing,
        ) from None
