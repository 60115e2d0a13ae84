"""Which store a rank of a Megatron save or load uses, from its ``run``/``target`` and ``store=``.

Only rank 0 needs a Run (it chooses what to load, and commits a save); any other rank may pass
None and ``store=`` (DESIGN.md §12). A rank that passes both must name the run's own store:
two stores for one rank is a mistake, never a choice.
"""

from __future__ import annotations

from ckptstore.errors import ConfigError
from ckptstore.extending import ObjectStore, Run, open_store

#: What a rank may name as its store: an open store or its URL.
StoreArg = ObjectStore | str


def store_of(target: Run | StoreArg) -> ObjectStore:
    """The store of a run, the store itself, or the store at a URL (opened, not created)."""
    if isinstance(target, Run):
        return target.store
    return target if isinstance(target, ObjectStore) else open_store(target, create=False)


def rank_store(run: Run | None, store: StoreArg | None) -> tuple[ObjectStore, ObjectStore | None]:
    """The store this rank reads (its run's, else ``store``), and the one opened here from a
    URL, which the caller closes; ConfigError naming the fix when the arguments do not do."""
    if run is not None and not isinstance(run, Run):
        raise ConfigError(
            f"run is a {type(run).__name__}: pass the Run (open_run(...)), or None and "
            "store=<the run's store> on a rank other than 0"
        )
    if store is None:
        if run is None:
            raise ConfigError(
                "no run and no store: a rank without a Run must pass store=<the run's store "
                "URL or ObjectStore>"
            )
        return run.store, None
    given = store_of(store)
    opened = None if isinstance(store, ObjectStore) else given
    if run is None:
        return given, opened
    if opened is not None:
        opened.close()
    if given.url != run.store.url:
        raise ConfigError(
            f"store={given.url} is not the run's store {run.store.url}: pass one of them"
        )
    return run.store, None


def save_target(target: Run | StoreArg | None, store: StoreArg | None) -> Run | StoreArg:
    """What a rank of a save stores through (and, on rank 0, commits with): ``target``, else
    ``store``; ConfigError naming the fix when the arguments do not do."""
    if store is None:
        if target is None:
            raise ConfigError(
                "no run and no store: a rank without a Run must pass store=<the run's store "
                "URL or ObjectStore> (rank 0 commits and needs the writable Run)"
            )
        return target
    if target is None:
        return store
    if not isinstance(target, Run):
        raise ConfigError(
            f"the target is already a store ({type(target).__name__}); pass store= only "
            "with a Run or None"
        )
    rank_store(target, store)  # the same store, or ConfigError
    return target
