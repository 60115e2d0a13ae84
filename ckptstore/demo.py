"""The plain-state-dict example (`python -m ckptstore.demo`): a small transformer trains for a
few steps and checkpoints each one through ckptstore; re-running resumes from the newest
committed checkpoint, which is checked bit for bit against what was saved.

Run with ``.venv/bin/python -m ckptstore.demo [--db PATH] [--store DIR] [--steps N]``; the
defaults are the embedded store under ``./.ckptstore/``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch
from torch import nn

from ckptstore.checkpointer import RetentionPolicy, open_run
from ckptstore.serialize.compare import first_difference
from ckptstore.settings import default_db, default_store

MiB = 1 << 20


class TinyTransformer(nn.Module):
    """A small causal transformer for the example."""

    def __init__(self, vocab: int = 512, dim: int = 256, layers: int = 4, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits for a batch of token ids."""
        out: torch.Tensor = self.head(self.blocks(self.embed(tokens)))
        return out


def main(argv: list[str] | None = None) -> int:
    """Train, checkpoint every step, and resume where the last run stopped."""
    parser = argparse.ArgumentParser(prog="python -m ckptstore.demo", description=__doc__)
    parser.add_argument("--db", default=None, help="manifest database (default ./.ckptstore)")
    parser.add_argument("--store", default=None, help="store URL or directory")
    parser.add_argument("--run", default="demo", help="run name")
    parser.add_argument("--steps", type=int, default=6, help="train steps per invocation")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = TinyTransformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 512, (8, 32), generator=torch.Generator().manual_seed(1))
    retention = RetentionPolicy(keep_top_k=3, metric_name="train:loss", higher_is_better=False)
    db, store = args.db or default_db(), args.store or default_store()
    with open_run(args.run, db=db, store=store, retention=retention) as run:
        start = 0
        resumed = run.latest()
        if resumed is not None:
            ckpt = run.load()
            model.load_state_dict(ckpt.state["policy"])
            optimizer.load_state_dict(ckpt.state["optimizer"])
            start = ckpt.state["training_info"]["current_step"]
            print(f"resumed run {args.run!r} from step {start} (newest committed checkpoint)")
        else:
            print(f"new run {args.run!r} in {run.store.url}")
        saved: dict[str, object] = {}
        for step in range(start + 1, start + args.steps + 1):
            loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            saved = {
                "policy": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "training_info": {"current_step": step, "seed": 0},
            }
            handle = run.save(step, saved, metrics={"train:loss": loss.item()}, trigger="period")
            info = handle.wait()
            print(
                f"step {step:3d}  loss {loss.item():.4f}  saved {info.logical_bytes / MiB:5.1f} "
                f"MiB, uploaded {info.uploaded_bytes / MiB:5.1f} MiB, deduplicated "
                f"{info.deduplicated_bytes / MiB:5.1f} MiB, training blocked "
                f"{handle.blocked_seconds * 1000:.1f} ms"
            )
        t0 = time.perf_counter()
        again = run.load()
        seconds = time.perf_counter() - t0
        names = sorted(saved)
        difference = first_difference(
            {k: saved[k] for k in names}, {k: again.state[k] for k in names}
        )
        if difference:
            print(f"FAILED: the reloaded checkpoint differs from the saved state at {difference}")
            return 1
        kept = [c.step for c in run.checkpoints(["committed"])]
        print(
            f"reloaded step {again.info.step} from a fresh read of the store in {seconds:.2f}s, "
            "every blob's BLAKE3 digest verified: bit-exact (weights, AdamW state, training info)"
        )
        print(f"retention keeps the 3 lowest-loss checkpoints plus the latest: steps {kept}")
        cli = cli_command(args.db, args.store)
        print(
            f"run it again to resume; inspect with `{cli} runs`, `{cli} ls {shlex.quote(args.run)}`"
        )
    return 0


def cli_command(db: str | None, store: str | None) -> str:
    """The ``ckptstore`` command of this environment (``.venv/bin/ckptstore`` beside this
    Python, relative to the working directory where it can be), with --db/--store if given."""
    cli = Path(sys.executable).with_name("ckptstore")
    command = "ckptstore"
    if cli.exists():
        cwd = Path.cwd()
        command = str(cli.relative_to(cwd)) if cli.is_relative_to(cwd) else str(cli)
    for option, value in (("--db", db), ("--store", store)):
        if value is not None:
            command += f" {option} {shlex.quote(value)}"
    return command


if __name__ == "__main__":
    raise SystemExit(main())
