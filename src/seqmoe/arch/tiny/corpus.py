"""The seqmoe-tiny training text: the running interpreter's own standard library source.

    corpus = stdlib_corpus()
    corpus.train_texts(), corpus.heldout_texts(), corpus.manifest()

Every CPython install carries its `Lib/` directory (PSF License 2.0), so the text needs no
download and may be redistributed. The `*.py` files are taken in sorted order of their path
relative to `Lib/`, minus folders of tests, GUI code, vendored tables and build-specific files
(`EXCLUDED_DIRS`). A file is held out for perplexity when the first byte of the sha256 of its
relative path is below `HELDOUT_BYTE` (about 6 % of the files; a split by file, the same on every
machine). `manifest()` records the Python version, the counts and a sha256 over the sorted
(path, contents) pairs, so a rebuild can tell whether it saw the same text.
"""

from __future__ import annotations

import hashlib
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from seqmoe.base.errors import UserError

__all__ = ["EXCLUDED_DIRS", "HELDOUT_BYTE", "LICENSE", "Corpus", "psf_notice", "stdlib_corpus"]

EXCLUDED_DIRS = frozenset({
    "test", "tests", "idle_test", "idlelib", "tkinter", "turtledemo", "lib2to3", "site-packages",
    "dist-packages", "ensurepip", "venv", "encodings", "pydoc_data", "__phello__", "__pycache__",
})  # fmt: skip
"""Folder names (at any depth under `Lib/`) whose files are left out; `config-*` folders are too."""

HELDOUT_BYTE = 16
"""Files whose sha256(relative path)[0] < HELDOUT_BYTE are held out (16/256 = 6.25 % expected)."""

LICENSE = "PSF-2.0"


def psf_notice(root: str | Path | None = None) -> str:
    """PSF's notice of copyright as quoted in `root/LICENSE.txt` (default: this interpreter's), or ''."""
    path = Path(root if root is not None else sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    text = " ".join(path.read_text(errors="replace").split()) if path.is_file() else ""
    start = text.find('"Copyright (c) 2001')
    end = text.find('"', start + 1)
    return text[start + 1:end] if 0 <= start < end else ""


def _excluded(rel: Path) -> bool:
    return any(p in EXCLUDED_DIRS or p.startswith("config-") for p in rel.parts[:-1])


def is_heldout(rel_path: str) -> bool:
    """True when the file (path relative to `Lib/`, '/'-separated) belongs to the held-out part."""
    return hashlib.sha256(rel_path.encode()).digest()[0] < HELDOUT_BYTE


@dataclass(frozen=True)
class Corpus:
    """The selected files of one `Lib/` folder.

    Attributes:
        root: the `Lib/` folder.
        files: relative '/'-separated paths, sorted.
    """

    root: Path
    files: tuple[str, ...]

    def read(self, rel: str) -> str:
        """One file's text (UTF-8; undecodable bytes replaced)."""
        return (self.root / rel).read_bytes().decode("utf-8", errors="replace")

    @property
    def train_files(self) -> list[str]:
        return [f for f in self.files if not is_heldout(f)]

    @property
    def heldout_files(self) -> list[str]:
        return [f for f in self.files if is_heldout(f)]

    @property
    def license_file(self) -> Path | None:
        """The folder's `LICENSE.txt` (the PSF License Agreement and history), None if absent."""
        path = self.root / "LICENSE.txt"
        return path if path.is_file() else None

    def train_texts(self) -> list[str]:
        return [self.read(f) for f in self.train_files]

    def heldout_texts(self) -> list[str]:
        return [self.read(f) for f in self.heldout_files]

    def manifest(self) -> dict:
        """What the corpus is: source, license, counts, bytes and a content hash per part."""
        out: dict = {
            "source": "CPython standard library source (Lib/*.py) of the interpreter that trained the model",
            "python_version": platform.python_version(),
            "python_implementation": platform.python_implementation(),
            "license": LICENSE,
            "copyright_notice": psf_notice(self.root),
            "excluded_dirs": sorted(EXCLUDED_DIRS) + ["config-*"],
            "heldout_rule": f"sha256(relative path)[0] < {HELDOUT_BYTE}",
        }
        for part, files in (("all", list(self.files)), ("train", self.train_files), ("heldout", self.heldout_files)):
            h, n = hashlib.sha256(), 0
            for rel in files:  # sorted: (path, NUL, length, NUL, contents) per file
                data = (self.root / rel).read_bytes()
                h.update(rel.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
                n += len(data)
            out[part] = {"files": len(files), "bytes": n, "sha256": h.hexdigest()}
        out["heldout"]["file_list"] = self.heldout_files
        return out


def stdlib_corpus(root: str | Path | None = None) -> Corpus:
    """The corpus of `root` (default: this interpreter's stdlib folder, `sysconfig.get_paths()["stdlib"]`)."""
    root = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise UserError(f"no standard library folder at {root}; pass the path of a Python Lib/ folder")
    files = sorted(rel.as_posix() for rel in (p.relative_to(root) for p in root.rglob("*.py") if p.is_file())
                   if not _excluded(rel))
    if not files:
        raise UserError(f"{root} holds no *.py files outside the excluded folders; is it a Python Lib/ folder?")
    return Corpus(root, tuple(files))
