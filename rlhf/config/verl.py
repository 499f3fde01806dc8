"""verl's configuration names, accepted and translated to ours.

A verl command line (``python3 -m verl.trainer.main_ppo actor_rollout_ref.actor.optim.lr=1e-6 ...``)
runs here as ``python train_ppo.py <the same arguments>`` (or under ``torchrun``). Config loading
(:func:`rlhf.config.load.load_config`, yaml files and CLI overrides alike) passes the raw key tree
through :func:`translate`, which moves every verl spelling to the native key and prints, once on
rank 0, what it did with each:

* **mapped**: the same setting under another name (``actor_rollout_ref.actor.optim.lr`` ->
  ``actor.lr``), possibly with a unit change (``ppo_micro_batch_size`` global -> per GPU);
* **accepted with a note**: a setting with no equivalent here that does not change the
  results (``actor_rollout_ref.rollout.name=vllm``: the built-in sampler generates; offload and
  kernel switches; profiler and Ray options);
* **refused** in one line naming the key: a value whose meaning we cannot honour and that
  would change the results (``multi_turn.enable=true``, a custom chat template, megatron ...).

Hydra syntax: ``+key=value`` / ``++key=value`` set the key; ``key=null`` on a verl key keeps
the default. A configuration written only in verl's spelling (no native ``model``, ``actor``,
``rollout``, ``reward``, ``parallel`` or ``checkpoint`` key) also takes verl's defaults where
they differ from ours (``VERL_DEFAULTS``, e.g. ``algorithm.adv_estimator=gae``), and verl's
interpolations (the critic's mini-batch follows the actor's).

The table of keys is :mod:`rlhf.config.verl_keys`; key names and defaults from verl's
``verl/trainer/config/ppo_trainer.yaml`` and its "Config Explanation" page
(docs/examples/config.rst). ``python -m rlhf.verl_compat ARGS`` prints the native overrides
of a verl command line.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import typing
from typing import Any, Optional

from rlhf.config.verl_keys import NATIVE_ONLY_SECTIONS, RULES, VERL_DEFAULTS, VERL_FOLLOWS, VERL_ONLY, Rule, hint_for
from rlhf.schema.config import Config, ConfigError


# --------------------------------------------------------------------------- tree helpers


def _get(tree: dict, dotted: str, default: Any = None) -> Any:
    node: Any = tree
    for k in dotted.split("."):
        if not isinstance(node, dict) or k not in node:
            return default
        node = node[k]
    return node


_MISSING = object()


def _set(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    node[keys[-1]] = value


def has_key(cls: type, dotted: str) -> bool:
    """Whether the dataclass tree of ``cls`` has the dotted field (a dict field takes any subkey)."""
    tp: Any = cls
    for k in dotted.split("."):
        if not dataclasses.is_dataclass(tp):
            return tp is dict
        names = {f.name for f in dataclasses.fields(tp)}
        if k not in names:
            return False
        tp = typing.get_type_hints(tp)[k]
    return True


def _merge(dst: dict, src: dict) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        else:
            dst[k] = v


def _strip_plus(tree: dict) -> dict:
    """Hydra's ``+key`` / ``++key`` (add / force-add a key) set the key here."""
    out: dict = {}
    for k, v in tree.items():
        if isinstance(k, str) and k.startswith("+"):
            continue
        out[k] = v
    for k, v in tree.items():
        if isinstance(k, str) and k.startswith("+"):
            name = k.lstrip("+")
            if isinstance(v, dict) and isinstance(out.get(name), dict):
                _merge(out[name], v)
            else:
                out[name] = v
    return out


def _show(v: Any) -> str:
    if v is None:
        return "null"
    return "{...}" if isinstance(v, dict) and v else repr(v) if isinstance(v, str) else str(v)


# --------------------------------------------------------------------------- translation


