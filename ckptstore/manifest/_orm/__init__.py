"""Level 2 of the manifest, private: ORM statements that work inside a session the caller
opened (``Database.read()`` or ``Database.write(fn)``) -- row changes, row and table locks.

None opens a session, commits or knows about tensors: the public operation modules (level 3,
see :mod:`ckptstore.manifest._sql`) compose them into one transaction each. Runs and
checkpoints are looked up with the Core statements of :mod:`ckptstore.manifest._sql.lookups`.
"""
