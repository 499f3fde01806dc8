"""The base class of tools and the error a tool raises for the model to read.

Apart from the registry (:mod:`rlhf.agent.tools`), which names the built-in tools
(:mod:`rlhf.agent.calculator`, :mod:`rlhf.agent.sandbox`) that subclass :class:`Tool`.
"""

from __future__ import annotations

from typing import Any


class ToolError(Exception):
    """A tool call that failed in a way the model should read about (the message is the observation)."""


class Tool:
    """Base class of tools; ``config`` holds the keyword settings from the tool config file."""

    schema: dict = {}

    def __init__(self, **config: Any) -> None:
        if config:
            raise TypeError(f"{type(self).__name__} takes no config, got {sorted(config)}")

    def __call__(self, **arguments: Any) -> str:
        raise NotImplementedError

    def execute(self, arguments: dict, create_kwargs: dict) -> "str | tuple[str, float]":
        """One call with the trajectory's per-sample kwargs: verl's ``extra_info.tools_kwargs[<tool
        name>].create_kwargs`` of the prompt (e.g. ``{"ground_truth": ...}``), ``{}`` when it has none.
        Return the observation, or ``(observation, step reward)`` (verl's ``execute`` reward; the
        trajectory's step rewards reach the reward function in ``extra_info``). Default: ``self(**arguments)``.
        Calls are independent (tools run in worker processes): what verl keeps per instance between
        ``create`` and ``release`` comes with each call here."""
        return self(**arguments)

    def close(self) -> None:
        """Release what the tool holds (called when its worker ends)."""
