"""The rollout role of trainer.mode fully_async: one replica per rank, generating without pause.

Rollout rank ``g`` (the i-th of G) owns the prompts at data-order positions ``s = i, i + G,
i + 2G, ...`` of the seeded order every rank mirrors (batch ``s // B + 1``, draws keyed by that
step as in colocated mode). It starts prompt ``s`` only while ``s`` is below AReaL's admission
bound for the weights it holds (:func:`staleness.admission_bound`), decodes with continuous
batching (:class:`rlhf.rollout.stream.StreamRun`), sends each finished group to the training
leader at once, and takes new weights at a token boundary (partial rollout). A thread receives
the weights (so the training rank's send never waits for a decode step); the main thread picks
them up between decode steps. With ``rollout.multi_turn`` the rank runs the agent loop and its
tools (its own worker processes) over its group slots; each group's tool calls, errors and step
rewards travel with its rows, as one_step_off's rollout role ships them with a batch.
"""

from __future__ import annotations

import json
import math
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from rlhf.agent.rollout import closing_agent, make_agent, with_step_rewards
from rlhf.rollout.engine import RolloutEngine, rollout_dtype
from rlhf.rollout.sampler import RolloutOutput
from rlhf.rollout.stream import STOP, StreamPrompt, StreamRun
from rlhf.schema.config import Config
from rlhf.train.async_rl.rollout_worker import rollout_inputs
from rlhf.train.async_rl.split import StreamRoles
from rlhf.train.async_rl.staleness import admission_bound
from rlhf.train.async_rl.transfer import WeightReceiver, recv_object, recv_tensors, send_object
from rlhf.train.prompts import make_loader, prompt_batch

END = "end"  # the last message a rollout rank sends the leader


def receive_weights(src: int, device: torch.device, group, out: queue.Queue, receiver: WeightReceiver) -> None:
    """Thread body: ``(version, weights)`` messages from ``src`` into ``out`` until STOP (or the error);
    ``receiver`` merges LoRA adapters into the base it keeps (one_step_off's rule: the base crosses once)."""
    try:
        while True:
            head = recv_object(src, device, group)
            if head[0] == STOP:
                out.put(STOP)
                return
            out.put((int(head[1]), receiver.merged(recv_tensors(src, device, group))))
    except Exception as e:  # noqa: BLE001 - handed to the main thread, which raises it naming the rank
        out.put(e)


