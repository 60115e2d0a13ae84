"""``ckptstore import`` over mutated torch DCP directories and Hugging Face safetensors folders.

Seeds (written once by the real writers): a DCP ``FileSystemWriter`` directory (tensors of two
dtypes in several files, a plain value), a single ``.safetensors`` file, and a sharded folder
(``model.safetensors.index.json``, two shards, ``config.json``). Each case copies one seed and
damages it: DCP ``.metadata`` re-pickled with forged storage ranges (up to 2^63), paths
(``..``, absolute, empty, not a string), sizes, chunks, dtypes and stream transforms, or its
bytes damaged, or a pickle that calls ``os.system``; ``.distcp`` files truncated, flipped,
extended, replaced by symlinks (outside the folder, to ``/dev/zero``, a directory, nowhere);
safetensors headers mutated as JSON (:class:`fuzz.jsonmut.JsonMutator`: dtype names, shapes,
``data_offsets``, extra keys) or their length prefix forged; index files and ``weight_map``
mutated the same way, pointing outside, at symlinks or at missing shards.

Each case runs the CLI's ``main()`` in this process (a real ``ckptstore`` subprocess for every
``sample``-th case, whose exit status must agree). The oracle:

- exit 0, 2 or 3; never 1 (verify's "problems found"), never an exception out of ``main``;
- on failure, stderr is exactly one ``ckptstore: error:`` line;
- on success, the checkpoint loads back (``ckptstore.integrations.dcp.load``) equal to what an
  independent reader says the files hold (``safetensors.torch.load_file``; torch's own DCP
  ``FileSystemReader``, only for a ``.metadata`` that the import's allowlist admitted);
- nothing outside the run's store and database is written (every other file under the work
  folder is listed before and after, and the command's working directory stays empty);
- the ``os.system`` pickle never runs.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import random
import shutil
import struct
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from fuzz.jsonmut import HOSTILE_VALUES, JsonMutator
from fuzz.surfaces import Finding

#: The CLI's documented exit codes an import may end with (1 is verify's "problems found").
ALLOWED_EXITS = {0: "imported", 2: "refused exit 2", 3: "refused exit 3"}
HUGE = (0, 1, 7, 2**31, 2**32, 2**34, 2**40, 2**62, 2**63 - 1, 2**63, 2**64, -1, -(2**63))
SAFETENSORS_DTYPES = (
    "F32", "F16", "BF16", "F64", "I64", "I32", "I16", "I8", "U8", "U16", "U32", "U64", "BOOL",
    "F8_E4M3", "F8_E5M2", "C64", "F4", "X", "f32", "", "F32 ",
)  # fmt: skip


def _tensors(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "embed.weight": torch.randn(8, 6, generator=gen),
        "layers.0.w": torch.randn(6, 6, generator=gen).to(torch.bfloat16),
        "layers.0.b": torch.arange(6, dtype=torch.int64),
        "norm": torch.randn(5, generator=gen).to(torch.float16),
    }


def _safetensors_header(path: Path) -> tuple[str, bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack_from("<Q", data, 0)
    return data[8 : 8 + n].decode(), data[8 + n :]


def write_seeds(root: Path, seed: int) -> dict[str, Path]:
    """The seed sources under ``root``: ``dcp``, ``single`` (a file), ``sharded`` (a folder)."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    t = _tensors(gen)
    seeds = {"dcp": root / "dcp", "single": root / "single", "sharded": root / "sharded"}
    state = {"model": {k: v.clone() for k, v in t.items()}, "step": 7, "note": "seed"}
    with contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(seeds["dcp"])), no_dist=True)
    seeds["single"].mkdir()
    save_file(t, str(seeds["single"] / "model.safetensors"))
    sharded = seeds["sharded"]
    sharded.mkdir()
    names = sorted(t)
    shards = {
        "model-00001-of-00002.safetensors": names[:2],
        "model-00002-of-00002.safetensors": names[2:],
    }
    for shard, keys in shards.items():
        save_file({k: t[k] for k in keys}, str(sharded / shard))
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    index = {
        "metadata": {"total_size": sum(v.nbytes for v in t.values())},
        "weight_map": weight_map,
    }
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (sharded / "config.json").write_text(json.dumps({"model_type": "fuzz", "hidden_size": 6}))
    return seeds


# -- mutations ----------------------------------------------------------------------------------


