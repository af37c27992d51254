"""A stand-in for an engine library whose import is slow (coremltools with torch installed:
8-11 s). Importing it really takes $SYNAPSE_FAULTY_IMPORT_S seconds; the faulty worker imports
it before HELLO (`--import-at-start`: the race, a slow import that misses the HELLO window)
or during LOAD (the fix)."""

from __future__ import annotations

import os
import time

IMPORT_SECONDS = float(os.environ.get("SYNAPSE_FAULTY_IMPORT_S", "0"))
time.sleep(IMPORT_SECONDS)