class StreamWorker:
    """Build on a rollout rank; ``run()`` until the training role sends STOP."""

    def __init__(self, cfg: Config, roles: StreamRoles, resume: Optional[str]):
        self.cfg, self.roles, self.device = cfg, roles, roles.env.device
        m = cfg.model
        self.tokenizer, self.hf_config, self.data = rollout_inputs(cfg)
        # A fresh loader, replayed from the first batch: a resumed run may still owe prompts of
        # batches before the checkpoint's data position (staleness_threshold > 0).
        self.loader, self.total_steps = make_loader(cfg, len(self.data))
        self.start, base, self.done = 0, 0, set()
        if resume is not None:
            state = json.loads((Path(resume) / "trainer_state.json").read_text())
            self.start = int(state["global_step"])
            trained = state.get("fully_async", {"base": self.start * cfg.data.train_batch_size, "consumed": []})
            base, self.done = int(trained["base"]), set(trained["consumed"])
        self.engine = RolloutEngine(cfg.rollout, self.tokenizer, max_prompt_length=cfg.data.max_prompt_length,
                                    max_response_length=cfg.data.max_response_length, device=self.device,
                                    dtype=rollout_dtype(cfg.rollout.dtype, self.device.type, m.dtype),
                                    record_routes=cfg.actor.router_replay != "R2")
        a = cfg.async_training
        self.B = cfg.data.train_batch_size
        self.G = len(roles.rollout_ranks)
        self.me = roles.env.rank - len(roles.train_ranks)
        # Mine: positions s = me (mod G), from the first one not yet trained on.
        self.next_s = base + (self.me - base) % self.G
        self.end_s = self.total_steps * self.B
        stop = cfg.trainer.stop_after_steps
        if stop >= 0:
            self.end_s = min(self.end_s, (self.start + stop) * self.B)
        self.batches: list[list[int]] = []  # the loader's batches, in order
        self.inbox: queue.Queue = queue.Queue()
        self.idle_s, self.t0 = 0.0, time.perf_counter()
        self.groups_sent = 0
        self.agent = None  # rollout.multi_turn: the ToolAgent, built in run()
        # The job watchdog's phase seam (``Watchdog.enter``): the loop reports waiting for weights vs
        # generating, with the weights version it holds as the step, as it switches.
        self.on_phase: Callable[[str, int], None] = lambda phase, step: None
        self.version = 0
        self.capacity = max(1, math.ceil((1 + a.staleness_threshold) * a.trigger_parameter_sync_step * self.B
                                         / self.G) + 1)

    # ------------------------------------------------------------------ StreamDriver

    def poll_weights(self, block: bool) -> Any:
        t0 = time.perf_counter()
        if block:
            self.on_phase("stream_wait_weights", self.version)
        try:
            msg = self.inbox.get(block=block, timeout=self.cfg.trainer.exchange_timeout_s if block else None)
        except queue.Empty:
            if block:
                raise RuntimeError(f"fully_async: rollout rank {self.roles.env.rank} got neither weights nor stop "
                                   f"from training rank {self.roles.partner} in trainer.exchange_timeout_s") from None
            return None
        finally:
            if block:
                self.idle_s += time.perf_counter() - t0
                self.on_phase("stream_generate", self.version)
        if isinstance(msg, Exception):
            raise RuntimeError(f"fully_async: rollout rank {self.roles.env.rank} lost its weight source, training "
                               f"rank {self.roles.partner}: {msg}") from msg
        if msg is not None and msg != STOP:
            self.version = int(msg[0])
        return msg

    def next_prompts(self, free: int, version: int) -> list[StreamPrompt]:
        a = self.cfg.async_training
        bound = min(self.end_s, admission_bound(version, self.B, a.trigger_parameter_sync_step,
                                                a.staleness_threshold))
        out = []
        while len(out) < free and self.next_s < bound:
            s = self.next_s
            self.next_s += self.G
            if s in self.done:  # trained on before the checkpoint
                continue
            b = s // self.B
            while len(self.batches) <= b:
                self.batches.append(self.loader.next_batch())
            pb = prompt_batch([self.batches[b][s % self.B]], self.data.examples)
            out.append(StreamPrompt(pb.prompt_ids[0], key=pb.keys[0], step=b + 1, tag=(s, pb), info=pb.extra_infos[0],
                                    multi_modal=pb.multi_modal[0] if pb.multi_modal else None))
        return out

    def on_group(self, prompt: StreamPrompt, out: dict[str, torch.Tensor]) -> None:
        s, pb = prompt.tag
        n, R = out["response_ids"].shape
        mask = torch.arange(R)[None, :] < out["lengths"][:, None]
        if "observation" in out:  # the loss mask has holes on tool observations
            mask &= ~out["observation"]
        ro = RolloutOutput(response_ids=out["response_ids"], response_mask=mask, log_probs=out["log_probs"],
                           response_lengths=out["lengths"], truncated=out["truncated"],
                           prompt_index=torch.zeros(n, dtype=torch.long), routes=out.get("routes"))
        batch = self.engine.to_batch(pb, ro, n).to(torch.device("cpu"))
        batch.token_versions = out["versions"] * mask
        tools = out.get("tools")
        if tools is not None and self.agent.executes:  # verl: step rewards to the reward function's extra_info
            batch.extra_infos = [with_step_rewards(info, sc) for info, sc in zip(batch.extra_infos, tools["step_rewards"])]
        fields = {k: v for k, v in vars(batch).items()}
        self.groups_sent += 1
        send_object({"seq": s, "idx": pb.keys[0], "batch": fields, "rank": self.roles.env.rank,
                     "idle_s": self.idle_s, "wall_s": time.perf_counter() - self.t0,
                     "tools": None if tools is None else {k: tools[k] for k in ("calls", "errors")}},
                    0, self.device, self.roles.row_groups[self.roles.env.rank])

    # ------------------------------------------------------------------ loop

    def run(self) -> None:
        self.agent = make_agent(self.cfg.rollout.multi_turn, self.tokenizer, self.roles.layout)
        with closing_agent(self.agent):
            self._run()

    def _run(self) -> None:
        r = self.roles
        m = self.cfg.model
        receiver = WeightReceiver(r.partner, self.device, (m.lora_alpha, m.lora_rank) if m.lora_rank else None)
        thread = threading.Thread(target=receive_weights, daemon=True,
                                  args=(r.partner, self.device, r.weight_groups[r.env.rank], self.inbox, receiver))
        thread.start()
        first = self.poll_weights(block=True)
        stats: dict[str, float] = {}
        if first != STOP:
            version, weights = first
            c, a = self.cfg, self.cfg.async_training
            sampler = self.engine._sampler(self.hf_config, weights, consume=True)
            params = self.engine.sampling_params(n=c.rollout.n, temperature=c.rollout.temperature, seed=c.rollout.seed)
            turns = None if self.agent is None else self.agent.turns(groups=self.capacity, n=c.rollout.n)
            stats = StreamRun(sampler, params, self.capacity, self, max_prompt_len=c.data.max_prompt_length,
                              partial_rollout=a.partial_rollout, kv=a.partial_rollout_kv, version=version,
                              turns=turns).execute()
        send_object({END: True, "rank": r.env.rank, "idle_s": self.idle_s, "wall_s": time.perf_counter() - self.t0,
                     "stats": stats}, 0, self.device, r.row_groups[r.env.rank])
        thread.join()
