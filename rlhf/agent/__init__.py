"""Tool-using multi-turn rollouts on the built-in sampler.

* :mod:`rlhf.agent.base`: the Tool base class; :mod:`rlhf.agent.tools`: the registry, the tool config file,
  argument checks;
* :mod:`rlhf.agent.calculator`, :mod:`rlhf.agent.sandbox`: the built-in ``calculator`` and ``python`` tools;
* :mod:`rlhf.agent.parser`: Hermes ``<tool_call>`` parsing; :mod:`rlhf.agent.format`: tool results ->
  the tokens of a tool-response turn (the chat template's own);
* :mod:`rlhf.agent.runner`: tool calls in the reward worker pool (timeouts, crashes) or in-process;
  :mod:`rlhf.agent.tool_worker`: the pool's worker process for tools;
* :mod:`rlhf.agent.loop`: the sampler's TurnHandler; :mod:`rlhf.agent.rollout`: what the trainer holds;
* :mod:`rlhf.agent.demos`: multi-turn demonstrations for supervised warm starts.

Only :mod:`rlhf.agent.rollout` imports torch, so tool worker processes start fast.
"""
