"""``python -m rlhf.checkpoint export --ckpt DIR --out DIR`` (the command README documents), and nothing else.

An entry point only (its ``__main__`` runs :func:`rlhf.export.main`): the export is :mod:`rlhf.export`, the
DCP save / resume of a run is :mod:`rlhf.train.checkpoint`. Nothing in the package imports it. A package
rather than a module so that the old ``rlhf/checkpoint.py`` reads, to git, as moved to ``rlhf/train/``.
"""
