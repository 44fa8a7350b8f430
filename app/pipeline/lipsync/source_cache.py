"""A worker-local cache of the lip-sync work that depends on the face video alone.

The avatar case (one face video, many driving audios) repeats two costly steps per job for nothing: finding
the faces (prepare: HOG detection and landmarks on every frame) and VAE-encoding the face crops (lipsync:
the UNet's source latents). Both are kept here, each entry keyed by the video's content hash (SHA-256 of its
bytes) together with everything else the result depends on (detector, crop margin, VAE weights, dtype,
crop path), so a different video, or the same one under other settings, never hits.

Entries are single files under `root`, written atomically (temporary file, then rename); the total size is
held under `max_bytes` by removing the least recently used entries (a hit refreshes the file's mtime).
Several workers of a host may share the folder: a reader that loses a race with an eviction sees a miss.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

HASH_CHUNK = 1 << 20


def file_digest(path: str | Path) -> str:
    """SHA-256 of a file's bytes (hex), read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as source:
        while chunk := source.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def entry_key(kind: str, **parts: Any) -> str:
    """The key of a `kind` entry: a hash of the parts it depends on (JSON, sorted)."""
    text = json.dumps({"kind": kind, **parts}, sort_keys=True, default=str)
    return f"{kind}-{hashlib.sha256(text.encode()).hexdigest()[:40]}"


class SourceCache:
    """Byte-bounded LRU of files. max_bytes 0 turns it off (every read a miss, writes dropped)."""

    def __init__(self, root: str | Path, max_bytes: int):
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.root, self.max_bytes = Path(root), max_bytes

    def _path(self, key: str) -> Path:
        if not key or "/" in key or key.startswith("."):
            raise ValueError(f"bad cache key {key!r}")
        return self.root / key

    def read(self, key: str) -> bytes | None:
        """The entry's bytes (and it becomes the most recently used), or None."""
        if self.max_bytes == 0:
            return None
        path = self._path(key)
        try:
            data = path.read_bytes()
            os.utime(path)
        except FileNotFoundError:
            return None
        return data

    def write(self, key: str, data: bytes) -> bool:
        """Store an entry (replacing any), then evict down to max_bytes; False when it alone is too big."""
        if len(data) > self.max_bytes:
            return False
        self.root.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=self.root, prefix=".tmp-")
        try:
            with os.fdopen(handle, "wb") as out:
                out.write(data)
            os.replace(temporary, self._path(key))
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        self.evict(keep=key)
        return True

    def entries(self) -> list[tuple[float, int, Path]]:
        """(mtime, size, path) of every entry, least recently used first."""
        found = []
        for path in self.root.glob("[!.]*") if self.root.is_dir() else []:
            try:
                status = path.stat()
            except FileNotFoundError:
                continue
            found.append((status.st_mtime, status.st_size, path))
        return sorted(found)

    def evict(self, keep: str | None = None) -> list[str]:
        """Remove least recently used entries until the total fits; returns the removed keys."""
        entries = self.entries()
        total = sum(size for _, size, _ in entries)
        removed = []
        for _, size, path in entries:
            if total <= self.max_bytes:
                break
            if path.name == keep:
                continue
            path.unlink(missing_ok=True)
            total -= size
            removed.append(path.name)
        return removed

    # -- the two kinds of entries -------------------------------------------------------------------------

    def read_json(self, key: str) -> dict[str, Any] | None:
        data = self.read(key)
        return None if data is None else json.loads(data)

    def write_json(self, key: str, value: dict[str, Any]) -> bool:
        return self.write(key, json.dumps(value).encode())

    def read_latents(self, key: str) -> dict[int, torch.Tensor]:
        """Source frame index -> latent [8, s/8, s/8] (CPU), empty on a miss."""
        data = self.read(key)
        if data is None:
            return {}
        saved = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        return dict(zip(saved["indices"].tolist(), saved["latents"].unbind(0), strict=True))

    def write_latents(self, key: str, latents: dict[int, torch.Tensor]) -> bool:
        indices = sorted(latents)
        buffer = io.BytesIO()
        torch.save(
            {
                "indices": torch.tensor(indices, dtype=torch.long),
                "latents": torch.stack([latents[i].detach().cpu() for i in indices]),
            },
            buffer,
        )
        return self.write(key, buffer.getvalue())
