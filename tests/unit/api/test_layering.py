"""The API process never imports torch or the engine (it must stay light and fast)."""

from __future__ import annotations

import subprocess
import sys


def test_api_imports_no_torch() -> None:
    code = (
        "import sys, api.app, api.runner, tasks.pipeline, tasks.router;"
        "bad = [m for m in ('torch', 'transformers', 'workers.engine', 'workers.llama')"
        " if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_api_sources_never_import_workers_directly() -> None:
    """api -> tasks -> workers -> kvbm: the API reaches worker-side names via tasks/."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[3] / "api"
    bad = [
        f"{p.name}:{n}"
        for p in sorted(root.glob("*.py"))
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if re.match(r"\s*(from|import) (workers|torch)\b", line)
    ]
    assert not bad, bad


def test_kvbm_imports_no_celery_or_fastapi() -> None:
    code = (
        "import sys, kvbm.block_pool;"
        "bad = [m for m in ('celery', 'fastapi', 'torch') if m in sys.modules];"
        "sys.exit(1 if bad else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
