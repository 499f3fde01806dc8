"""``python -m rlhf.planner``: the memory plan of a config (see :mod:`rlhf.planner`)."""

from rlhf.planner.plan import main

main()
