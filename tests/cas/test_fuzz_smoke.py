"""The float decoder's fuzz harness (``fuzz/``, ``make fuzz``) in miniature: a few thousand
mutated payloads through the ASan + UBSan build in a worker process, and through the shipped
build in this process against the pure-Python reference decoder. ``make fuzz`` runs millions.

Each input must decode to the bytes its mutation implies (or, where none does, the reference
decoder's bytes) or raise ValueError; the sanitized run also bounds what a decode allocates.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ckptstore.cas import _fpcodec, fpref

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # fuzz/ is a tool at the repository root, not in the package
    sys.path.insert(0, str(REPO))

from fuzz import fuzz_fpcodec, native, sanitized, worker  # noqa: E402

SEED = 22


@pytest.fixture(scope="module")
def sanitizer() -> None:
    """Skip, naming why, where gcc has no AddressSanitizer runtime; else build the extension."""
    try:
        sanitized.build()
    except sanitized.SanitizerUnavailable as exc:
        pytest.skip(f"no sanitized build possible: {exc}")


@pytest.mark.usefixtures("sanitizer")
def test_the_sanitized_environment_catches_a_one_byte_overread() -> None:
    """What makes "no crash" mean something: with libasan preloaded, a read one byte past a
    payload block (as the harness allocates them) aborts with a heap-buffer-overflow report."""
    code = (
        "import ctypes; from fuzz.native import Probe;"
        "block = Probe.exact_block(bytes(37)); ctypes.string_at(block.ctypes.data, 38)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=sanitized.environment(),
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode != 0
    assert "heap-buffer-overflow" in done.stderr


@pytest.mark.usefixtures("sanitizer")
def test_the_sanitized_decoder_survives_mutants(tmp_path: Path) -> None:
    total = fuzz_fpcodec.run_sanitized(
        3000, workers=1, chunk=3000, seed=SEED, findings=tmp_path, quiet=True
    )
    assert total.findings == []
    assert total.inputs == 3000
    # Every outcome was checked: refused, or the exact bytes a mutation implies, or (checked
    # afterwards, outside the sanitizers) the reference decoder's bytes.
    assert total.rejected > 500
    assert total.exact > 500
    assert total.agreed_with_reference > 0
    assert total.unverified == 0
    assert not list(tmp_path.iterdir())  # no reproducer written


def test_the_shipped_decoder_agrees_with_the_reference_on_mutants(tmp_path: Path) -> None:
    tally = native.run(
        _fpcodec,
        worker.samples(_fpcodec, SEED, 200),
        seed=SEED,
        inputs=2000,
        findings_dir=tmp_path,
        target="fpcodec",
        checks=native.Checks(reference=fpref.decode, reference_on_all=True, time_cap=10.0),
    )
    assert tally.findings == []
    assert tally.inputs == 2000
    assert tally.rejected > 300
    assert tally.exact > 300
    assert tally.agreed_with_reference > 0
