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


def test_kvbm_imports_no_celery_or_fastapi() -> None:
    code = (
        "import sys, kvbm.block_pool;"
        "bad = [m for m in ('celery', 'fastapi', 'torch') if m in sys.modules];"
        "sys.exit(1 if bad else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
