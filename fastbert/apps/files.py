"""Files the commands write so that a crash leaves each whole or absent (a file system may write a rename
before the data of the file it names)."""
from __future__ import annotations

import hashlib
import os


def sha256(path: str) -> str:
    """The hex digest of the file's bytes (in 1 MiB reads: hashlib.file_digest is Python 3.11's)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def sync(path: str) -> None:
    """`path`'s bytes on the disk."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def replace_durably(tmp: str, path: str) -> None:
    """os.replace(tmp, path) once tmp's bytes are on the disk, then the rename itself."""
    sync(tmp)
    os.replace(tmp, path)
    if hasattr(os, "O_DIRECTORY"):
        directory = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
