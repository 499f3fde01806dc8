"""The step: the trainer and its roles (actor, critic), its modes (one_step_off, fully_async in
:mod:`rlhf.train.async_rl`), SFT, checkpoints, and what a step needs around them (prompts, optimizer, validation metrics)."""
