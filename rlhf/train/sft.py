"""Supervised fine-tuning (the warm-start before RL), on the same FSDP2 / optim / export code.

Data: jsonl or parquet rows ``{"prompt": chat messages or string, "response": str}``; a
multi-turn tool-use demonstration has a list of assistant / tool messages as its response
(:mod:`rlhf.agent.demos`), tokenised exactly as the agent loop builds a trajectory.
A vision-language ``model.path`` (Qwen2-VL / Qwen2.5-VL / Qwen3-VL with its processor) reads the rows'
images (``sft.image_key``, verl's multimodal schema: one ``<image>`` placeholder per image in the
prompt); each example keeps its ``pixel_values`` / ``image_grid_thw`` and the forwards run the vision
tower (trained unless ``model.freeze_vision_tower``) as the RL trainer's do.
Loss: cross-entropy on response tokens (and the closing EOS) only, never on tool results,
normalised by the global number of such tokens of the batch, so it is independent of the dp size.

Model settings shared with RL: LoRA (``model.lora_rank``: only the adapters train; the
export holds the merged model and the PEFT adapter), ``model.param_offload``,
``model.enable_gradient_checkpointing``, ``model.trust_remote_code``, and
``model.use_remove_padding`` (verl's name): the real tokens of a micro-batch are packed into
one row with per-sequence attention (:mod:`rlhf.models.packed`, the RL trainer's padding-free
path), so pads cost nothing; same loss as the padded pass. Layout: data parallel only;
tensor / pipeline / sequence parallelism are refused in one line at load time, never ignored.
"""

from __future__ import annotations

import dataclasses
import json
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pyarrow.parquet as pq
import torch

from rlhf.config.checks import check_logger
from rlhf.data.dataset import DataError
from rlhf.data.multimodal import collate_multi_modal
from rlhf.data.loader import PromptLoader
from rlhf.models.fsdp import grad_scale
from rlhf.models.loading import check_model_dir, load_causal_lm, load_tokenizer, vision_tower
from rlhf.models.logprobs import forward_log_probs
from rlhf.models.lora import apply_lora
from rlhf.models.packed import packed_forward_log_probs
from rlhf.models.parallel import ParallelDims, all_reduce_sum, init_distributed
from rlhf.models.parallelize import parallelize_model
from rlhf.models.vlm import dummy_image_forward
from rlhf.ops.metrics import MetricsLogger
from rlhf.schema.config import ConfigError, ModelConfig, ParallelConfig, _f
from rlhf.train.checkpoint import export_hf
from rlhf.train.optim import build_optimizer, build_scheduler, clip_grad_norm


@dataclass
class SFTSettings:
    train_files: str = _f("", "jsonl/parquet with prompt + response columns.")
    prompt_key: str = _f("prompt", "Prompt column (chat messages or string).")
    response_key: str = _f("response", "Response column: a string, or a list of assistant / tool messages.")
    image_key: str = _f("images", "Images column of a vision-language model's rows (verl: data.image_key).")
    tool_config_path: str = _f("", "Tools (rollout.multi_turn.tool_config_path's file) listed in the prompt by the "
                                   "chat template, as the RL prompts list them; empty = none.")
    max_length: int = _f(256, "Prompt + response tokens; longer rows are skipped and counted.")
    train_batch_size: int = _f(64, "Sequences per optimizer step (global).")
    micro_batch_size_per_gpu: int = _f(32, "Sequences per forward/backward per rank.")
    total_epochs: int = _f(1, "Epochs over the data.")
    lr: float = _f(1e-3, "Peak learning rate.")
    weight_decay: float = _f(0.01, "AdamW weight decay.")
    betas: list = _f([0.9, 0.95], "AdamW betas.")
    lr_warmup_steps_ratio: float = _f(0.05, "Warmup fraction.")
    warmup_style: str = _f("cosine", "constant or cosine.")
    grad_clip: float = _f(1.0, "Max gradient norm.")
    seed: int = _f(0, "Data order seed.")


@dataclass
class SFTRunConfig:
    output_dir: str = _f("outputs/sft", "Run directory; the model is exported to <output_dir>/hf_export.")
    device: str = _f("auto", "auto, cpu or cuda.")
    seed: int = _f(0, "Torch seed.")
    logger: list = _f(["console", "jsonl"], "Metric backends.")
    log_freq: int = _f(10, "Log every N steps.")


