"""The README's Tiers section runs as printed (DESIGN.md §13: docs are code): its python block
(``# tiers_example.py``) in a fresh directory, then its ``ckptstore`` command lines there."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def section() -> str:
    text = README.read_text()
    found = re.search(r"^## Tiers.*?(?=^## )", text, re.S | re.M)
    assert found, "the README has no Tiers section"
    return found.group(0)


def test_the_readme_tiers_section_runs_as_printed(tmp_path: Path) -> None:
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
        for line in re.findall(r"```sh\n(.*?)```", body, re.S)[0].splitlines()
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
