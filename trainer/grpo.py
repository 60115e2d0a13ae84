"""``python -m trainer.grpo [--config FILE.yaml] [dotted.key=value ...]``: train and resume.

Re-running the same command resumes from the newest committed checkpoint of
``checkpointing.run_name``. With the defaults it uses the embedded store (``./.ckptstore/``:
SQLite + a local directory), or ``$CKPTSTORE_DB`` / ``$CKPTSTORE_STORE``.
"""

from __future__ import annotations

import time

PROCESS_START = time.time()  # checkpoint_must_save_by and the progress lines count from here

import argparse  # noqa: E402
import asyncio  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

from trainer.failures import error_line, exit_code, known_error  # noqa: E402
from trainer.progress import progress_line, wanted  # noqa: E402

if TYPE_CHECKING:
    from trainer.config import TrainerConfig

EPILOG = """\
examples:
  python -m trainer.grpo                                  # train (or resume) the demo run
  python -m trainer.grpo grpo.max_num_steps=60 checkpointing.save_period=10
  python -m trainer.grpo --config my.yaml checkpointing.checkpoint_must_save_by=00:03:30:00
  python -m trainer.grpo backend=local                    # no Ray: everything in this process
  python -m trainer.grpo policy.num_workers=2             # policy sharded over 2 Ray workers
  python -m trainer.grpo policy.num_workers=4 policy.replicas=2   # 2 replicas x 2 FSDP2 shards

Config names follow DESIGN.md §9.1 (see trainer/config.py for every key and its default).
checkpoint_must_save_by takes DD:HH:MM:SS counted from process start, or an absolute
ISO-8601 time; it is never overrun: when the time left cannot hold another step and a save,
the trainer saves what it has not saved yet, says so and exits 0 (also before its first step).
checkpointing.stop_after_steps=N trains N steps per start, however long start-up takes.

exit status: 0 finished or stopped early; 1 a failure at run time (a save, the store or the
database failing, a stall, a lost worker, anything unexpected; re-run to resume); 2 fix the
configuration or the run first (a bad key, a refused resume, a store or database URL that
ckptstore cannot use, a database to upgrade). Either way one error: line on stderr;
--traceback adds the traceback.
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.grpo",
        description="Asynchronous GRPO on Ray that checkpoints through ckptstore and resumes "
        "exactly where it stopped.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="a YAML file with config overrides")
    parser.add_argument(
        "--progress",
        action="store_true",
        help="print start-up progress lines on stderr (the default when stderr is a terminal)",
    )
    parser.add_argument(
        "--traceback",
        action="store_true",
        help="print the traceback of a failure before its error: line",
    )
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    return parser.parse_args(argv)


def resolve_locations(cfg: TrainerConfig) -> None:
    """Absolute store/db/trace locations: the actors may not share the driver's working
    directory."""
    from ckptstore.extending import default_db, default_store

    ck = cfg.checkpointing
    ck.db = ck.db or default_db()
    ck.store = ck.store or default_store()
    if "://" not in ck.db:
        ck.db = str(Path(ck.db).resolve())
        if ck.enabled:
            Path(ck.db).parent.mkdir(parents=True, exist_ok=True)
    if "://" not in ck.store:
        ck.store = str(Path(ck.store).resolve())
    if cfg.logger.prompt_trace is not None:
        cfg.logger.prompt_trace = str(Path(cfg.logger.prompt_trace).resolve())


def _show(output: tuple[list[str], list[str]], progress: bool) -> None:
    """Print the controller's lines on stdout and, when wanted, its progress lines on stderr."""
    lines, phases = output
    if progress:  # first: a phase line was queued before the lines that follow it
        for line in phases:
            print(line, file=sys.stderr, flush=True)
    for line in lines:
        print(line, flush=True)


async def _drive_local(controller: Any, progress: bool) -> dict[str, Any]:
    task = asyncio.create_task(controller.run_training())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.2)
            _show(controller.drain_all(), progress)
    finally:
        _show(controller.drain_all(), progress)
    return task.result()  # type: ignore[no-any-return]


