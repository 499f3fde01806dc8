"""Suggestions for an unknown config key: the "did you mean" part of its error.

A hint must point at the key the user meant or say nothing: the same name in another
section first (``trainer.save_freq`` -> ``checkpoint.save_freq``), else close spellings
in the key's own section, else close spellings anywhere. Loose matches mislead
(``trainer.nnodes`` -> ``trainer.mode``), so only close ones are offered.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing


def _dotted_keys(cls: type, prefix: str = "") -> list[str]:
    """Every key of the tree under ``cls``, sections included (``trainer``, ``trainer.val_kwargs``, ...)."""
    out = []
    for f in dataclasses.fields(cls):
        out.append(prefix + f.name)
        tp = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            out += _dotted_keys(tp, prefix + f.name + ".")
    return out


def near_keys(root: type, prefix: str, key: str, names: list[str]) -> list[str]:
    """Up to three dotted keys the user probably meant by the unknown ``prefix + key`` (see the module
    docstring); ``root`` is the config's root dataclass, ``names`` the keys of the key's section."""
    everywhere = _dotted_keys(root)
    same_leaf = [k for k in everywhere if k.rsplit(".", 1)[-1] == key]
    if same_leaf:
        return same_leaf[:3]
    near = [prefix + n for n in _closest(key, names, cutoff=0.75)]
    if near:
        return near
    close = _closest(key, {k.rsplit(".", 1)[-1] for k in everywhere}, cutoff=0.8)
    return [k for k in everywhere if k.rsplit(".", 1)[-1] in close][:3]


def _closest(word: str, candidates, cutoff: float) -> list[str]:
    """The candidates at least `cutoff` similar to `word` and about as similar as the best one."""
    scored = sorted(((difflib.SequenceMatcher(None, word, c).ratio(), c) for c in candidates), reverse=True)
    return [c for r, c in scored if r >= cutoff and r >= scored[0][0] - 0.05][:3]