@dataclass
class SFTConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    sft: SFTSettings = field(default_factory=SFTSettings)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    trainer: SFTRunConfig = field(default_factory=SFTRunConfig)

    def to_yaml(self) -> str:
        import yaml
        return yaml.safe_dump(dataclasses.asdict(self), sort_keys=False)


def validate_sft(cfg: SFTConfig) -> None:
    check_logger(cfg.trainer.logger)
    if not cfg.model.path:
        raise ConfigError("config key 'model.path': is required")
    if not cfg.sft.train_files:
        raise ConfigError("config key 'sft.train_files': is required")
    if cfg.sft.train_batch_size <= 0 or cfg.sft.micro_batch_size_per_gpu <= 0:
        raise ConfigError("config keys 'sft.train_batch_size' and 'sft.micro_batch_size_per_gpu' must be > 0")
    if cfg.model.lora_rank < 0:
        raise ConfigError("config key 'model.lora_rank': must be >= 0")
    # Settings of the shared model / parallel sections that SFT does not implement: refused, not ignored.
    for key, value, default in (("parallel.tp", cfg.parallel.tp, 1), ("parallel.pp", cfg.parallel.pp, 1),
                                ("parallel.sp", cfg.parallel.sp, 1)):
        if value != default:
            raise ConfigError(f"config key '{key}': SFT runs data parallel only; set {key}={default} (got {value})")


def _read_rows(path: str) -> list:
    p = Path(path)
    if not p.is_file():
        raise DataError(f"sft.train_files: file not found: {path}")
    if p.suffix == ".parquet":
        return pq.read_table(p).to_pylist()
    rows = []
    for i, line in enumerate(p.read_text().splitlines()):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                rows.append(DataError(f"line {i + 1}: invalid JSON ({e.msg})"))
    return rows


# prompt ids, response ids, loss mask over the response[, the prompt's images (None or absent: text only)]
Example = tuple[list[int], list[int], list[int], Optional[dict]]


def tokenize_sft(rows: list, tokenizer, s: SFTSettings, processor=None) -> tuple[list[Example], dict]:
    """(prompt_ids, response_ids + eos, loss mask, images) per usable row; bad or too-long rows skipped
    and counted. With a VLM's ``processor`` a row's images expand its ``<image>`` placeholders."""
    out, bad, too_long = [], 0, 0
    tools, obs_format = None, None
    if s.tool_config_path:
        from rlhf.agent.tools import load_tool_config, tool_schemas

        tools = tool_schemas(load_tool_config(s.tool_config_path, "sft.tool_config_path"))
    for row in rows:
        response = row.get(s.response_key) if isinstance(row, dict) else None
        if not isinstance(row, dict) or s.prompt_key not in row or not isinstance(response, (str, list)):
            bad += 1
            continue
        prompt = row[s.prompt_key]
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if tokenizer.chat_template:
            p_ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, tools=tools)
            if isinstance(p_ids, dict) or hasattr(p_ids, "input_ids"):
                p_ids = p_ids["input_ids"]
        else:
            p_ids = tokenizer.encode("\n".join(m["content"] for m in prompt))
        mm = None
        if processor is not None and row.get(s.image_key):
            try:
                text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False, tools=tools) \
                    if tokenizer.chat_template else "\n".join(m["content"] for m in prompt)
                p_ids, mm = prompt_images(processor, text, row[s.image_key], s.train_files)
            except ValueError:
                bad += 1
                continue
        if isinstance(response, str):
            r_ids = tokenizer.encode(response, add_special_tokens=False) + [tokenizer.eos_token_id]
            r_mask = [1] * len(r_ids)
        else:
            from rlhf.agent.demos import tokenize_demo
            from rlhf.agent.format import ObservationFormat

            obs_format = obs_format or ObservationFormat(tokenizer, max_tool_response_length=0)
            try:
                r_ids, r_mask = tokenize_demo(tokenizer, response, obs_format)
            except ValueError:
                bad += 1
                continue
        if len(p_ids) + len(r_ids) > s.max_length:
            too_long += 1
            continue
        out.append((list(p_ids), r_ids, r_mask, mm))
    if not out:
        raise DataError(f"sft.train_files: no usable rows ({bad} malformed, {too_long} longer than sft.max_length)")
    return out, {"n_rows": len(rows), "n_malformed": bad, "n_too_long": too_long, "n_loaded": len(out)}


