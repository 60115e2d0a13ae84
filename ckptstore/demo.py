"""The main job until the trainer lands: save a small model's state through the store, reload it
from a fresh read of the store, and check it bit for bit.

Run with ``python -m ckptstore.demo [--store DIR]``; the default store is ``./.ckptstore/``.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from ckptstore.cas import BlobWriter, WriterOptions
from ckptstore.objectstore import open_store
from ckptstore.serialize import load_component, write_component
from ckptstore.serialize.compare import first_difference


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 512, dim: int = 256, layers: int = 4, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.blocks(self.embed(tokens)))
        return out


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, object]:
    return {
        "policy": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "training_info": {"current_step": step, "seed": 0},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ckptstore.demo", description=__doc__)
    parser.add_argument("--store", default=".ckptstore/store", help="store URL or directory")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = TinyTransformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 512, (8, 32))
    for _ in range(3):
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    state = _state(model, optimizer, 3)

    store = open_store(args.store)
    with BlobWriter(store, WriterOptions()) as writer:
        t0 = time.perf_counter()
        first = write_component(writer, state)
        t1 = time.perf_counter()
        second = write_component(writer, state)
    t2 = time.perf_counter()
    loaded = load_component(open_store(args.store), first.index_digest)
    t3 = time.perf_counter()
    difference = first_difference(state, loaded)
    if difference:
        print(f"FAILED: the reloaded state differs from the saved one at {difference}")
        return 1
    mib = 1 << 20
    print(f"store:   {store.url}")
    print(f"index:   {first.index_digest}")
    print(
        f"saved:   {first.entries} entries, {first.logical_bytes / mib:.1f} MiB logical, "
        f"{first.stored_bytes / mib:.1f} MiB stored in {len(first.blobs)} blobs, "
        f"{first.uploaded_bytes / mib:.1f} MiB uploaded now, {t1 - t0:.2f}s"
    )
    print(
        f"again:   same state saved twice -> {second.uploaded_bytes} bytes uploaded "
        f"(deduplicated), {t2 - t1:.2f}s"
    )
    print(f"loaded:  verified every blob's BLAKE3 digest, {t3 - t2:.2f}s")
    print("result:  bit-exact round trip of weights, AdamW state and training info")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
