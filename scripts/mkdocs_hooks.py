"""MkDocs hook (mkdocs.yml ``hooks:``): adds the generated reference pages (scripts/docs_reference.py) to the
site at build time, so the configuration, CLI and metrics references are made from the code (the committed copies
of two of them are replaced by what the code gives now)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import docs_reference  # noqa: E402


def on_files(files, config):
    from mkdocs.structure.files import File

    for path, text in docs_reference.pages().items():
        stale = files.get_file_from_path(path)  # a copy written into docs/ by hand: the build's own wins
        if stale is not None:
            files.remove(stale)
        files.append(File.generated(config, path, content=text))
    return files
