"""The ``distill`` section: on-policy distillation (OPD) from one or more frozen teachers.

The student samples; each teacher scores every sampled token on the training side (a frozen
FSDP2 model built like the reference model, in the trainer's layout); the per-token reverse KL
``log pi_student - log pi_teacher`` becomes the advantage (``algorithm.adv_estimator: opd``)
or a penalty on any estimator's advantages (``distillation_loss_coef``). Names follow verl's
``distillation`` section where it has the same setting (``enabled``, ``distillation_loss_coef``,
``teacher_models.<name>`` -> ``teachers.<name>``) and slime's ``--opd-kl-coef``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


def _f(default: Any, doc: str) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


@dataclass
class TeacherConfig:
    """One teacher (``distill.teachers.<name>``). Its parallel layout is the trainer's mesh: FSDP2 over dp,
    ``parallel.tp`` tensor-parallel, like the reference model."""

    path: str = _f("", "Local HF causal-LM directory of the teacher (verl: teacher_models.<name>.model_path); may "
                       "be larger than the student.")
    tokenizer_path: str = _f("", "Teacher tokenizer; empty = path. A vocabulary other than the student's turns on "
                                 "the cross-tokenizer mode (student text re-tokenized, log-probs mapped back by "
                                 "character spans; rlhf/algos/cross_tokenizer.py).")
    dtype: Literal["", "float32", "bfloat16", "float16"] = _f("", "Teacher weight dtype; empty = model.dtype.")
    param_offload: bool = _f(False, "FSDP2 CPU offload of the teacher's parameters between its forwards.")
    log_prob_micro_batch_size_per_gpu: int = _f(0, "Rows per teacher forward micro-batch; 0 = "
                                                   "actor.log_prob_micro_batch_size_per_gpu.")


@dataclass
class DistillConfig:
    enabled: bool = _f(False, "On-policy distillation: the teachers score the student's rollouts every step "
                              "(verl: distillation.enabled; slime: --use-opd).")
    teachers: dict[str, TeacherConfig] = _f({}, "Teachers by name: distill.teachers.<name>.path, ... (verl: "
                                                "distillation.teacher_models).")
    data_source_teacher: dict = _f({}, "data_source -> teacher name; with several teachers every training "
                                       "data_source must be listed; with one, empty sends every row to it.")
    distillation_loss_coef: float = _f(1.0, "Additive form (any adv_estimator but opd): A_t - coef * KL_t with "
                                            "KL_t = log pi_student - log pi_teacher (verl: "
                                            "distillation_loss_coef; slime: --opd-kl-coef); 0 logs the metrics only.")
