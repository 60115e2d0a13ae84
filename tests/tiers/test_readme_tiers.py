"""The Tiers page (docs/tiers.md) runs as printed, with its outputs checked (DESIGN.md §13: docs
are code): its python block (``# tiers_example.py``) in a fresh directory, then the
``ckptstore`` command lines of its first shell block there. tests/docs/test_docs_blocks.py
runs every block of the page; this module checks what they print."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parents[2] / "docs" / "tiers.md"


def section() -> str:
    return PAGE.read_text()


def test_the_tiers_page_runs_as_printed(tmp_path: Path) -> None:
    body = section()
    script = re.search(r"```python\n(# tiers_example\.py.*?)```", body, re.S)
    assert script is not None
    (tmp_path / "tiers_example.py").write_text(script.group(1))
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTSTORE_")}
    done = subprocess.run(
        [sys.executable, "tiers_example.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert [x for x in lines if x.startswith("step ")] == [f"step {n}: local" for n in range(1, 6)]
    assert lines[-1] == "5 local ['b', 'c']"  # recovered from the peers, nothing from the store

    commands = [
        line.split("  #", 1)[0]
        for line in re.findall(r"```bash\n(.*?)```", body, re.S)[0].splitlines()
        if line.startswith(".venv/bin/ckptstore ")
    ]
    assert len(commands) == 3
    outputs = []
    for command in commands:
        argv = shlex.split(command)
        argv[0] = str(Path(sys.executable).with_name("ckptstore"))
        ran = subprocess.run(
            argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False
        )
        assert ran.returncode == 0, f"{command}: {ran.stdout}{ran.stderr}"
        outputs.append(ran.stdout)
    listed = outputs[0].splitlines()
    assert re.match(r"^5\s+local\s+local\s+2\s", listed[-1]), outputs[0]
    assert outputs[1].startswith("drained tiered-demo@5:"), outputs[1]
    shown = json.loads(outputs[2])
    assert (shown["status"], shown["durability"]) == ("committed", "remote")
