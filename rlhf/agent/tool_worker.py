"""Entry point of one tool worker process (started by :class:`rlhf.agent.runner.ToolPool`).

    python -m rlhf.agent.tool_worker <fd>

The reward worker's loop and protocol (:mod:`rlhf.rewards.worker`) with the tools of the
``("init_tools", tool_specs)`` message as the runner. Imports neither torch nor the training code.
"""

from __future__ import annotations

import sys

from rlhf.agent.tools import ToolSet
from rlhf.rewards.worker import main


def _tool_runner(tool_specs):
    return ToolSet(tool_specs).run


if __name__ == "__main__":
    main(int(sys.argv[1]), _tool_runner)
