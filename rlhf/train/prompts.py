"""The training prompts of a run: the dataset, the resumable loader, a step's prompt batch.

Shared by the trainer and the rollout role of trainer.mode one_step_off, which draw the
same batches in the same order.
"""

from __future__ import annotations

from pathlib import Path

from rlhf.data.dataset import load_prompt_dataset
from rlhf.data.loader import PromptLoader
from rlhf.schema.batch import PromptBatch
from rlhf.schema.config import Config, ConfigError


def load_data(cfg: Config, files, tokenizer):
    """A prompt file (or list) with the ``data.*`` settings."""
    d = cfg.data
    tools = None
    if cfg.rollout.multi_turn.enable:  # the chat template lists the tools in the prompt
        from rlhf.agent.tools import load_tool_config, tool_schemas

        tools = tool_schemas(load_tool_config(cfg.rollout.multi_turn.tool_config_path))
    return load_prompt_dataset(files, tokenizer, prompt_key=d.prompt_key, max_prompt_length=d.max_prompt_length,
                               truncation=d.truncation, filter_overlong_prompts=d.filter_overlong_prompts,
                               apply_chat_template=d.apply_chat_template, tools=tools,
                               processor=vlm_processor(cfg), image_key=d.image_key)


def vlm_processor(cfg: Config):
    """The processor of a vision-language ``model.path`` (its images column is then read), else None."""
    from rlhf.models.loading import model_config
    from rlhf.models.mrope import is_vlm_config
    from rlhf.models.processor import load_processor

    # (a missing model directory is reported where the model is loaded, with its own message)
    if not cfg.model.path or not (Path(cfg.model.path).expanduser() / "config.json").is_file() or \
            not is_vlm_config(model_config(cfg.model.path, cfg.model.trust_remote_code)):
        return None
    return load_processor(cfg.model.path, cfg.model.trust_remote_code)


def make_loader(cfg: Config, dataset_len: int) -> tuple[PromptLoader, int]:
    """The training prompt loader and the run's total steps."""
    gen_bs = cfg.data.gen_batch_size if cfg.algorithm.filter_groups.enable and cfg.data.gen_batch_size > 0 \
        else cfg.data.train_batch_size
    if gen_bs % cfg.actor.ppo_mini_batch_size:
        raise ConfigError(f"data.gen_batch_size ({gen_bs}) must be a multiple of actor.ppo_mini_batch_size "
                          f"({cfg.actor.ppo_mini_batch_size})")
    if dataset_len < gen_bs:  # verl's loader drops the last partial batch: not one step would run
        key = "data.gen_batch_size" if gen_bs != cfg.data.train_batch_size else "data.train_batch_size"
        raise ConfigError(f"{key} ({gen_bs}) is larger than the {dataset_len} training prompts of data.train_files "
                          f"(after filtering); lower {key} to at most {dataset_len}")
    loader = PromptLoader(dataset_len, gen_bs, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    steps = cfg.trainer.total_epochs * loader.steps_per_epoch
    return loader, steps if cfg.trainer.total_training_steps < 0 else cfg.trainer.total_training_steps


def prompt_batch(indices: list[int], examples) -> PromptBatch:
    """The dataset ``examples`` at ``indices`` as the sampler's prompt batch."""
    ex = [examples[i] for i in indices]
    return PromptBatch(prompt_ids=[e.prompt_ids for e in ex], keys=[e.index for e in ex],
                       ground_truths=[e.ground_truth for e in ex], data_sources=[e.data_source for e in ex],
                       extra_infos=[e.extra_info for e in ex],
                       multi_modal=[e.multi_modal for e in ex] if any(e.multi_modal is not None for e in ex) else [])


def data_metrics(loader: PromptLoader, global_idx: list[int]) -> dict[str, float]:
    """Epoch and a fingerprint of the global data order, so a resumed run can be checked against the original."""
    return {"data/epoch": float(loader.epoch),
            "data/batch_fingerprint": float(sum((i + 1) * (k + 1) for k, i in enumerate(global_idx)) % 1000003)}
