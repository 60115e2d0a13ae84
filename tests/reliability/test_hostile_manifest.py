"""Hostile conditions at the manifest database: a PostgreSQL password in the URL never leaks,
whether the connection works or fails (an unknown role, a missing database, a closed port).
"""

from __future__ import annotations

from typing import Any

import pytest
from secret_scan import CLI_READS, CLI_READS_EXIT, Scanner, scan_cli, workload
from sqlalchemy.engine import make_url

from ckptstore.checkpointer import open_run
from ckptstore.objectstore import LocalStore


@pytest.mark.integration
def test_a_postgresql_password_never_leaks(
    pg_schema_url: str,
    store: LocalStore,
    capsys: pytest.CaptureFixture[str],
    reliability_report: Any,
) -> None:
    """A password in the database URL (the test server trusts local connections, so it is
    accepted and ignored), then URLs whose connection fails: an unknown role, a database that
    does not exist, a closed port."""
    password = "Pg8SECRETpassword"
    url = make_url(pg_schema_url).set(password=password).render_as_string(hide_password=False)
    failing = [
        make_url(pg_schema_url).set(username="no_such_role_ckpt", password=password),
        make_url(pg_schema_url).set(database="no_such_db_ckpt", password=password),
        make_url(pg_schema_url).set(port=1, password=password),
    ]
    failing_urls = [u.render_as_string(hide_password=False) for u in failing]
    scanner = Scanner((password,))
    try:
        workload(
            scanner,
            url,
            store,
            [lambda u=u: open_run("r", db=u, store=store) for u in failing_urls],
        )
        base = ["--db", url, "--store", str(store.root)]
        # The test server's login is a superuser, which `sql` refuses without the flag.
        reads = [[*c, "--allow-superuser"] if c[0] == "sql" else c for c in CLI_READS]
        more = [
            ["db", "current"],
            ["db", "upgrade"],
            ["sql", "--allow-superuser", "SELECT * FROM no_such_table"],
        ]
        codes = scan_cli(scanner, capsys, base, *reads, *more)
        assert codes == [*CLI_READS_EXIT, 0, 0, 3]
        for bad in failing_urls:
            codes = scan_cli(scanner, capsys, ["--db", bad], ["runs"], ["db", "current"])
            assert codes == [3, 3]
        scanner.database(url)
    finally:
        scanner.report(reliability_report)
    assert scanner.leaks == [], scanner.summary()
    # Outputs, errors, tracebacks and log records (opening a database no longer goes through
    # Alembic, whose INFO lines used to add a few).
    assert scanner.texts > 80