class Mutator:
    """Damages a copy of a seed in place; records what it did in ``self.tags``."""

    def __init__(
        self, rng: random.Random, outside: Path, pwned: Path, seed_metadata: bytes
    ) -> None:
        self.rng = rng
        self.seed_metadata = seed_metadata
        self.outside = outside
        self.pwned = pwned
        self.tags: list[str] = []

    def bytes_of(self, path: Path) -> None:
        """Flip, overwrite, truncate or extend one file."""
        rng = self.rng
        if path.is_symlink():  # an earlier mutation made it a link (perhaps to itself)
            return
        data = bytearray(path.read_bytes())
        choice = rng.randrange(4)
        if choice == 0 and data:
            at = rng.randrange(len(data))
            data[at] ^= 1 << rng.randrange(8)
        elif choice == 1 and data:
            at = rng.randrange(len(data))
            data[at] = rng.choice((0, 0xFF, 0x7F, rng.randrange(256)))
        elif choice == 2:
            del data[rng.randrange(len(data) + 1) :]
        else:
            data += rng.randbytes(rng.choice((1, 8, 100, 4096)))
        path.write_bytes(bytes(data))
        self.tags.append(f"bytes:{path.name}:{choice}")

    def link(self, path: Path) -> None:
        """Replace ``path`` by a symlink: outside the folder, /dev/zero, a directory, nowhere."""
        rng = self.rng
        target = rng.choice(("outside", "/dev/zero", "dir", "nowhere", "self"))
        copy = self.outside / f"copy-{path.name}"
        if target == "outside" and path.exists():
            shutil.copyfile(path, copy)
        path.unlink(missing_ok=True)
        where = {
            "outside": copy,
            "/dev/zero": Path("/dev/zero"),
            "dir": self.outside,
            "nowhere": self.outside / "missing",
            "self": path,
        }[target]
        path.symlink_to(where)
        self.tags.append(f"link:{path.name}->{target}")

    # -- DCP ----------------------------------------------------------------------------------

    def dcp(self, folder: Path) -> None:
        """One to three damages of a DCP directory."""
        rng = self.rng
        for _ in range(rng.choice((1, 1, 2, 3))):
            files = sorted(folder.glob("*.distcp"))
            choice = rng.randrange(10)
            if choice < 5:
                self._metadata(folder / ".metadata")
            elif choice == 5:
                self.bytes_of(folder / ".metadata")
            elif choice == 6:
                self._evil_pickle(folder / ".metadata")
            elif choice in (7, 8) and files:
                self.bytes_of(rng.choice(files))
            elif files:
                self.link(rng.choice(files))

    def _evil_pickle(self, path: Path) -> None:
        class Evil:
            def __reduce__(self_inner) -> Any:
                return (os.system, (f"touch {self.pwned}",))

        path.write_bytes(pickle.dumps(Evil()))
        self.tags.append("metadata:os.system")

    def _metadata(self, path: Path) -> None:
        """Re-pickle the seed's own metadata with one field forged (the seed file is ours:
        it is unpickled here, never a mutant)."""
        from torch.distributed.checkpoint.metadata import (
            BytesStorageMetadata,
            ChunkStorageMetadata,
            TensorProperties,
            TensorStorageMetadata,
        )

        rng = self.rng
        if path.read_bytes() != self.seed_metadata:  # an earlier mutation damaged it
            return self.bytes_of(path)
        meta = pickle.loads(self.seed_metadata)  # the seed's, never a mutant
        storage = meta.storage_data
        entries = meta.state_dict_metadata
        key = rng.choice(sorted(storage, key=repr))
        info = storage[key]
        fqn = rng.choice(sorted(entries))
        md = entries[fqn]
        choice = rng.randrange(9)
        if choice == 0:
            info.offset = rng.choice((*HUGE, info.offset + 1, info.offset - 1))
        elif choice == 1:
            info.length = rng.choice((*HUGE, info.length + 1, info.length - 1))
        elif choice == 2:
            info.relative_path = rng.choice(
                ("../outside.distcp", "/etc/passwd", "", ".", "..", "a/b", 7, None, "missing")
            )
        elif choice == 3:
            info.transform_descriptors = rng.choice((["zstd"], ["x"] * 3, "s", None))
        elif choice == 4 and isinstance(md, TensorStorageMetadata):
            size = list(md.size)
            if size:
                size[rng.randrange(len(size))] = rng.choice((0, 1, 2**31, 2**62, -1, 3))
            md.size = torch.Size([s for s in size if s >= 0]) if rng.random() < 0.5 else size
        elif choice == 5 and isinstance(md, TensorStorageMetadata) and md.chunks:
            chunk = rng.choice(md.chunks)
            sizes, offsets = list(chunk.sizes), list(chunk.offsets)
            if sizes:
                k = rng.randrange(len(sizes))
                sizes[k] = rng.choice((0, 1, sizes[k] + 1, 2**40))
                offsets[k] = rng.choice((0, offsets[k], offsets[k] + 1, 2**40))
            md.chunks = [*md.chunks, ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))]
            if rng.random() < 0.5:
                md.chunks = md.chunks[-1:]
        elif choice == 6 and isinstance(md, TensorStorageMetadata):
            md.properties = TensorProperties(
                dtype=rng.choice((torch.float64, torch.int8, torch.complex64, torch.bool, None))
            )
        elif choice == 7:
            if rng.random() < 0.5:
                del entries[fqn]
            else:
                entries[rng.choice(("extra", fqn + ".x"))] = rng.choice(
                    (
                        BytesStorageMetadata(),
                        TensorStorageMetadata(TensorProperties(), torch.Size([2]), []),
                    )
                )
        else:
            del storage[key]
        path.write_bytes(pickle.dumps(meta))
        self.tags.append(f"metadata:{choice}")
        return None

    # -- safetensors --------------------------------------------------------------------------

    def safetensors(self, folder: Path, seed: int) -> None:
        """One to three damages of a safetensors folder."""
        rng = self.rng
        for _ in range(rng.choice((1, 1, 2, 3))):
            files = sorted(p for p in folder.glob("*.safetensors") if not p.is_symlink())
            index = folder / "model.safetensors.index.json"
            choice = rng.randrange(10)
            if choice < 4 and files:
                self._header(rng.choice(files), seed)
            elif choice == 4 and files:
                self._length_prefix(rng.choice(files))
            elif choice == 5 and files:
                self.bytes_of(rng.choice(files))
            elif choice in (6, 7) and index.exists():
                self._index(index, seed)
            elif choice == 8 and files:
                self.link(rng.choice(files))
            elif files:
                self._dtype(rng.choice(files))

    def _rewrite(self, path: Path, header: str, data: bytes) -> None:
        raw = header.encode("utf-8", "surrogatepass")
        path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)

    def _header(self, path: Path, seed: int) -> None:
        try:
            header, data = _safetensors_header(path)
            json.loads(header)
        except (ValueError, struct.error):  # an earlier mutation damaged it
            return self.bytes_of(path)
        self._rewrite(path, JsonMutator([header], seed ^ self.rng.getrandbits(32))(), data)
        self.tags.append(f"header:{path.name}")
        return None

    def _dtype(self, path: Path) -> None:
        rng = self.rng
        try:
            header, data = _safetensors_header(path)
            doc = json.loads(header)
            assert isinstance(doc, dict)
            assert all(isinstance(v, dict) for v in doc.values())
        except (ValueError, struct.error, AssertionError):  # an earlier mutation damaged it
            return self.bytes_of(path)
        name = rng.choice(sorted(k for k in doc if k != "__metadata__"))
        field = rng.choice(("dtype", "shape", "data_offsets"))
        if field == "dtype":
            doc[name]["dtype"] = rng.choice(SAFETENSORS_DTYPES)
        elif field == "shape":
            doc[name]["shape"] = rng.choice(([], [0], [2**40], [-1], [2**62, 2**62], [3, 3, 3]))
        else:
            offsets = doc[name].get("data_offsets")
            if not (isinstance(offsets, list) and len(offsets) == 2):  # an earlier mutation
                return self.bytes_of(path)
            a, b = offsets
            doc[name]["data_offsets"] = rng.choice(
                (
                    [b, a],
                    [a, b + 1],
                    [a, 2**63],
                    [0, 0],
                    [a + 1, b + 1],
                    [-1, b],
                    [a, len(data) + 8],
                )
            )
        self._rewrite(path, json.dumps(doc), data)
        self.tags.append(f"{field}:{path.name}")
        return None

    def _length_prefix(self, path: Path) -> None:
        data = bytearray(path.read_bytes())
        (n,) = struct.unpack_from("<Q", data, 0)
        value = self.rng.choice(
            (0, 1, n - 1, n + 1, len(data), 2**32, 2**63, 2**64 - 1, 100_000_001)
        )
        struct.pack_into("<Q", data, 0, value)
        path.write_bytes(bytes(data))
        self.tags.append(f"prefix:{value}")

    def _index(self, index: Path, seed: int) -> None:
        rng = self.rng
        if rng.random() < 0.5:
            try:
                mutator = JsonMutator([index.read_text()], seed ^ rng.getrandbits(32))
            except ValueError:  # an earlier mutation damaged it
                return self.bytes_of(index)
            # A lone surrogate is written as its UTF-8-like bytes: invalid UTF-8 is an input too.
            index.write_bytes(mutator().encode("utf-8", "surrogatepass"))
            self.tags.append("index:json")
            return None
        try:
            doc = json.loads(index.read_text())
            weight_map = doc.get("weight_map")
        except (ValueError, AttributeError):
            return None
        if not isinstance(weight_map, dict) or not weight_map:
            return None
        name = rng.choice(sorted(weight_map))
        weight_map[name] = rng.choice(
            (
                "../outside.safetensors",
                "/etc/passwd",
                "missing.safetensors",
                "config.json",
                "model.safetensors.index.json",
                rng.choice(sorted(set(map(str, weight_map.values())))),
                rng.choice(HOSTILE_VALUES),
            )
        )
        if rng.random() < 0.3:
            weight_map[rng.choice(("extra", "", "../x", "\x1b[31m"))] = weight_map[name]
        index.write_text(json.dumps(doc))
        self.tags.append(f"weight_map:{weight_map[name]!r}")
        return None


