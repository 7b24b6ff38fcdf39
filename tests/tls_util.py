"""Throwaway certificates for the TLS tests, made with the openssl command."""

from __future__ import annotations

import subprocess
from pathlib import Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(d: Path, name: str) -> tuple[Path, Path]:
    """A throwaway CA: (cert, key)."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key",
             "-out", f"{name}.pem", "-days", "1", "-subj", f"/CN={name}", cwd=d)  # fmt: skip
    return d / f"{name}.pem", d / f"{name}.key"


def make_server_cert(d: Path, ca: tuple[Path, Path], name: str = "server") -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost, signed by ``ca``: (cert, key)."""
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
             f"{name}.csr", "-subj", "/CN=127.0.0.1", cwd=d)  # fmt: skip
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", str(ca[0]), "-CAkey", str(ca[1]),
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", "-extfile", "san.cnf",
             cwd=d)  # fmt: skip
    return d / f"{name}.pem", d / f"{name}.key"
