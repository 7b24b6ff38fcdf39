"""Imports go one way, api -> tasks -> workers -> kvbm, and each package imports only what
its role allows (docs/architecture.md, "The rooms"). Checked two ways for every module of every
package: statically (each import statement names a package at or below its own, and a
name imported from another project package is defined there, not re-exported) and at
run time (importing the module in a fresh interpreter loads none of the forbidden
libraries)."""

from __future__ import annotations

import ast
import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = {"kvbm": 0, "workers": 1, "tasks": 2, "api": 3}
# what importing any module of a package must not load (torch is the workers' business;
# the API process stays light; kvbm knows nothing of Celery or HTTP)
FORBIDDEN = {
    "kvbm": ("torch", "celery", "fastapi", "workers", "tasks", "api"),
    "workers": ("fastapi", "tasks", "api"),
    "tasks": ("torch", "transformers", "fastapi", "api"),
    "api": ("torch", "transformers", "workers.engine", "workers.llama"),
}


def _modules(package: str) -> list[str]:
    return sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in (ROOT / package).rglob("*.py")
    )


ALL = [m for pkg in LAYERS for m in _modules(pkg)]


def _project_imports(module: str) -> list[tuple[int, str, list[str]]]:
    """(line, imported module, names) of every import of a project package in ``module``."""
    path = ROOT / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = ROOT / module.replace(".", "/") / "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module, [a.name for a in node.names]))
    return [(n, m, names) for n, m, names in out if m.split(".")[0] in LAYERS]


@pytest.mark.parametrize("module", ALL)
def test_imports_go_down_only_and_never_through_a_re_export(module: str) -> None:
    own = module.split(".")[0]
    bad = []
    for line, target, names in _project_imports(module):
        top = target.split(".")[0]
        if LAYERS[top] > LAYERS[own] or (own == "api" and top == "workers"):
            bad.append(f"{module}:{line} imports {target} (above it, or api reaching workers)")
            continue
        mod = importlib.import_module(target)
        for name in names:
            obj = getattr(mod, name, None)
            home = getattr(obj, "__module__", None) if inspect.isclass(obj) or inspect.isfunction(
                obj) else None  # fmt: skip
            if home and home.split(".")[0] in LAYERS and home.split(".")[0] != top:
                bad.append(f"{module}:{line} takes {name} from {target}, a re-export of {home}")
    assert not bad, bad


@pytest.mark.parametrize("package", list(LAYERS))
def test_importing_a_package_loads_nothing_its_role_forbids(package: str) -> None:
    modules = [m for m in _modules(package) if m != f"{package}.__main__"]
    code = (
        f"import sys, importlib\nfor m in {modules!r}: importlib.import_module(m)\n"
        f"bad = [f for f in {FORBIDDEN[package]!r} if any(k == f or k.startswith(f + '.')"
        " for k in sys.modules)]\nprint(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT)  # fmt: skip
    assert out.returncode == 0, f"{package}: {out.stdout}{out.stderr[-2000:]}"
