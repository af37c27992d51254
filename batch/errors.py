"""The job's own failures, each mapped to an exit status by the CLI.

- `BatchUsageError` (exit 2): the command cannot run as given — missing input, unknown rows
  format, unreadable Parquet/CSV, an output directory we cannot write, a checkpoint that does
  not match the command. Nothing was embedded.
- `JobAborted` (exit 1): the job started and stopped before the output was complete — more
  bad rows than `--max-errors`, an engine that keeps crashing, an interruption, a full disk
  (`StorageFull`). The checkpoint stays, so `--resume` can continue.
Bad rows are neither: they are error records (see `batch.rows`) and the job goes on.
"""

from __future__ import annotations

from host.errors import SynapseError

ENGINE_CRASHED = "engine_crashed"  # a row that crashed the engine twice
TOO_LONG = "too_long"  # over the model's limit with --no-truncate


class BatchUsageError(SynapseError):
    code = "usage"
    http_status = 400


class JobAborted(SynapseError):
    code = "aborted"
    http_status = 500


class StorageFull(JobAborted):
    """A write of the checkpoint or the output failed for want of space. Nothing committed is
    lost: a commit is whole or absent, so `--resume` after freeing space goes on from it."""

    code = "storage_full"
    http_status = 507
