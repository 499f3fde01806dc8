"""``python -m rlhf.checkpoint export --ckpt DIR --out DIR``: the command README documents.

Only a ``python -m`` entry: the export is :mod:`rlhf.export`, the DCP save / resume of a run is
:mod:`rlhf.train.checkpoint`. Nothing in the package imports this module (it would run nothing).
"""

if __name__ == "__main__":
    from rlhf.export import main

    main()