def prompt_images(processor, prompt_text: str, images: list, data_file: str) -> tuple[list[int], dict]:
    """Ids and processor inputs of a templated prompt whose ``<image>`` placeholders are ``images``."""
    from rlhf.data.multimodal import decode_image, expand_placeholders, process_images

    pics = [decode_image(x, Path(data_file).parent) for x in images]
    return process_images(processor, expand_placeholders(prompt_text, len(pics)), pics)


def collate(examples: list[Example], pad_id: int) -> tuple[torch.Tensor, ...]:
    """The RL trainer's layout: left-padded prompts then right-padded responses, ``input_ids`` and
    ``attention_mask [B, P + R]``, and the loss mask of the responses ``[B, R]`` (0 on tool results)."""
    P = max(len(e[0]) for e in examples)
    R = max(len(e[1]) for e in examples)
    ids = torch.full((len(examples), P + R), pad_id, dtype=torch.long)
    attn = torch.zeros((len(examples), P + R), dtype=torch.long)
    loss_mask = torch.zeros((len(examples), R), dtype=torch.float32)
    for i, (p, r, m) in enumerate(e[:3] for e in examples):
        ids[i, P - len(p):P], ids[i, P:P + len(r)] = torch.tensor(p), torch.tensor(r)
        attn[i, P - len(p):P + len(r)] = 1
        loss_mask[i, :len(r)] = torch.tensor(m, dtype=torch.float32)
    return ids, attn, loss_mask


def sft_loss(model: torch.nn.Module, examples: list[Example], pad_id: int, n_tok: torch.Tensor, device: torch.device,
             *, packed: bool) -> torch.Tensor:
    """Cross-entropy summed over the loss-masked response tokens of ``examples``, divided by ``n_tok``
    (the global count of such tokens of the step), through the RL trainer's log-prob passes:
    ``packed`` padding-free (one packed row, per-sequence attention), else the padded batch; both
    project to the vocabulary only where a response token is predicted."""
    ids, attn, mask = (t.to(device) for t in collate(examples, pad_id))
    forward = packed_forward_log_probs if packed else forward_log_probs
    mm = collate_multi_modal([e[3] if len(e) > 3 else None for e in examples])
    # a VLM micro-batch without images runs the tower on a dummy one: its FSDP2 collectives stay in step
    ctx = dummy_image_forward(model, device) if mm is None and vision_tower(model) is not None else nullcontext()
    with ctx:
        log_probs, _ = forward(model, ids, attn, response_length=mask.shape[1], multi_modal=mm)
    return -(log_probs * mask).sum() / n_tok


def _setup(cfg: SFTConfig) -> tuple:
    """Everything a dry run checks: process group and layout, model directory, tokenizer, data."""
    env = init_distributed(cfg.trainer.device)
    torch.manual_seed(cfg.trainer.seed)
    dims = ParallelDims.resolve(cfg.parallel.dp, 1, 1, env.world_size)
    if cfg.sft.train_batch_size % dims.dp:
        raise ConfigError(f"sft.train_batch_size ({cfg.sft.train_batch_size}) is not divisible by dp ({dims.dp})")
    mesh = dims.build_mesh(env.device.type)
    check_model_dir(cfg.model.path)
    tokenizer = load_tokenizer(cfg.model.tokenizer_path or cfg.model.path, cfg.model.trust_remote_code,
                               key="model.tokenizer_path" if cfg.model.tokenizer_path else "model.path")
    processor = sft_processor(cfg.model)
    data, stats = tokenize_sft(_read_rows(cfg.sft.train_files), tokenizer, cfg.sft, processor)
    if env.is_main:
        print(f"[rlhf.train.sft] data: {stats}; layout dp={dims.dp} world={env.world_size} device={env.device}", flush=True)
    return env, dims, mesh, processor or tokenizer, data


def sft_processor(m: ModelConfig):
    """The processor of a vision-language ``model.path`` (its rows' images are then read), else None."""
    from rlhf.models.loading import model_config
    from rlhf.models.mrope import is_vlm_config
    from rlhf.models.processor import load_processor

    if not is_vlm_config(model_config(m.path, m.trust_remote_code)):
        return None
    return load_processor(m.path, m.trust_remote_code)


