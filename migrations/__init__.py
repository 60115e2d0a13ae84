"""Alembic migrations of the manifest database, shipped inside the package as
``ckptstore._migrations`` so ``ckptstore db upgrade`` works from an installed wheel."""
