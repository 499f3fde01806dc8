"""The distillation phase: frozen teachers score the student's rollouts on the training side.

Each teacher (``distill.teachers.<name>``) is a frozen :class:`PolicyWorker` built the way the
reference model is: FSDP2-sharded over dp, ``parallel.tp`` tensor-parallel, in the trainer's
mesh, so it runs wherever the trainer's training side runs (colocated, and the training role of
one_step_off / fully_async). After the student's old log-probs, :meth:`Distiller.score` fills
``batch.teacher_log_probs [N, R]``; the estimator ``opd`` turns them into advantages, or
:meth:`Distiller.shape_advantages` adds ``-coef * KL_t`` to another estimator's (math in
``rlhf/algos/distill.py``). Rows go to their teacher by ``data_source``
(``distill.data_source_teacher``). A teacher with another vocabulary scores the student's text
re-tokenized with its own tokenizer; its log-probs come back by character spans
(``rlhf/algos/cross_tokenizer.py``). Tokens without a teacher value get the student's own
log-prob (KL 0) and are left out of the metrics.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from rlhf.algos.cross_tokenizer import map_by_spans, piece_spans
from rlhf.algos.distill import add_opd_term, distill_sums
from rlhf.models.loading import load_tokenizer
from rlhf.models.parallel import all_reduce_max, all_reduce_sum
from rlhf.schema.batch import RolloutBatch
from rlhf.schema.config import Config, ConfigError
from rlhf.train.actor import PolicyWorker


class Teacher:
    """One frozen teacher: its worker, tokenizer and whether the student's ids need re-tokenizing."""

    def __init__(self, name: str, cfg: Config, mesh, device: torch.device, student_tokenizer):
        t = cfg.distill.teachers[name]
        key = f"distill.teachers.{name}"
        if not t.path:
            raise ConfigError(f"{key}.path: set the teacher's HF model directory")
        model_cfg = dataclasses.replace(cfg.model, path=t.path, tokenizer_path=t.tokenizer_path,
                                        dtype=t.dtype or cfg.model.dtype, param_offload=t.param_offload,
                                        lora_rank=0, enable_gradient_checkpointing=False)
        self.name = name
        self.micro_batch_size = t.log_prob_micro_batch_size_per_gpu or cfg.actor.log_prob_micro_batch_size_per_gpu
        # the actor's micro-batching settings, never its MoE routes (another model's experts)
        self.worker = PolicyWorker(model_cfg, mesh, device, trainable=False, lora=False, parallel_cfg=cfg.parallel,
                                   actor_cfg=dataclasses.replace(cfg.actor, router_replay="none"))
        if self.worker.is_vlm:
            raise ConfigError(f"{key}.path: vision-language teachers are not supported yet; use a text model")
        self.tokenizer = load_tokenizer(t.tokenizer_path or t.path, cfg.model.trust_remote_code,
                                        key=f"{key}.tokenizer_path" if t.tokenizer_path else f"{key}.path")
        self.cross = self.tokenizer.get_vocab() != student_tokenizer.get_vocab()

    def log_probs(self, batch: RolloutBatch, student_tokenizer, temperature: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(teacher log-probs [N, R], valid [N, R] bool)`` in the student's token layout."""
        if not self.cross:
            lp, _ = self.worker.compute_log_probs(batch, temperature=temperature, micro_batch_size=self.micro_batch_size)
            return lp, torch.ones_like(lp, dtype=torch.bool)
        tbatch, maps = retokenize(batch, student_tokenizer, self.tokenizer)
        lp, _ = self.worker.compute_log_probs(tbatch, temperature=temperature, micro_batch_size=self.micro_batch_size)
        return map_back(lp, tbatch, maps, batch)


def retokenize(batch: RolloutBatch, student_tok, teacher_tok) -> tuple[RolloutBatch, list]:
    """The student's rows as the teacher's tokens: left-padded prompt | right-padded response, with
    per row the student response spans and the teacher spans needed by :func:`map_back`."""
    R = batch.response_length
    rows, maps = [], []
    mask = batch.attention_mask.bool().cpu()
    ids = batch.input_ids.cpu()
    for i in range(len(batch)):
        p_ids = ids[i, :-R][mask[i, :-R]].tolist()
        r_pos = mask[i, -R:].nonzero().squeeze(-1).tolist()
        r_ids = ids[i, -R:][r_pos].tolist()
        p_text = student_tok.decode(p_ids, skip_special_tokens=False)
        pieces = [student_tok.decode([t], skip_special_tokens=False) for t in r_ids]
        text = p_text + "".join(pieces)
        enc = teacher_tok(text, add_special_tokens=False, return_offsets_mapping=True)
        t_ids, offs = enc["input_ids"], [tuple(o) for o in enc["offset_mapping"]]
        n_prompt = sum(1 for a, b in offs if b <= len(p_text))
        rows.append((t_ids[:n_prompt], t_ids[n_prompt:]))
        maps.append((r_pos, piece_spans(pieces, len(p_text)), offs, n_prompt))
    P = max(1, max(len(p) for p, _ in rows))
    Rt = max(1, max(len(r) for _, r in rows))
    pad = teacher_tok.pad_token_id if teacher_tok.pad_token_id is not None else 0
    input_ids = torch.full((len(rows), P + Rt), pad, dtype=torch.long)
    attn = torch.zeros_like(input_ids)
    for i, (p, r) in enumerate(rows):
        input_ids[i, P - len(p):P] = torch.tensor(p, dtype=torch.long)
        input_ids[i, P:P + len(r)] = torch.tensor(r, dtype=torch.long)
        attn[i, P - len(p):P + len(r)] = 1
    dev = batch.input_ids.device
    resp_mask = attn[:, P:].float()
    tb = RolloutBatch(input_ids=input_ids.to(dev), attention_mask=attn.to(dev), responses=input_ids[:, P:].to(dev),
                      response_mask=resp_mask.to(dev), index=batch.index, rollout_log_probs=resp_mask.to(dev) * 0,
                      truncated=batch.truncated)
    return tb, maps


def map_back(lp: torch.Tensor, tbatch: RolloutBatch, maps: list, batch: RolloutBatch
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher log-probs [N, R_teacher] -> the student's response tokens [N, R] and their valid mask."""
    out = torch.zeros(len(batch), batch.response_length, dtype=torch.float32)
    valid = torch.zeros(len(batch), batch.response_length, dtype=torch.bool)
    lp_host = lp.float().cpu()
    for i, (r_pos, s_spans, offs, n_prompt) in enumerate(maps):
        n_resp = len(offs) - n_prompt
        t_lp = [float("nan")] * n_prompt + lp_host[i, :n_resp].tolist()
        if n_prompt == 0 and t_lp:  # a first token has no context to be scored in
            t_lp[0] = float("nan")
        vals, ok = map_by_spans(s_spans, offs, t_lp)
        if r_pos:
            out[i, r_pos] = torch.tensor(vals)
            valid[i, r_pos] = torch.tensor(ok)
    return out.to(lp.device, lp.dtype), valid.to(lp.device)


class Distiller:
    """The teachers of a run and the two things the step asks of them (module docstring)."""

    def __init__(self, cfg: Config, mesh, device: torch.device, student_tokenizer, data_sources: set):
        d = cfg.distill
        if not d.teachers:
            raise ConfigError("distill.teachers: distill.enabled needs a teacher, e.g. distill.teachers.teacher.path=DIR")
        self.cfg, self.device, self.student_tokenizer = cfg, device, student_tokenizer
        self.dp_group = mesh["dp"].get_group()
        self.names = list(d.teachers)
        check_routing(d.data_source_teacher, self.names, data_sources)
        self.route = dict(d.data_source_teacher)
        self.teachers = {n: Teacher(n, cfg, mesh, device, student_tokenizer) for n in self.names}
        self.opd_estimator = cfg.algorithm.adv_estimator == "opd"

    def _rows(self, batch: RolloutBatch) -> dict[str, list[int]]:
        if len(self.names) == 1 and not self.route:
            return {self.names[0]: list(range(len(batch)))}
        rows = {n: [] for n in self.names}
        for i, src in enumerate(batch.data_sources):
            rows[self.route.get(src, self.names[0])].append(i)
        return rows

    @torch.no_grad()
    def score(self, batch: RolloutBatch, temperature: float) -> dict[str, float]:
        """``batch.teacher_log_probs [N, R]`` from each row's teacher; global ``distill/*`` metrics."""
        student = batch.old_log_probs
        teacher_lp = student.clone()  # KL 0 where no teacher value
        sums, unmapped = {}, {}
        for name, rows in self._rows(batch).items():
            t = self.teachers[name]
            # every dp rank runs the same number of forwards (FSDP2 collectives): pad with a repeated row
            n = all_reduce_max(torch.tensor(float(len(rows)), device=self.device), self.dp_group)
            if int(n.item()) == 0:
                continue
            padded = rows + [rows[0] if rows else 0] * (int(n.item()) - len(rows))
            lp, ok = t.log_probs(batch.select(padded), self.student_tokenizer, temperature)
            idx = torch.tensor(rows, dtype=torch.long, device=student.device)
            lp, ok = lp[:len(rows)].to(student.dtype), ok[:len(rows)]
            m = batch.response_mask[idx] * ok.float()
            teacher_lp[idx] = torch.where(ok, lp, student[idx])
            sums[name] = distill_sums(student[idx], teacher_lp[idx], m)
            unmapped[name] = ((batch.response_mask[idx] > 0) & ~ok).sum().double()
        batch.teacher_log_probs = teacher_lp
        return self._metrics(sums, unmapped)

    def _metrics(self, sums: dict, unmapped: dict) -> dict[str, float]:
        z = torch.zeros(4, dtype=torch.float64, device=self.device)
        t = torch.stack([torch.cat([sums[n].to(self.device), unmapped[n].reshape(1).to(self.device)]) if n in sums
                         else z for n in self.names])  # [teachers, 4]: kl, teacher lp, tokens, unmapped
        all_reduce_sum(t, self.dp_group)
        total = t.sum(0)
        out = {"distill/reverse_kl": float(total[0] / total[2].clamp(min=1)),
               "distill/teacher_logprob_mean": float(total[1] / total[2].clamp(min=1)),
               "distill/scored_tokens": float(total[2]), "distill/unmapped_tokens": float(total[3])}
        if len(self.names) > 1:
            for n, row in zip(self.names, t):
                out[f"distill/{n}/reverse_kl"] = float(row[0] / row[2].clamp(min=1))
                out[f"distill/{n}/teacher_logprob_mean"] = float(row[1] / row[2].clamp(min=1))
                out[f"distill/{n}/scored_tokens"] = float(row[2])
                out[f"distill/{n}/unmapped_tokens"] = float(row[3])
        return out

    def shape_advantages(self, batch: RolloutBatch) -> dict[str, float]:
        """The additive form ``A_t - coef * KL_t`` on any estimator but opd (which is the KL already)."""
        coef = self.cfg.distill.distillation_loss_coef
        if self.opd_estimator or coef == 0:
            return {}
        batch.advantages = add_opd_term(batch.advantages, batch.old_log_probs, batch.teacher_log_probs,
                                        batch.response_mask, coef)
        return {"distill/coef": coef}


def check_routing(route: dict, names: list[str], data_sources: set) -> None:
    """Every mapped teacher exists; with several teachers, every training data_source is mapped."""
    for src, name in route.items():
        if name not in names:
            raise ConfigError(f"distill.data_source_teacher.{src}: no teacher named {name!r} "
                              f"(distill.teachers: {', '.join(names)})")
    missing = sorted(s for s in data_sources if s not in route)
    if len(names) > 1 and missing:
        raise ConfigError(f"distill.data_source_teacher: data_source(s) {', '.join(map(str, missing))} of "
                          f"data.train_files have no teacher; map each to one of {', '.join(names)}")


def build_distiller(cfg: Config, mesh, device: torch.device, student_tokenizer, train_data) -> Optional[Distiller]:
    """The run's :class:`Distiller`, or None without ``distill.enabled``."""
    if not cfg.distill.enabled:
        return None
    if any(e.multi_modal is not None for e in train_data.examples):
        raise ConfigError("distill.enabled: vision-language rows are not supported yet (the teacher runs text only); "
                          "distil on text data or set distill.enabled=false")
    return Distiller(cfg, mesh, device, student_tokenizer, {e.data_source for e in train_data.examples})