def _build_model(cfg: SFTConfig, mesh, device: torch.device) -> torch.nn.Module:
    m = cfg.model
    model = load_causal_lm(m.path, dtype=m.dtype, attn_implementation=m.attn_implementation,
                           trust_remote_code=m.trust_remote_code, deferred=m.lora_rank == 0)
    if m.freeze_vision_tower:
        visual = vision_tower(model)
        if visual is None:
            raise ConfigError(f"model.freeze_vision_tower: {m.path} has no vision tower")
        visual.requires_grad_(False)
    if m.lora_rank > 0:  # only the adapters are trainable, so only they get gradients and optimizer state
        try:
            model = apply_lora(model, lora_rank=m.lora_rank, lora_alpha=m.lora_alpha, target_modules=m.target_modules)
        except ValueError as e:
            raise ConfigError(f"model.target_modules: {e}") from None
    return parallelize_model(model, mesh, cfg.parallel, device, mixed_precision=m.mixed_precision,
                             param_offload=m.param_offload, load_ranks_per_node=m.load_ranks_per_node,
                             activation_checkpointing=m.enable_gradient_checkpointing, fsdp_unit=m.fsdp_unit).module


def run_sft(cfg: SFTConfig, *, dry_run: bool = False) -> dict:
    """Train and export; with ``dry_run`` stop after the checks of :func:`_setup` (nothing written)."""
    env, dims, mesh, tokenizer, data = _setup(cfg)  # a VLM's processor in place of its tokenizer (exported)
    if dry_run:
        return {}
    dp_rank, dp_group = mesh["dp"].get_local_rank(), mesh["dp"].get_group()
    out_dir = Path(cfg.trainer.output_dir)
    if env.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(cfg.to_yaml())
    model = _build_model(cfg, mesh, env.device)
    loader = PromptLoader(len(data), cfg.sft.train_batch_size, seed=cfg.sft.seed, shuffle=True)
    total = cfg.sft.total_epochs * loader.steps_per_epoch
    opt = build_optimizer(model.parameters(), lr=cfg.sft.lr, weight_decay=cfg.sft.weight_decay, betas=cfg.sft.betas)
    sched = build_scheduler(opt, total_steps=total, warmup_steps=-1, warmup_ratio=cfg.sft.lr_warmup_steps_ratio,
                            style=cfg.sft.warmup_style)
    logger = MetricsLogger(out_dir, backends=cfg.trainer.logger, total_steps=total, rank=env.rank,
                           experiment="sft", console_keys=("sft/loss", "sft/grad_norm", "sft/lr"),
                           config=dataclasses.asdict(cfg))
    model.train()
    pad_id = getattr(tokenizer, "tokenizer", tokenizer).pad_token_id
    last = {}
    for step in range(1, total + 1):
        examples = [data[i] for i in loader.shard(loader.next_batch(), dp_rank, dims.dp)]
        n_tok = all_reduce_sum(torch.tensor(float(sum(sum(e[2]) for e in examples)), dtype=torch.float64,
                                            device=env.device), dp_group)
        opt.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64, device=env.device)
        mbs = cfg.sft.micro_batch_size_per_gpu
        for s in range(0, len(examples), mbs):
            loss = sft_loss(model, examples[s:s + mbs], pad_id, n_tok, env.device,
                            packed=cfg.model.use_remove_padding)
            (loss * grad_scale(mesh["dp"])).backward()
            loss_sum += loss.detach().double()
        all_reduce_sum(loss_sum, dp_group)
        gn = clip_grad_norm(model.parameters(), cfg.sft.grad_clip, device=env.device)
        opt.step()
        sched.step()
        last = {"sft/loss": loss_sum.item(), "sft/grad_norm": float(gn), "sft/lr": opt.param_groups[0]["lr"]}
        if step % cfg.trainer.log_freq == 0 or step == total:
            logger.log(step, last)
    export_hf(model, tokenizer, str(out_dir / "hf_export"))
    if env.is_main:
        print(f"[rlhf.train.sft] exported {out_dir / 'hf_export'} after {total} steps, final loss {last.get('sft/loss'):.4f}",
              flush=True)
    logger.close()
    return last
