"""``ckptstore serve``: a read-only, checkpoint-centric web view of run history.

Runs and their fork lineage; a run's checkpoints over time with status, reason, trigger and
retention fate, metric curves, save timings and uploaded versus reused bytes; a checkpoint's
components and state-dict names (plain, DCP and Megatron layouts) with sizes, codecs and
ranks; comparisons by content address; storage, what gc would free, and damage. Every page has
a JSON twin under ``/api``.

Modules: :mod:`~ckptstore.web.server` (HTTP, safety), :mod:`~ckptstore.web.routes` (URLs),
:mod:`~ckptstore.web.data` (what a page shows, as records), :mod:`~ckptstore.web.pages` and
:mod:`~ckptstore.web.pages_run` (HTML), :mod:`~ckptstore.web.svg` (charts),
:mod:`~ckptstore.web.entries` (state-dict names from component indexes, without torch),
:mod:`~ckptstore.web.compare`, :mod:`~ckptstore.web.fate`, :mod:`~ckptstore.web.markup`.
"""
