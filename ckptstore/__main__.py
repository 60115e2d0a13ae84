"""``python -m ckptstore``: the ``ckptstore`` command, for environments without its script."""

from ckptstore.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
