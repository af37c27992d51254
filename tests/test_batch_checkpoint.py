"""batch.checkpoint on real files: a removal cut short leaves no checkpoint that names parts it
no longer has (the next run starts clean instead of refusing, or crashing on --resume), and a
resume continues only with the artifact and the prompt its rows were embedded with."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import sys

import pyarrow as pa
import pytest

from batch.checkpoint import STATE, Checkpoint, checkpoint_dir
from batch.errors import BatchUsageError

JOB = {"input": "in.jsonl", "model": None}


def _committed(output, parts: int) -> Checkpoint:
    ckpt = Checkpoint.open(output, JOB, resume=False)
    for i in range(parts):
        ckpt.commit(pa.table({"id": [str(i)]}), [], i + 2, 1)
    return ckpt


def _remove_and_hang(output) -> None:
    import shutil

    ckpt = Checkpoint(checkpoint_dir(output), {"parts": 0})

    def stop_midway(path, ignore_errors=False):  # the rmtree the SIGKILL interrupts
        os.kill(os.getpid(), signal.SIGSTOP)

    shutil.rmtree = stop_midway
    ckpt.remove()


def test_a_removal_killed_midway_leaves_no_checkpoint(tmp_path):
    output = tmp_path / "out.parquet"
    _committed(output, 5)
    child = mp.get_context("fork" if sys.platform != "darwin" else "spawn").Process(
        target=_remove_and_hang, args=(output,)
    )
    child.start()
    os.waitpid(child.pid, os.WUNTRACED)  # stopped inside rmtree: state.json is gone already
    os.kill(child.pid, signal.SIGKILL)
    child.join(30)
    root = checkpoint_dir(output)
    assert root.is_dir() and not (root / STATE).exists()
    fresh = Checkpoint.open(output, JOB, resume=False)  # not "an unfinished job ... --resume"
    assert fresh.state["parts"] == 0 and fresh.next_line == 1


def test_resume_needs_the_same_artifact_and_the_same_prompt(tmp_path):
    output = tmp_path / "out.parquet"
    ckpt = _committed(output, 1)
    ckpt.bind_artifact("a" * 64, "query: ")
    again = Checkpoint.open(output, JOB, resume=True)
    again.bind_artifact("a" * 64, "query: ")  # the same job: continues
    with pytest.raises(
        BatchUsageError, match="with the prompt 'query: ', the rows would now get 'passage: '"
    ):
        Checkpoint.open(output, JOB, resume=True).bind_artifact("a" * 64, "passage: ")
    with pytest.raises(BatchUsageError, match="with artifact aaaaaaaaaaaa"):
        Checkpoint.open(output, JOB, resume=True).bind_artifact("b" * 64, "query: ")
    # A checkpoint from before prompts were recorded: its rows had none.
    state = json.loads((checkpoint_dir(output) / STATE).read_text())
    del state["prompt"]
    (checkpoint_dir(output) / STATE).write_text(json.dumps(state))
    Checkpoint.open(output, JOB, resume=True).bind_artifact("a" * 64, "")
    with pytest.raises(BatchUsageError, match="with the prompt ''"):
        Checkpoint.open(output, JOB, resume=True).bind_artifact("a" * 64, "query: ")