class _Translation:
    def __init__(self, cls: type):
        self.cls = cls
        self.values: dict[str, Any] = {}    # native key -> value
        self.source: dict[str, str] = {}    # native key -> the verl key that set it
        self.fallbacks: list[tuple[str, str, Any]] = []
        self.lines: list[str] = []
        self.reward_fn: dict[str, Any] = {}
        self.resume: dict[str, Any] = {}    # trainer.resume_mode / resume_from_path, decided together
        self.errors: list[str] = []         # every refused key, reported at once
        self.count = 0                      # verl keys seen
        self.dp, self.dp_from = 1, "WORLD_SIZE"  # divisor of verl's deprecated global micro-batch sizes

    def set_dp(self, tree: dict) -> None:
        """verl divides a global micro-batch size by ``world // ulysses_sequence_parallel_size``; the world is
        ``trainer.nnodes x n_gpus_per_node`` where both are set (what a one-process dry run plans for and
        a torchrun launch is checked against), else the launched ``WORLD_SIZE``."""
        nodes, gpus = _get(tree, "trainer.nnodes"), _get(tree, "trainer.n_gpus_per_node")
        if isinstance(nodes, int) and isinstance(gpus, int) and nodes > 0 and gpus > 0:
            world, self.dp_from = nodes * gpus, "trainer.nnodes x n_gpus_per_node"
        else:
            world = int(os.environ.get("WORLD_SIZE", "1"))
            self.dp_from = f"WORLD_SIZE {world}"
        sp = next((v for v in (_get(tree, "actor_rollout_ref.actor.ulysses_sequence_parallel_size"),
                               _get(tree, "parallel.sp")) if isinstance(v, int) and v > 0), 1)
        self.dp = max(1, world // sp)
        if sp > 1:
            self.dp_from += f" / ulysses_sequence_parallel_size {sp}"

    def put(self, verl_key: str, native: str, value: Any) -> None:
        if not has_key(self.cls, native):
            raise ConfigError(f"verl key '{verl_key}' maps to '{native}', which this script has no setting for")
        if native in self.values and self.values[native] != value:
            raise ConfigError(f"verl keys '{self.source[native]}' ({self.values[native]!r}) and '{verl_key}' "
                              f"({value!r}) both set {native}; set one of them")
        self.values[native], self.source[native] = value, verl_key

    def apply(self, key: str, rule: Rule, value: Any) -> None:
        if rule.ok is not None:
            if value is not None and value not in rule.ok:
                raise ConfigError(f"verl key '{key}={_show(value)}' is not supported here: {rule.why}")
            self.lines.append(f"{key}={_show(value)}: accepted ({rule.note})")
        elif key in ("trainer.resume_mode", "trainer.resume_from_path"):
            self.resume[key] = value  # decided together in finish(), as verl does
        elif key in ("custom_reward_function.path", "custom_reward_function.name"):
            self.reward_fn[key.rsplit(".", 1)[1]] = value
        elif rule.fallback:
            self.fallbacks.append((key, rule, value))
        elif rule.native:
            if value is None and rule.convert is None:
                self.lines.append(f"{key}=null: default of {rule.native} kept")
                return
            note = rule.note
            if getattr(rule.convert, "needs_dp", False):
                try:
                    pairs = rule.convert(value, self.dp)
                except ConfigError as e:
                    raise ConfigError(f"verl key '{key}={_show(value)}' {e}") from None
                got = next(iter(pairs.values()), None)
                note = (f"global {value} // {self.dp} data-parallel ranks ({self.dp_from})"
                        + (f"; {value} does not divide by {self.dp}, rounded down as verl does"
                           if got is not None and got * self.dp != value else ""))
            else:
                pairs = rule.convert(value) if rule.convert else {rule.native: value}
            for native, v in pairs.items():
                self.put(key, native, v)
            shown = ", ".join(f"{n}={_show(v)}" for n, v in pairs.items()) or "nothing to set"
            self.lines.append(f"{key}={_show(value)} -> {shown}" + (f" ({note})" if note else ""))
        else:
            self.lines.append(f"{key}={_show(value)}: accepted, no effect here ({rule.note})")

    def walk(self, node: dict, prefix: str) -> None:
        for name in list(node):
            key, value = prefix + str(name), node[name]
            if name == "_target_":  # hydra instantiation targets: verl's classes, no setting
                del node[name]
                continue
            rule = RULES.get(key)
            if rule is not None:
                del node[name]
                self.count += 1
                try:
                    self.apply(key, rule, value)
                except ConfigError as e:
                    self.errors.append(str(e))
            elif isinstance(value, dict) and any(r.startswith(key + ".") for r in RULES):
                self.walk(value, key + ".")
                if not value:
                    del node[name]
            elif any(key == p or key.startswith(p + ".") for p in VERL_ONLY):
                del node[name]
                self.count += 1
                self.errors.append(f"verl key '{key}' has no equivalent here{hint_for(key)}")

    def _finish_resume(self) -> None:
        """verl: ``resume_mode`` auto (the default) or disable ignore ``resume_from_path``;
        ``resume_path`` needs it (a ``.../global_step_N`` directory)."""
        if not self.resume:
            return
        mode = self.resume.get("trainer.resume_mode") or "auto"
        path = self.resume.get("trainer.resume_from_path")
        if mode not in ("auto", "disable", "resume_path"):
            raise ConfigError(f"verl key 'trainer.resume_mode={mode}': expected auto, disable or resume_path")
        if mode == "resume_path":
            if not isinstance(path, str) or not path:
                raise ConfigError("verl key 'trainer.resume_mode=resume_path' needs trainer.resume_from_path "
                                  "(a checkpoint directory .../global_step_N); got " + _show(path))
            if "global_step_" not in path:
                raise ConfigError(f"verl key 'trainer.resume_from_path={path}': must name a checkpoint directory "
                                  ".../global_step_N (as in verl)")
            self.put("trainer.resume_from_path", "checkpoint.resume", path)
            self.lines.append(f"trainer.resume_mode='resume_path', trainer.resume_from_path={path!r} -> "
                              f"checkpoint.resume={path!r}")
            return
        self.put("trainer.resume_mode", "checkpoint.resume", mode)
        self.lines.append(f"trainer.resume_mode={mode!r} -> checkpoint.resume={mode!r}")
        if path:
            self.lines.append(f"trainer.resume_from_path={path!r}: ignored, as in verl (used only with "
                              "trainer.resume_mode=resume_path)")

    def finish(self, tree: dict) -> None:
        self._finish_resume()
        if self.reward_fn:
            path = self.reward_fn.get("path")
            if path is None:
                self.lines.append("custom_reward_function.path=null: the registered rewards are used")
            else:
                name = self.reward_fn.get("name") or "compute_score"
                self.put("custom_reward_function.path", "reward.reward_fn", f"{path}:{name}")
                self.lines.append(f"custom_reward_function.path/name -> reward.reward_fn={path}:{name}")
        for native, verl_key in self.source.items():
            have = _get(tree, native, _MISSING)
            if have is not _MISSING and have != self.values[native]:
                raise ConfigError(f"config keys '{native}' ({have!r}) and its verl spelling '{verl_key}' "
                                  f"({self.values[native]!r}) disagree; set one of them")
        for native, v in self.values.items():
            _set(tree, native, v)
        for key, rule, value in self.fallbacks:
            note = f" ({rule.note})" if rule.note else ""
            if value is None or _get(tree, rule.native, _MISSING) is not _MISSING:
                self.lines.append(f"{key}={_show(value)}: accepted, follows {rule.native}{note}")
            elif has_key(self.cls, rule.native):
                _set(tree, rule.native, value)
                self.lines.append(f"{key}={_show(value)} -> {rule.native}{note}")


def _normalize(tree: dict, lines: list[str]) -> None:
    """verl-style values of native keys: ``trainer.logger=console`` (a string), null step counts."""
    trainer = tree.get("trainer")
    if not isinstance(trainer, dict):
        return
    if isinstance(trainer.get("logger"), str):
        trainer["logger"] = [trainer["logger"]]
        lines.append(f"trainer.logger={trainer['logger'][0]!r} -> trainer.logger={trainer['logger']}")
    if "total_training_steps" in trainer and trainer["total_training_steps"] is None:
        trainer["total_training_steps"] = -1
        lines.append("trainer.total_training_steps=null -> -1 (from trainer.total_epochs)")


def _verl_defaults(tree: dict, cls: type) -> list[str]:
    applied = []
    for native, value in VERL_DEFAULTS.items():
        if _get(tree, native, _MISSING) is _MISSING and has_key(cls, native):
            _set(tree, native, value)
            applied.append(f"{native}={_show(value)}")
    if _get(tree, "trainer.output_dir", _MISSING) is _MISSING and has_key(cls, "trainer.output_dir"):
        out = f"checkpoints/{_get(tree, 'trainer.project_name')}/{_get(tree, 'trainer.experiment_name')}"
        _set(tree, "trainer.output_dir", out)  # verl's trainer.default_local_dir
        applied.append(f"trainer.output_dir={out!r}")
    if _get(tree, "checkpoint.save_final", _MISSING) is _MISSING and (_get(tree, "checkpoint.save_freq") or -1) > 0:
        _set(tree, "checkpoint.save_final", True)  # verl also saves at the last step when save_freq > 0
        applied.append("checkpoint.save_final=True")
    for native, source in VERL_FOLLOWS:
        value = _get(tree, source, _MISSING)
        if value is not _MISSING and _get(tree, native, _MISSING) is _MISSING and has_key(cls, native):
            _set(tree, native, value)
            applied.append(f"{native}={_show(value)} (follows {source})")
    return applied


def translate(tree: dict, cls: Optional[type] = None, *, verbose: bool = True) -> dict:
    """The raw key tree (yaml + overrides) with verl's spellings replaced by native keys.

    Prints one line per verl key on rank 0 (``verbose``); raises ``ConfigError`` naming the
    key for a value that cannot be honoured or a key with no equivalent.
    """
    if cls is None:
        cls = Config
    tree = _strip_plus(tree)
    t = _Translation(cls)
    t.set_dp(tree)
    _normalize(tree, t.lines)
    t.walk(tree, "")
    verl_only = t.count > 0 and not any(s in tree for s in NATIVE_ONLY_SECTIONS) and not _native_reward(tree)
    if not t.errors:
        try:
            t.finish(tree)
        except ConfigError as e:
            t.errors.append(str(e))
    if t.errors:  # every refused key at once (and any unknown native key), not one per attempt
        errors = t.errors + [f"unknown config key '{k}'" for k in _unknown(tree, cls)]
        raise ConfigError(errors[0] if len(errors) == 1 else
                          f"{len(errors)} settings cannot be used here: " + "; ".join(errors))
    defaults = _verl_defaults(tree, cls) if verl_only else []
    if verbose and t.lines and int(os.environ.get("RANK", "0")) == 0:
        for line in t.lines:
            print(f"[verl] {line}", flush=True)
        if defaults:
            print("[verl] verl defaults for keys not set (a configuration in verl's spelling only): "
                  + ", ".join(defaults), flush=True)
    return tree


def _unknown(tree: dict, cls: type, prefix: str = "") -> list[str]:
    """Dotted keys of ``tree`` that ``cls`` has no setting for."""
    out = []
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if not has_key(cls, key):
            out.append(key)
        elif isinstance(v, dict) and v and has_key(cls, key + "._") is False:
            out += _unknown(v, cls, key + ".")
    return out


def _native_reward(tree: dict) -> bool:
    """A ``reward`` section with native keys (verl has ``reward.reward_manager`` / ``reward_kwargs`` too)."""
    reward = tree.get("reward")
    return isinstance(reward, dict) and any(k not in ("reward_manager", "reward_kwargs") for k in reward)


# --------------------------------------------------------------------------- verl's yaml shape

# verl's generated trainer configs and its config groups (``actor@actor_rollout_ref.actor: dp_actor``):
# their defaults are this package's (and VERL_DEFAULTS for a verl-only configuration).
VERL_TRAINER_CONFIGS = ("ppo_trainer", "ppo_megatron_trainer", "_generated_ppo_trainer")
VERL_CONFIG_GROUPS = ("actor", "ref", "rollout", "critic", "reward_model", "data", "model", "algorithm", "trainer",
                      "npu_profile", "profiler", "engine", "optim", "reward", "legacy_data", "legacy_reward_impl")


def hydra_yaml(tree: dict, path) -> dict:
    """A yaml in verl's Hydra shape as a plain key tree: ``hydra:`` (search paths, run dirs) is dropped;
    each ``defaults:`` entry is ``_self_``, verl's trainer defaults (``ppo_trainer``: the defaults here
    apply), a verl config group (``actor@actor_rollout_ref.actor: dp_actor``), or a yaml beside ``path``
    (merged first, the file's own keys over it, as Hydra does with ``_self_`` last)."""
    from pathlib import Path

    import yaml

    if not isinstance(tree, dict) or not ({"hydra", "defaults"} & set(tree)):
        return tree
    tree = dict(tree)
    tree.pop("hydra", None)
    defaults = tree.pop("defaults", []) or []
    if not isinstance(defaults, list):
        raise ConfigError(f"{path}: 'defaults' must be a list (Hydra's defaults list)")
    base: dict = {}
    for entry in defaults:
        name = entry if isinstance(entry, str) else next(iter(entry)) if isinstance(entry, dict) and entry else None
        if name is None:
            raise ConfigError(f"{path}: defaults entry {entry!r} is not a name or a group: option mapping")
        name = str(name).lstrip("/").removeprefix("override ")
        if name == "_self_" or name in VERL_TRAINER_CONFIGS or name.split("@")[0] in VERL_CONFIG_GROUPS:
            continue
        other = Path(path).parent / (name if name.endswith((".yaml", ".yml")) else name + ".yaml")
        if not isinstance(entry, str) or not other.is_file():
            raise ConfigError(f"{path}: defaults entry {entry!r} is neither verl's trainer defaults (ppo_trainer), "
                              f"a verl config group, nor a yaml file {other}")
        _merge(base, hydra_yaml(yaml.safe_load(other.read_text()) or {}, other))
    _merge(base, tree)
    return base


# --------------------------------------------------------------------------- launch layout


def launch_world(cfg) -> int:
    """``trainer.nnodes x trainer.n_gpus_per_node`` when both are set (> 0), else 0."""
    t = cfg.trainer
    return t.nnodes * t.n_gpus_per_node if t.nnodes > 0 and t.n_gpus_per_node > 0 else 0


def check_launch_world(cfg, world: int, *, dry_run: bool) -> int:
    """The world size to plan for. A launched world (torchrun) other than verl's
    ``nnodes x n_gpus_per_node`` is refused; a single ``python`` process dry-runs that layout."""
    want = launch_world(cfg)
    if not want or want == world:
        return world
    t = cfg.trainer
    launch = (f"torchrun --nnodes={t.nnodes} --nproc_per_node={t.n_gpus_per_node} "
              f"{os.path.basename(sys.argv[0]) or 'train_ppo.py'} ...")
    if dry_run and "LOCAL_WORLD_SIZE" not in os.environ:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"[verl] trainer.nnodes x trainer.n_gpus_per_node = {want} ranks: planning for {want}; "
                  f"run it with {launch}", flush=True)
        return want
    raise ConfigError(f"trainer.nnodes x trainer.n_gpus_per_node = {t.nnodes} x {t.n_gpus_per_node} = {want} ranks, "
                      f"but {world} were launched; run it with {launch}")
