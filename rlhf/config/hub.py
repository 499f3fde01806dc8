"""Hugging Face hub names (``Qwen/Qwen2.5-0.5B-Instruct``) resolved from the local HF cache, offline.

Nothing is downloaded at run time. A name that is not a local directory is looked up in
the cache that ``huggingface-cli download`` fills: ``$HF_HUB_CACHE``, else
``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``, in its snapshots layout::

    models--Qwen--Qwen2.5-0.5B-Instruct/
        refs/main                  the commit hash the name points at
        snapshots/<hash>/          config.json, tokenizer files, *.safetensors

When the model is not there, one line says how to download it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from rlhf.schema.config import ConfigError

# ``org/name`` as the hub spells repository ids (letters, digits, ``-_.``; one slash).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")

# Config keys that name a model directory.
MODEL_KEYS = ("model.path", "model.tokenizer_path", "critic.model_path", "reward.reward_model.path",
              "reward.reward_model.tokenizer_path")


def hub_cache_dir() -> Path:
    """The hub cache directory, read from the environment at each call."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def is_hub_name(path: str) -> bool:
    """``org/name`` that is not an existing local path."""
    return bool(_HUB_ID.match(path)) and not Path(path).expanduser().exists()


def cached_snapshot(name: str, cache: Path | None = None) -> Path | None:
    """The snapshot directory ``refs/main`` points at (or the only snapshot), else None."""
    repo = (cache or hub_cache_dir()) / ("models--" + name.replace("/", "--"))
    ref = repo / "refs" / "main"
    if ref.is_file():
        snap = repo / "snapshots" / ref.read_text().strip()
        return snap if snap.is_dir() else None
    snaps = sorted(p for p in (repo / "snapshots").glob("*") if p.is_dir())
    return snaps[0] if len(snaps) == 1 else None


def resolve_model_path(path: str, key: str = "model.path") -> str:
    """A local directory as given; a hub name -> its cached snapshot; else one line naming the download."""
    if not path or not is_hub_name(path):
        return path
    snap = cached_snapshot(path)
    if snap is None:
        raise ConfigError(f"{key}: '{path}' is neither a local directory nor in the Hugging Face cache "
                          f"({hub_cache_dir()}); nothing is downloaded at run time, so download it first: "
                          f"huggingface-cli download {path}")
    return str(snap)


def resolve_hub_names(tree: dict) -> None:
    """Replace hub names under :data:`MODEL_KEYS` of a raw config tree by their snapshot paths."""
    for dotted in MODEL_KEYS:
        *parents, leaf = dotted.split(".")
        node = tree
        for k in parents:
            node = node.get(k) if isinstance(node, dict) else None
        if not isinstance(node, dict) or not isinstance(node.get(leaf), str):
            continue
        path = resolve_model_path(node[leaf], dotted)
        if path != node[leaf]:
            if int(os.environ.get("RANK", "0")) == 0:
                print(f"[rlhf] {dotted}: {node[leaf]} -> {path} (Hugging Face cache)", flush=True)
            node[leaf] = path
