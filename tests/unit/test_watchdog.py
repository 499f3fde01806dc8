"""Watchdog decisions on a fake store and a fake clock: silence, stalls, long shared phases."""

from __future__ import annotations

import json

from rlhf.ops.metrics import PhaseTimer
from rlhf.ops.watchdog import Watchdog


class FakeStore:
    def __init__(self):
        self.d = {}

    def set(self, k, v):
        self.d[k] = v.encode() if isinstance(v, str) else v

    def get(self, k):
        return self.d[k]

    def check(self, keys):
        return all(k in self.d for k in keys)

    def multi_get(self, keys):
        return [self.d[k] for k in keys]


def beat(store, rank, n, phase, step, seq, done=False):
    store.set(f"rlhf/watchdog/hb/{rank}", json.dumps([n, phase, step, seq, done]))


def watcher(store, world=3):
    return Watchdog(rank=0, world_size=world, store=store, heartbeat_timeout_s=10, stall_timeout_s=30,
                    exit_fn=lambda code: None)


def test_silent_rank_is_named_after_the_heartbeat_timeout():
    store, w = FakeStore(), None
    w = watcher(store)
    for t in range(0, 12):
        beat(store, 0, t, "update", 2, 5)
        beat(store, 2, t, "update", 2, 5)
        if t < 2:  # rank 1 beats twice, then stops
            beat(store, 1, t, "update", 2, 5)
        line = w.check_peers(now=float(t))
        assert line is None, (t, line)
    line = w.check_peers(now=12.0)
    assert "rank 1 stopped responding (last seen in phase 'update' of step 2; no heartbeat for 11 s" in line


def test_rank_left_behind_is_stuck_only_counting_from_when_others_moved_on():
    store = FakeStore()
    w = watcher(store)
    # All three in one long phase for 100 s: nobody is stuck.
    for t in range(0, 100, 5):
        for r in range(3):
            beat(store, r, t, "rollout", 4, 7)
        assert w.check_peers(now=float(t)) is None
    # Ranks 0 and 2 move on at t=100 (and wait in a collective); rank 1 keeps beating in 'score'.
    for t in range(100, 131, 5):
        beat(store, 0, t, "after score", 4, 9)
        beat(store, 2, t, "after score", 4, 9)
        beat(store, 1, t, "score", 4, 8)
        assert w.check_peers(now=float(t)) is None, t
    beat(store, 1, 136, "score", 4, 8)
    line = w.check_peers(now=136.0)
    assert "rank 1 is stuck in phase 'score' of step 4" in line and "waited 36 s" in line


def test_finished_ranks_are_not_expected_and_phase_timer_drives_the_sequence():
    store = FakeStore()
    w = watcher(store, world=2)
    beat(store, 1, 1, "done", 3, 20, done=True)
    beat(store, 0, 1, "update", 3, 12)
    assert w.check_peers(now=0.0) is None
    assert w.check_peers(now=1000.0) is None
    timer = PhaseTimer("cpu", listeners=[w])
    timer.step = 5
    with timer("update"):
        assert (w.phase, w.step, w.seq) == ("update", 5, 1)
    assert (w.phase, w.seq) == ("after update", 2)


def test_fully_async_roles_stall_only_against_their_own_role_and_replicas_by_heartbeat():
    """Ranks 0-1 train (role "train"), 2-3 generate without phases (role None): the rollout ranks
    sitting at one sequence number while the trainers step on is no stall; a trainer left behind
    by the other trainer is; a silent rollout rank is named by its heartbeat."""
    store = FakeStore()

    def beats(t, seq1, rollout=(2, 3)):
        store.set("rlhf/watchdog/hb/0", json.dumps([t, "update", t, 2 * t, False, "train"]))
        store.set("rlhf/watchdog/hb/1", json.dumps([t, "update", t, seq1, False, "train"]))
        for r in rollout:
            store.set(f"rlhf/watchdog/hb/{r}", json.dumps([t, "stream_generate", 0, 1, False, None]))
        return w.check_peers(now=float(t))

    w = watcher(store, world=4)
    for t in range(0, 100, 5):  # trainers move together: nobody stuck, rollout ranks far "behind" in seq
        assert beats(t, 2 * t) is None, t
    lines = [beats(t, 198) for t in range(100, 140, 5)]  # rank 1 stays at seq 198 while rank 0 moves on
    assert lines[-1] is not None and "rank 1 is stuck in phase 'update'" in lines[-1] and not any(lines[:5])
    w = watcher(store, world=4)
    lines = [beats(t, 2 * t, rollout=(2,) if t > 201 else (2, 3)) for t in range(200, 215)]  # rank 3 goes silent
    assert not any(lines[:12]) and "rank 3 stopped responding (last seen in phase 'stream_generate'" in lines[-1]


def test_a_phase_change_is_published_at_once_not_at_the_next_beat():
    """A rank that changes phase (the fully_async rollout loop: waiting for weights <-> generating) and
    is stopped right after is named in its new phase, even with a long beat interval."""
    import time

    store = FakeStore()
    w = Watchdog(rank=2, world_size=3, store=store, heartbeat_timeout_s=10, stall_timeout_s=30, interval_s=60,
                 exit_fn=lambda code: None, role=None).start()
    try:
        t0 = time.monotonic()
        while "rlhf/watchdog/hb/2" not in store.d:
            assert time.monotonic() - t0 < 10
            time.sleep(0.01)
        w.enter("stream_wait_weights", 3)
        while json.loads(store.d["rlhf/watchdog/hb/2"])[1] != "stream_wait_weights":
            assert time.monotonic() - t0 < 10, "the phase waited for the 60 s beat interval"
            time.sleep(0.01)
        assert json.loads(store.d["rlhf/watchdog/hb/2"])[2] == 3
    finally:
        w.finish()
