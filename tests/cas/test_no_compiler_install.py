"""An installation built without a C compiler (DESIGN.md §12, "formats outlive builds").

pip builds ckptstore with ``CC`` and ``CXX`` pointing at ``/bin/false``: the build succeeds
without the optional C extension, and the wheel holds no compiled code. That installation, in a
child interpreter (its dependencies from this virtual environment), reads the fphuff blobs that
the C encoder wrote here, byte for byte, writes its own floats as bgzstd, and says once, at
first use of the codec, that the fast path is missing and how to get it. About 5 s on the
2-core development machine (one wheel build, one install, one child).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from ckptstore.cas import Kind, fpcodec, put_blob
from ckptstore.objectstore import LocalStore

REPO = Path(__file__).resolve().parents[2]
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
#: What the build reads (pyproject.toml lists the packages; migrations/ ships inside), and the
#: checkout's other top-level folders, which must stay out of the wheel (trainer/ is the reference
#: user, run from the checkout; a top-level ``trainer`` would collide with a PyPI project's).
SOURCES = ["pyproject.toml", "README.md", "ckptstore", "migrations", "trainer", "tests", "bench"]

pytestmark = pytest.mark.skipif(
    fpcodec.native is None,
    reason=f"the blobs to read are the C encoder's: {fpcodec.NATIVE_ERROR}",
)

CHILD = """
import json, sys
from pathlib import Path

import numpy as np

import ckptstore
from ckptstore.cas import Kind, fpcodec, get_blob, put_blob
from ckptstore.objectstore import LocalStore

root, cases = Path(sys.argv[1]), json.loads(sys.argv[2])
store = LocalStore(root / "store", fsync=False)
for digest, expected in cases:
    header, data = get_blob(store, digest)
    assert header.codec.name == "fphuff", header.codec.name
    assert bytes(data) == (root / expected).read_bytes(), digest
floats = np.random.default_rng(1).standard_normal(100_000).astype(np.float32) * 0.02
written = put_blob(LocalStore(root / "new", fsync=False), floats.tobytes(), Kind.CHUNK,
                   itemsize=4, float_like=True)
print(json.dumps({"file": ckptstore.__file__, "native": fpcodec.native is not None,
                  "written": written.codec}))
"""


def build_without_compiler(tmp_path: Path) -> Path:
    """The wheel pip builds from a copy of the sources with no working C compiler."""
    source = tmp_path / "src"
    source.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info")
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=ignore)
        else:
            shutil.copy(REPO / name, source / name)
    env = {**os.environ, "CC": "/bin/false", "CXX": "/bin/false"}
    subprocess.run(
        [*PIP, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(source)],
        env=env,
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("ckptstore-*.whl")
    return wheel


def test_without_a_compiler_it_installs_and_reads_fphuff_blobs(tmp_path: Path) -> None:
    wheel = build_without_compiler(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert "ckptstore/cas/fpref.py" in names
    assert not [n for n in names if n.endswith((".so", ".pyd"))]
    # The library alone, and all of it: every package under ckptstore/ (pyproject lists them).
    top_level = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top_level == {"ckptstore"}
    packages = [p.parent.relative_to(REPO) for p in (REPO / "ckptstore").rglob("__init__.py")]
    assert [p for p in packages if f"{p.as_posix()}/__init__.py" not in names] == []
    site = tmp_path / "site"
    subprocess.run(
        [*PIP, "install", "--no-deps", "--no-compile", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
    )
    # Blobs the C encoder writes here: bf16 over several blocks, fp32 with a coded mantissa.
    store = LocalStore(tmp_path / "store", fsync=False)
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(300_000, generator=g) * 1e-3
    tensors = {"bf16": (torch.randn(600_000, generator=g) * 0.02).bfloat16(), "sq": grad * grad}
    cases = []
    for name, t in tensors.items():
        raw = t.view(torch.uint8).numpy().tobytes()
        ref = put_blob(store, raw, Kind.CHUNK, itemsize=t.element_size(), float_like=True)
        assert ref.codec == "fphuff"
        (tmp_path / name).write_bytes(raw)
        cases.append((ref.digest, name))
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path), json.dumps(cases)],
        env={**os.environ, "PYTHONPATH": str(site)},
        cwd=tmp_path,  # not the checkout, which would come first on sys.path
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr
    result = json.loads(child.stdout)
    assert Path(result["file"]).is_relative_to(site)
    assert result == {**result, "native": False, "written": "bgzstd"}
    warnings = [line for line in child.stderr.splitlines() if "C extension" in line]
    assert len(warnings) == 1, child.stderr
    assert "reference decoder" in warnings[0]
    assert "install a C compiler" in warnings[0]
