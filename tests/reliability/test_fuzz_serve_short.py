"""Issue 40: a short, fixed-seed run of the serve fuzz family (fuzz/surfaces.py): `ckptstore serve`
over generated requests from a real HTTP client and raw sockets.
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

CASES = 400
SEED = 40


def test_serve_fuzz_finds_nothing(tmp_path: Path, reliability_report: Any) -> None:
    engine = surfaces.engine_for("serve", tmp_path, SEED)
    try:
        tally = surfaces.fuzz_family("serve", engine, CASES, tmp_path / "findings", None)
    finally:
        engine.close()
    figures = asdict(tally)
    reliability_report.add(
        "fuzz serve",
        cases=tally.cases,
        crashes=len(tally.findings),
        distinct_outcomes=len(tally.outcomes),
    )
    assert tally.findings == [], (surfaces.outcome_line(figures), tally.findings[:3])
    assert tally.cases == CASES
    # The cases reach both sides of the oracle (not only refusals, not only successes).
    for outcome in ("page 200", "api 200", "page 404", "page 405"):
        assert tally.outcomes.get(outcome), (outcome, figures["outcomes"])
