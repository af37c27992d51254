"""The job's own failures (`common.errors.SynapseError`s), each mapped to an exit status by
the CLI (`batch.cli.exit_status`).

- `BatchUsageError` (exit 2): the command cannot run as given — missing input, unknown rows
  format, unreadable Parquet/CSV, an output directory we cannot write, a checkpoint that does
  not match the command. Nothing was embedded.
- `JobAborted` (exit 1): the job started and stopped before the output was complete — more
  bad rows than `--max-errors`, an engine that keeps crashing, an interruption. A full disk
  (`common.errors.StorageFull`) ends the job the same way. The checkpoint stays, so `--resume`
  can continue.
Bad rows are neither: they are error records (see `batch.rows`) and the job goes on.
"""

from __future__ import annotations

from common.errors import SynapseError

ENGINE_CRASHED = "engine_crashed"  # a row that crashed the engine twice
TOO_LONG = "too_long"  # over the model's limit with --no-truncate


class BatchUsageError(SynapseError):
    code = "usage"
    http_status = 400


class JobAborted(SynapseError):
    code = "aborted"
    http_status = 500
