"""Issue 40: a short, fixed-seed run of the import fuzz family (fuzz/surfaces.py): `ckptstore
import` over mutated DCP directories and safetensors folders (a real `ckptstore` subprocess for
a sample of them).
``make fuzz`` runs the long one; fuzz/README.md says what each case checks."""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # fuzz/ is a tool at the repository root, not in the package
    sys.path.insert(0, str(REPO))

from fuzz import surfaces  # noqa: E402

CASES = 40
SEED = 40


def test_import_fuzz_finds_nothing(tmp_path: Path, reliability_report: Any) -> None:
    engine = surfaces.engine_for("import", tmp_path, SEED)
    try:
        tally = surfaces.fuzz_family("import", engine, CASES, tmp_path / "findings", None)
    finally:
        engine.close()
    figures = asdict(tally)
    reliability_report.add(
        "fuzz import",
        cases=tally.cases,
        crashes=len(tally.findings),
        distinct_outcomes=len(tally.outcomes),
    )
    assert tally.findings == [], (surfaces.outcome_line(figures), tally.findings[:3])
    assert tally.cases == CASES
    # The cases reach both sides of the oracle (not only refusals, not only successes).
    for outcome in ("imported", "refused exit 3"):
        assert tally.outcomes.get(outcome), (outcome, figures["outcomes"])
