"""Per-step metric curves (``step_metrics``, logged by ``Run.log_metrics``): what the run
page's metric charts draw where a run logged per step, and ``/api/runs/NAME/steps``."""

from __future__ import annotations

from collections.abc import Sequence

from ckptstore.manifest import reading as reads
from ckptstore.manifest import step_metrics
from ckptstore.web.data import Site

#: Points read per curve at most (evenly thinned; the chart thins again, keeping extremes).
MAX_POINTS = 5000


def step_curves(
    site: Site, run_id: int, names: Sequence[str]
) -> dict[str, list[tuple[int, float]]]:
    """Each of ``names``' per-step (step, value) points, in step order."""
    if not names:
        return {}
    with site.db.connect() as conn:
        return step_metrics.curves(conn, run_id, names, MAX_POINTS)


def run_steps(site: Site, name: str) -> dict[str, list[tuple[int, float]]]:
    """Every per-step curve of the run ``name``, by metric (NaN steps left out)."""
    run = reads.require_run(site.db, name)
    with site.db.connect() as conn:
        names = step_metrics.metric_names(conn, run.id)
        return step_metrics.curves(conn, run.id, names, MAX_POINTS)
