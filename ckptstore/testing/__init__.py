"""Test support for object-store backends, shipped so that out-of-tree backends can use it.

- :mod:`ckptstore.testing.store`: the conformance suite, :class:`~.store.StoreTests` (and
  :class:`~.store.S3StoreTests` for S3-compatible servers), a class that every backend's tests
  subclass. It needs pytest.
- :mod:`ckptstore.testing.factories`: store factories over a fresh location (a directory, a
  bucket prefix) and small helpers; no pytest needed.
- :mod:`ckptstore.testing.memory`: the process's held and lazily freed memory, as the kernel
  counts it (for tests and benchmarks of snapshot memory).

The library itself never imports this package.
"""

from __future__ import annotations

import sys

# Under pytest, the suite's plain asserts report their operands as in a test module. This must
# be registered before ckptstore.testing.store is first imported; pytest is only looked up, so
# that the factories import without it.
_pytest = sys.modules.get("pytest")
if _pytest is not None:
    _pytest.register_assert_rewrite("ckptstore.testing.store")