def _shards(source: Path) -> dict[Path, list[str] | None]:
    """The files a safetensors source names and the tensors each holds (None: all), as the
    Hugging Face layout defines them: the file itself, the index's ``weight_map``, or the
    folder's one file."""
    if source.is_file():
        return {source: None}
    index = source / "model.safetensors.index.json"
    if not index.exists():
        (only,) = source.glob("*.safetensors")
        return {only: None}
    out: dict[Path, list[str] | None] = {}
    for name, shard in json.loads(index.read_text())["weight_map"].items():
        names = out.setdefault(source / shard, [])
        assert names is not None
        names.append(name)
    return out


# -- the oracle ---------------------------------------------------------------------------------


def listing(root: Path, skip: set[Path]) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` but ``skip`` -> (size, mtime_ns), symlinks not followed."""
    out: dict[str, tuple[int, int]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if here / d not in skip]
        for name in [*filenames, *dirnames]:
            path = here / name
            if path in skip:
                continue
            st = path.lstat()
            out[str(path.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out


class ImportEngine:
    """Seeds, a store and database every case imports into, and the per-case oracle."""

    time_cap = 30.0

    def __init__(self, workdir: Path, seed: int, *, sample: int = 50) -> None:
        from ckptstore.checkpointer import open_run

        self.seed, self.sample, self.work = seed, sample, workdir
        self.seeds = write_seeds(workdir / "seeds", seed)
        self.db = f"sqlite:///{workdir / 'manifest.db'}"
        self.store = workdir / "store"
        self.outside = workdir / "outside"
        self.outside.mkdir()
        (self.outside / "outside.safetensors").write_bytes(
            (self.seeds["single"] / "model.safetensors").read_bytes()
        )
        self.cwd = workdir / "cwd"
        self.cwd.mkdir()
        self.pwned = workdir / "PWNED"
        self.seed_metadata = (self.seeds["dcp"] / ".metadata").read_bytes()
        open_run("imported", db=self.db, store=self.store, async_save=False).close()
        self._last: dict[str, Any] = {}

    def close(self) -> None:
        """Nothing to close (each import opens and closes its run)."""

    def reproducer(self, i: int) -> dict[str, Any]:
        """The seed and what was done to it (the case regenerates from (seed, i))."""
        return {"seed": self.seed, **self._last}

    def _source(self, i: int) -> tuple[Path, Path, str]:
        rng = random.Random(f"{self.seed}/{i}")
        kind = rng.choice(("dcp", "dcp", "single", "sharded", "sharded"))
        case = self.work / "case"
        shutil.rmtree(case, ignore_errors=True)
        for stale in self.outside.glob("copy-*"):
            stale.unlink()
        shutil.copytree(self.seeds[kind], case, symlinks=True)
        self.pwned.unlink(missing_ok=True)
        mutate = Mutator(rng, self.outside, self.pwned, self.seed_metadata)
        if kind == "dcp":
            mutate.dcp(case)
            source = case
        else:
            mutate.safetensors(case, rng.getrandbits(32))
            source = case / "model.safetensors" if kind == "single" and rng.random() < 0.5 else case
        self._last = {"kind": kind, "tags": mutate.tags, "source": str(source)}
        return case, source, kind

    def _main(self, argv: list[str]) -> tuple[int, str, str]:
        from ckptstore.cli.main import main

        out, err = io.StringIO(), io.StringIO()
        previous = os.getcwd()
        os.chdir(self.cwd)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    rc = main(argv)
                except SystemExit as exc:
                    rc = exc.code if isinstance(exc.code, int) else 2
                except MemoryError as exc:
                    raise Finding("memory", f"MemoryError out of main: {exc}") from None
                except Exception as exc:
                    text = f"{type(exc).__name__}: {exc}"[:1500]
                    raise Finding(
                        "traceback", f"{text}\nstderr: {err.getvalue()[-1500:]}"
                    ) from None
        finally:
            os.chdir(previous)
        return rc, out.getvalue(), err.getvalue()

    def case(self, i: int) -> str:
        """Import one mutated source; check the outcome."""
        _, source, kind = self._source(i)
        skip = {self.store, self.work / "manifest.db", self.work / "manifest.db-wal",
                self.work / "manifest.db-shm", self.work / "manifest.db-journal"}  # fmt: skip
        before = listing(self.work, skip)
        argv = [
            "--db",
            self.db,
            "--store",
            str(self.store),
            "import",
            str(source),
            f"imported@{i + 1}",
        ]
        rc, _, err = self._main(argv)
        if self.pwned.exists():
            raise Finding("code-executed", "the os.system pickle ran")
        if rc not in ALLOWED_EXITS:
            raise Finding(f"exit-{rc}", err[-2000:])
        after = listing(self.work, skip)
        if before != after:
            changed = sorted(set(before.items()) ^ set(after.items()))[:5]
            raise Finding("wrote-outside", f"files outside the store changed: {changed}")
        if rc:
            lines = err.splitlines()
            if len(lines) != 1 or not lines[0].startswith("ckptstore: error: "):
                raise Finding("not-one-error-line", err[-2000:])
        else:
            outcome = self._check_loaded(source, kind, i + 1)
        if self.sample and i % self.sample == 0:
            self._subprocess([*argv[:-1], f"imported@{10**9 + i}"], rc, err)
        return ALLOWED_EXITS[rc] if rc else outcome

    def _subprocess(self, argv: list[str], rc: int, err: str) -> None:
        done = subprocess.run(
            [sys.executable, "-m", "ckptstore", *argv],
            cwd=self.cwd,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if done.returncode != rc:
            raise Finding(
                "subprocess-disagrees",
                f"in-process exit {rc} ({err.strip()[:300]}); subprocess exit {done.returncode} "
                f"({done.stderr.strip()[-800:]})",
            )

    # -- what the files say -------------------------------------------------------------------

    def _check_loaded(self, source: Path, kind: str, step: int) -> str:
        from ckptstore.checkpointer import open_run

        expected = self._expected(source, kind)
        if expected is None:
            return "imported (torch's own reader refuses the source)"
        state = {
            k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None
            for k, v in expected.items()
        }
        from ckptstore.integrations import dcp as ckpt_dcp

        with open_run("imported", db=self.db, store=self.store, writable=False) as run:
            ckpt_dcp.load(state, run, step)
        for name, value in expected.items():
            got = state.get(name)
            if isinstance(value, torch.Tensor):
                same = (
                    isinstance(got, torch.Tensor)
                    and got.dtype == value.dtype
                    and got.shape == value.shape
                    and torch.equal(
                        got.view(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)
                    )
                )
            else:
                same = got == value
            if not same:
                raise Finding(
                    "loaded-differs", f"{name!r}: stored {got!r:.200}, files say {value!r:.200}"
                )
        return "imported"

    def _expected(self, source: Path, kind: str) -> dict[str, Any] | None:
        """name -> value, by the formats' own readers (None: they refuse the source)."""
        if kind != "dcp":
            from safetensors.torch import load_file

            try:
                out: dict[str, Any] = {}
                for file, names in _shards(source).items():
                    loaded = load_file(str(file))
                    out.update({n: loaded[n] for n in names or loaded})
                return out
            except Exception:
                return None
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        try:
            reader = dcp.FileSystemReader(str(source))
            metadata = reader.read_metadata()  # admitted by the import's allowlist first
            # Tensors only: DCP reads byte items with torch.load(weights_only=False), which is
            # not to be run on fuzzed bytes; the import's plain values are compared by name.
            state: dict[str, Any] = {
                fqn: torch.empty(tuple(md.size), dtype=md.properties.dtype)
                for fqn, md in metadata.state_dict_metadata.items()
                if isinstance(md, TensorStorageMetadata)
            }
            with contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.load(state, storage_reader=reader, no_dist=True)
            return state
        except (Exception, CheckpointException):  # CheckpointException is a BaseException
            return None


def engine(workdir: Path, seed: int) -> ImportEngine:
    """The family's engine (see :mod:`fuzz.surfaces`)."""
    return ImportEngine(workdir, seed)
