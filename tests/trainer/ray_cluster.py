"""A multi-node Ray cluster on one machine, and a trainer process a test can follow line by line
(tests/trainer/test_multinode.py).

:func:`local_cluster` starts ``ray.cluster_utils.Cluster``: a head node and worker nodes, each
its own raylet with its own resources, all in this process tree. Which node runs which actor is
read from the process tree, without the dashboard: an actor's worker process is a child of its
node's raylet, and Ray titles it ``ray::<Class>`` (``ray::<Class>.<method>`` while a call runs).

:class:`TrainerProcess` runs ``python -m trainer.grpo`` in a process group of its own and reads
its output on a thread, so a test waits for lines instead of sleeping and kills the whole group
when it is done.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

#: Seconds a trainer process may take to exit once it has been told to (or has failed).
EXIT_SECONDS = 120.0


@dataclass
class LocalCluster:
    """A running ``Cluster``: its head and its worker nodes (``ray._private.node.Node``)."""

    cluster: Any
    head: Any
    workers: list[Any]

    @property
    def address(self) -> str:
        return str(self.cluster.address)

    def titles(self, node: Any) -> list[str]:
        """The process titles of everything ``node``'s raylet runs (its workers and agents)."""
        raylet = node.all_processes["raylet"][0].process.pid
        titles = []
        for child in psutil.Process(raylet).children(recursive=True):
            with suppress(psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                titles.append(" ".join(child.cmdline()))
        return titles

    def actors(self, node: Any, cls: str) -> list[str]:
        """The titles of ``node``'s worker processes that hold an actor of class ``cls``."""
        return [t for t in self.titles(node) if re.match(rf"ray::{cls}(\.|\s|$)", t)]

    def hosting(self, cls: str) -> list[Any]:
        """Every live node with an actor of class ``cls`` (the head first)."""
        return [node for node in (self.head, *self.workers) if self.actors(node, cls)]

    def remove(self, node: Any) -> None:
        """Take ``node`` away as a lost machine does: everything on it stops at one instant
        and dies. ``remove_node`` alone kills the raylet and its agents but not the actors'
        worker processes, which go on (an upload finishes, a call returns) until they notice
        that their raylet is gone; so all of them are stopped first and killed after."""
        raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
        machine = [raylet, *raylet.children(recursive=True)]
        for process in machine:
            with suppress(psutil.NoSuchProcess):
                process.send_signal(signal.SIGSTOP)
        self.cluster.remove_node(node, allow_graceful=False)
        self.workers.remove(node)
        for process in machine:
            with suppress(psutil.NoSuchProcess):
                process.kill()
        psutil.wait_procs(machine, timeout=EXIT_SECONDS)

    def add(self, resources: dict[str, float], env: dict[str, str] | None = None) -> Any:
        """A new worker node (a spare that replaces a lost one), started and registered."""
        node = self.cluster.add_node(
            num_cpus=1, resources=dict(resources), **({"env_vars": env} if env else {})
        )
        self.cluster.wait_for_nodes()
        self.workers.append(node)
        return node


@contextmanager
def local_cluster(
    workers: int,
    worker_resources: dict[str, float],
    *,
    names: Sequence[str] | None = None,
) -> Iterator[LocalCluster]:
    """A head (no custom resources, so only the driver's actors go there unless placed) and
    ``workers`` worker nodes with ``worker_resources`` each; shut down afterwards, whatever
    happened. Ray reads its settings (RAY_TMPDIR, RAY_AUTH_MODE, ...) and its workers inherit
    PYTHONPATH and the S3 settings from this process's environment: set them first.

    ``names``: the nodes' names for node-local tiers (``$CKPTSTORE_NODE`` of every process on
    the node: all of them share one host name here), the head's first."""
    from ray.cluster_utils import Cluster

    def env(i: int) -> dict[str, Any]:
        return {"env_vars": {"CKPTSTORE_NODE": names[i]}} if names else {}

    head = {"num_cpus": 1, "include_dashboard": False, **env(0)}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        nodes = [
            cluster.add_node(num_cpus=1, resources=dict(worker_resources), **env(i + 1))
            for i in range(workers)
        ]
        cluster.wait_for_nodes()
        yield LocalCluster(cluster, cluster.head_node, nodes)
    finally:
        cluster.shutdown()


class TrainerProcess:
    """``python -m trainer.grpo ARGS`` with stdout and stderr merged, read line by line."""

    def __init__(self, args: Sequence[str], env: dict[str, str], cwd: Path) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "trainer.grpo", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=cwd,
            start_new_session=True,  # its own process group: killed as a whole
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._eof = False
        #: Lines before this index have been shown to a wait.
        self._cursor = 0
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def _poll(self, timeout: float) -> None:
        """Take the lines printed until ``timeout`` seconds pass without one."""
        wait = timeout
        while not self._eof:
            try:
                line = self._queue.get(timeout=wait)
            except queue.Empty:
                return
            if line is None:
                self._eof = True
                return
            self.lines.append(line)
            wait = 0.01

    def wait_until(self, done: Callable[[str | None], Any], what: str, timeout: float) -> Any:
        """Show ``done`` each line not yet shown (in order), and None whenever no line came
        for 0.2 s (so it may look at other state), until it returns something truthy; fails
        with the output so far when the process ends or ``timeout`` passes first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            while self._cursor < len(self.lines):
                self._cursor += 1
                found = done(self.lines[self._cursor - 1])
                if found:
                    return found
            if self._eof:
                self.popen.wait(EXIT_SECONDS)
                raise AssertionError(
                    f"the trainer exited ({self.popen.returncode}) before {what}:\n{self.output}"
                )
            found = done(None)
            if found:
                return found
            self._poll(0.2)
        raise AssertionError(f"no {what} within {timeout:.0f} s:\n{self.output}")

    def wait_for(self, pattern: str, timeout: float = 300.0) -> re.Match[str]:
        """The next line matching ``pattern`` (re.search)."""

        def match(line: str | None) -> re.Match[str] | None:
            return re.search(pattern, line) if line is not None else None

        found: re.Match[str] = self.wait_until(match, f"a line matching {pattern!r}", timeout)
        return found

    def finish(self, timeout: float = 300.0) -> int:
        """Read to the end and return the exit status."""
        deadline = time.monotonic() + timeout
        while not self._eof and time.monotonic() < deadline:
            self._poll(0.2)
        if not self._eof:
            raise AssertionError(f"the trainer did not exit within {timeout:.0f} s:\n{self.output}")
        return self.popen.wait(EXIT_SECONDS)

    def kill(self) -> None:
        """SIGKILL the trainer's process group if anything of it is left."""
        with suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(EXIT_SECONDS)
        self._reader.join(EXIT_SECONDS)
        if self.popen.stdout is not None:
            self.popen.stdout.close()


@contextmanager
def trainer_process(
    args: Sequence[str], env: dict[str, str], cwd: Path
) -> Iterator[TrainerProcess]:
    """A :class:`TrainerProcess`, its process group killed on the way out whatever happened."""
    process = TrainerProcess(args, env, cwd)
    try:
        yield process
    finally:
        process.kill()


def run_trainer(
    args: Sequence[str], env: dict[str, str], cwd: Path, timeout: float
) -> tuple[int, str]:
    """Run the trainer to the end: (exit status, output)."""
    with trainer_process(args, env, cwd) as process:
        code = process.finish(timeout)
        return code, process.output


@contextmanager
def paused(pid: int) -> Iterator[Callable[[], None]]:
    """SIGSTOP ``pid`` (a stalled server: its connections stay open and nothing answers); the
    block gets a function that resumes it, which also runs on the way out."""
    os.kill(pid, signal.SIGSTOP)
    resumed = False

    def resume() -> None:
        nonlocal resumed
        if not resumed:
            os.kill(pid, signal.SIGCONT)
            resumed = True

    try:
        yield resume
    finally:
        with suppress(ProcessLookupError):
            resume()
