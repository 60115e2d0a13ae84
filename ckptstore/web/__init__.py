"""``ckptstore serve``: a read-only, checkpoint-centric web view of run history.

Runs and their fork lineage; a run's checkpoints over time with status, reason, trigger and
retention fate, metric curves (per step where the run logged them), save timings and uploaded
versus reused bytes; a checkpoint's components and state-dict names (plain, DCP and Megatron
layouts) with sizes, codecs and ranks, a page at a time, filtered and sorted; comparisons
parameter by parameter across layouts; storage, what gc would free, and damage. Every page has
a JSON twin under ``/api``.

Modules: :mod:`~ckptstore.web.server` (HTTP, safety), :mod:`~ckptstore.web.routes` (URLs),
:mod:`~ckptstore.web.data` (what a page shows, as records), :mod:`~ckptstore.web.comparison` and
:mod:`~ckptstore.web.curves` (the compare page's and the per-step curves' records),
:mod:`~ckptstore.web.listing` (filter, sort, pages), :mod:`~ckptstore.web.pages`,
:mod:`~ckptstore.web.pages_run` and :mod:`~ckptstore.web.pages_entries` (HTML),
:mod:`~ckptstore.web.svg` (charts), :mod:`~ckptstore.web.entries` (state-dict names from
component indexes, without torch), :mod:`~ckptstore.web.compare` (verdicts),
:mod:`~ckptstore.web.fate`, :mod:`~ckptstore.web.markup`.
"""
