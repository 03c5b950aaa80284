"""A user cache folder for things that are slow to rebuild from a checkpoint (the GGUF tokenizer takes ~10 s).

Entries are keyed by the source file's absolute path, size and mtime, so a replaced file is never served stale;
a cached folder carries a manifest of its files' SHA-256 (`seal_folder`), checked before it is used, so a
truncated, edited or swapped one is rebuilt rather than trusted.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat


def cache_root() -> str:
    """$PAGEDLLM_CACHE, else ~/.cache/pagedllm."""
    return os.environ.get("PAGEDLLM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pagedllm")


def cache_dir_for(path: str, kind: str) -> str:
    """The cache folder of `kind` for the file at `path` (not created)."""
    ap = os.path.abspath(path)
    st = os.stat(ap)
    key = hashlib.sha1(f"{ap}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(ap))[0]
    return os.path.join(cache_root(), kind, f"{stem}-{key}")


MANIFEST = "pagedllm-manifest.json"  # written last into a cached folder: each file's name, size and SHA-256
_MAX_MANIFEST = 64 * 2**10
_MAX_FOLDER = 512 * 2**20


def _sha256_of(path: str) -> tuple[int, str]:
    """(size, SHA-256) of the regular file `path`, opened without following a link (OSError otherwise)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(f"{path} is not a regular file")
        digest, size = hashlib.sha256(), 0
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
            if size > _MAX_FOLDER:
                raise OSError(f"{path} is larger than a cached file can be")
        return size, digest.hexdigest()


def seal_folder(folder: str) -> None:
    """Write the manifest of a freshly built cache folder (before it is renamed into place), so a later load
    can tell the folder it wrote from one that was truncated, edited or swapped since."""
    files = {}
    for name in sorted(os.listdir(folder)):
        size, digest = _sha256_of(os.path.join(folder, name))
        files[name] = {"size": size, "sha256": digest}
    with open(os.path.join(folder, MANIFEST), "x", encoding="utf-8") as f:
        json.dump({"files": files}, f)


def sealed_folder_problem(folder: str, required: tuple[str, ...]) -> str | None:
    """None if `folder` is a real directory whose files are exactly those its manifest lists (with `required`
    among them), byte for byte; otherwise what is wrong. Reads nothing through a link; never raises."""
    try:
        if not stat.S_ISDIR(os.lstat(folder).st_mode):
            return "is not a folder"
        fd = os.open(os.path.join(folder, MANIFEST), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            raw = f.read(_MAX_MANIFEST + 1)
        if len(raw) > _MAX_MANIFEST:
            return "has an oversized manifest"
        files = json.loads(raw.decode("utf-8"))["files"]
        if not isinstance(files, dict) or set(required) - set(files):
            return "has a manifest that lacks a required file"
        if set(os.listdir(folder)) != set(files) | {MANIFEST}:
            return "holds other files than its manifest lists"
        for name, want in files.items():
            if not isinstance(name, str) or os.sep in name or name.startswith(".") or not isinstance(want, dict):
                return "has a malformed manifest"
            if _sha256_of(os.path.join(folder, name)) != (want.get("size"), want.get("sha256")):
                return f"has {name} changed since it was written"
    except FileNotFoundError:
        return "has no manifest"
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        return f"cannot be checked ({type(e).__name__}: {e})"
    return None


def remove_cached(path: str) -> None:
    """Take an unusable entry out of the way of a rebuild: a real folder is deleted (it is under the cache's own
    name), a link or a file only unlinked (what a link points to is never touched)."""
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass
