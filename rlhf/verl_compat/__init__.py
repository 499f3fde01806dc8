"""``python -m rlhf.verl_compat ARGS`` (its ``__main__``): the native overrides of a verl command line.

An entry point only; the translation is :mod:`rlhf.config.verl`. Nothing in the package imports it.
A package rather than a module so that the old ``rlhf/verl_compat.py`` reads, to git, as moved to
``rlhf/config/verl.py``.
"""
