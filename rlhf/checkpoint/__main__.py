"""``python -m rlhf.checkpoint export ...``: runs :func:`rlhf.export.main`."""

if __name__ == "__main__":
    from rlhf.export import main

    main()
