"""Files for the Files and Batch APIs, behind one small interface (:class:`FileStore`) so an
object store can take the directory's place later.

:class:`DirFileStore` keeps each file as ``<id>`` (its bytes) and ``<id>.json`` (OpenAI's
File object: ``id``, ``bytes``, ``created_at``, ``filename``, ``purpose``), written to a
temporary name and renamed, so a reader never sees half a file. Several API replicas and
the batch runner share it through the filesystem (``CONVEYOR_FILES_DIR``).
"""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path
from typing import Protocol

PURPOSES = ("batch", "batch_output", "fine-tune", "assistants", "vision", "user_data", "evals")


class FileStore(Protocol):
    def put(self, data: bytes, filename: str, purpose: str) -> dict: ...

    def meta(self, file_id: str) -> dict | None: ...

    def read(self, file_id: str) -> bytes | None: ...

    def delete(self, file_id: str) -> bool: ...

    def list(self, purpose: str | None = None) -> list[dict]: ...


class DirFileStore:
    """Files in one directory."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).expanduser()
        self.root.mkdir(parents=True, exist_ok=True)

    def put(self, data: bytes, filename: str, purpose: str) -> dict:
        file_id = "file-" + secrets.token_hex(12)
        meta = {"id": file_id, "object": "file", "bytes": len(data),
                "created_at": int(time.time()), "filename": filename, "purpose": purpose,
                "status": "processed", "status_details": None}  # fmt: skip
        self._write(self.root / file_id, data)
        self._write(self.root / f"{file_id}.json", json.dumps(meta).encode())
        return meta

    def meta(self, file_id: str) -> dict | None:
        path = self._path(file_id, ".json")
        if path is None or not path.is_file():
            return None
        return json.loads(path.read_bytes())

    def read(self, file_id: str) -> bytes | None:
        path = self._path(file_id)
        if path is None or not path.is_file() or self.meta(file_id) is None:
            return None
        return path.read_bytes()

    def delete(self, file_id: str) -> bool:
        found = False
        for suffix in (".json", ""):
            path = self._path(file_id, suffix)
            if path is not None and path.is_file():
                path.unlink()
                found = True
        return found

    def list(self, purpose: str | None = None) -> list[dict]:
        out = []
        for path in self.root.glob("file-*.json"):
            try:
                meta = json.loads(path.read_bytes())
            except (OSError, ValueError):
                continue
            if purpose is None or meta.get("purpose") == purpose:
                out.append(meta)
        return sorted(out, key=lambda m: (m["created_at"], m["id"]), reverse=True)

    def _path(self, file_id: str, suffix: str = "") -> Path | None:
        """The path of a well-formed id (no other name reaches the filesystem)."""
        body = file_id.removeprefix("file-")
        if not file_id.startswith("file-") or len(body) != 24 or not _hex(body):
            return None
        return self.root / f"{file_id}{suffix}"

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
        tmp.write_bytes(data)
        os.replace(tmp, path)


def _hex(s: str) -> bool:
    return all(c in "0123456789abcdef" for c in s)