def _drive_ray(cfg: TrainerConfig, progress: bool) -> dict[str, Any]:
    if progress:
        where = f"the Ray cluster at {cfg.ray_address}" if cfg.ray_address else "a local cluster"
        print(progress_line(PROCESS_START, f"starting Ray ({where})"), file=sys.stderr)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from trainer.controller import Controller

    temp_dir: str | None = None
    if cfg.ray_address:
        # Join a running cluster (its nodes hold the policy workers); the driver only connects.
        ray.init(address=cfg.ray_address, logging_level=logging.ERROR, configure_logging=True)
    else:
        temp_dir = tempfile.mkdtemp(prefix="ray-")
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            _temp_dir=temp_dir,
            logging_level=logging.ERROR,
            configure_logging=True,
        )
    if progress:
        print(progress_line(PROCESS_START, "Ray is up; starting the controller"), file=sys.stderr)
    try:
        # Any: Ray's actor handles are typed as the class, whose methods have no .remote.
        # The controller runs on the driver's node: losing another node must not take it.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        controller: Any = (
            ray.remote(num_cpus=0)(Controller)
            .options(scheduling_strategy=here)
            .remote(cfg, PROCESS_START)
        )
        done = controller.run_training.remote()
        while True:
            ready, _ = ray.wait([done], timeout=0.2)
            _show(ray.get(controller.drain_all.remote()), progress)
            if ready:
                return ray.get(done)  # type: ignore[no-any-return]
    finally:
        ray.shutdown()
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """Train (or resume); the exit status: 0 done or stopped early, 2 fix the config or the
    run, 1 a failure at run time (see :func:`trainer.failures.exit_code`)."""
    args = parse_args(argv)
    progress = wanted(args.progress)
    if progress:
        print(progress_line(PROCESS_START, "loading torch and the config"), file=sys.stderr)
    from trainer.config import load_config
    from trainer.controller import Controller

    try:
        cfg = load_config(args.config, args.overrides)
        resolve_locations(cfg)
        if cfg.backend == "local":
            summary = asyncio.run(_drive_local(Controller(cfg, PROCESS_START), progress))
        else:
            summary = _drive_ray(cfg, progress)
    except Exception as exc:
        if args.traceback:
            traceback.print_exception(exc)
        known = known_error(exc)
        print(f"error: {error_line(exc, known)}", file=sys.stderr, flush=True)
        return exit_code(known)
    if not summary["workers_started"]:  # the time budget ran out during start-up
        print(f"stopped early: run {summary['run']!r} stays at step {summary['train_steps']}")
    else:
        state = "stopped early" if summary["stopped_early"] else "finished"
        print(
            f"{state}: run {summary['run']!r} at step {summary['train_steps']} "
            f"({summary['consumed_samples']} prompts, {summary['consumed_generations']} samples)"
        )
    if summary["db"] is not None:
        print("\n".join(where_lines(summary)))
    return 0


def where_lines(summary: dict[str, Any]) -> list[str]:
    """What this process saved, what the run keeps, where it is and how to look at it."""
    saved, kept = summary["saved_steps"], summary["kept_steps"]
    run, db, store = summary["run"], summary["db"], summary["store"]
    if not saved:
        shown = "no checkpoint"
    elif len(saved) <= 10:
        shown = f"steps {saved}"
    else:
        shown = f"{len(saved)} checkpoints (steps {saved[0]}..{saved[-1]})"
    lines = [
        f"this process saved {shown}; the run keeps "
        + ("what it kept before" if kept is None else f"steps {kept}")
        + " (retention: checkpointing.keep_top_k, keep_latest_k)",
        f"the run is in the store {store} and the manifest database {db}; to look at it:",
    ]
    command = _cli_command(db, store)
    lines += [
        f"  {command} runs",
        f"  {command} ls {shlex.quote(run)}",
        f"  {command} serve    (a web view at http://127.0.0.1:8000)",
    ]
    return lines


def _cli_command(db: str, store: str) -> str:
    """The ``ckptstore`` command of this environment, with --db/--store unless they are the
    defaults it would use anyway."""
    from ckptstore.extending import default_db, default_store

    cli = Path(sys.executable).with_name("ckptstore")
    command = "ckptstore"
    if cli.exists():
        cwd = Path.cwd()
        command = str(cli.relative_to(cwd)) if cli.is_relative_to(cwd) else str(cli)
    if _resolved(db) != _resolved(default_db()) or _resolved(store) != _resolved(default_store()):
        command += f" --db {shlex.quote(db)} --store {shlex.quote(store)}"
    return command


def _resolved(location: str) -> str:
    return location if "://" in location else str(Path(location).resolve())


if __name__ == "__main__":
    sys.exit(main())
