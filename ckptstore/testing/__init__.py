"""Test support for object-store backends, shipped so that out-of-tree backends can use it.

- :mod:`ckptstore.testing.store`: the conformance suite, :class:`~.store.StoreTests` (and
  :class:`~.store.S3StoreTests` for S3-compatible servers), a class that every backend's tests
  subclass. It needs pytest. Its tests live in the private ``_store_*`` modules, by job (objects,
  keys, concurrency), as mixins that :class:`~.store.StoreTests` combines; import from
  :mod:`~ckptstore.testing.store` only.
- :mod:`ckptstore.testing.factories`: store factories over a fresh location (a directory, a
  bucket prefix) and small helpers; no pytest needed.
- :mod:`ckptstore.testing.memory`: the process's held and lazily freed memory, as the kernel
  counts it (for tests and benchmarks of snapshot memory).

The library itself never imports this package.
"""

from __future__ import annotations

import sys

# Under pytest, the suite's plain asserts report their operands as in a test module. This must
# be registered before the suite's modules are first imported; pytest is only looked up, so
# that the factories import without it.
_SUITE_MODULES = (
    "store",
    "_store_base",
    "_store_objects",
    "_store_namespace",
    "_store_concurrency",
)
_pytest = sys.modules.get("pytest")
if _pytest is not None:
    _pytest.register_assert_rewrite(*(f"{__name__}.{name}" for name in _SUITE_MODULES))
