"""Custom resources a Ray node advertises, so Ray places engines where their device is.

Kept apart from both users (the Ray Data job in `batch`, the Ray Serve deployment in
`service`) and free of any Ray import: it only reads the platform.
"""

from __future__ import annotations

import platform
import sys


def node_resources() -> dict[str, float]:
    """`{"ane": 1}` on Apple silicon (a Neural Engine for the Core ML lane), else nothing."""
    if sys.platform == "darwin" and platform.machine() == "arm64":
        return {"ane": 1.0}
    return {}
