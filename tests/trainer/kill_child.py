"""``python tests/trainer/kill_child.py MODE STEP TRAINER_ARGS...``: run the trainer, but stop
one save of run 't' at a chosen point and print a ``KILL-POINT`` line, so that a test can
SIGKILL the process exactly there (tests/trainer/test_exactly_once.py).

MODE ``after_commit``: step STEP's checkpoint is committed (training goes on meanwhile).
MODE ``during_save``: step STEP's objects are uploaded and its row is pending, not committed.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from ckptstore.checkpointer import commit

MODE, STEP = sys.argv[1], int(sys.argv[2])
RUN = "t"
_run_save, _commit = commit.run_save, commit.commit


def _pause(what: str) -> None:
    print(f"KILL-POINT step {STEP}: {what}", flush=True)
    threading.Event().wait()  # until the test kills the process


def run_save(writer: Any, request: Any) -> Any:
    info = _run_save(writer, request)
    if writer.name == RUN and request.step == STEP:
        _pause("committed")
    return info


def commit_save(writer: Any, checkpoint_id: int, request: Any, receipts: Any) -> Any:
    if writer.name == RUN and request.step == STEP:
        _pause("uploaded, pending, not committed")
    return _commit(writer, checkpoint_id, request, receipts)


if MODE == "after_commit":
    commit.run_save = run_save
elif MODE == "during_save":
    commit.commit = commit_save
else:
    raise SystemExit(f"unknown mode {MODE!r}")

from trainer.grpo import main  # noqa: E402

sys.exit(main(sys.argv[3:]))
