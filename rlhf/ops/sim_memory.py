"""Live-storage and collective-byte counting for the simulated rank (``python -m rlhf.simulate``).

Under ``FakeTensorMode`` no memory is allocated, so the allocator's peak cannot be read; this
dispatch mode counts it instead: every tensor an op returns has its storage registered (bytes,
and the category that was current when it was made) until Python frees it, and the running sum
gives the peak a caching allocator without fragmentation would need. Storages are identified by
their ``StorageImpl`` (views share it, so a view is not counted twice) and released through a
``weakref.finalize`` on the storage object (torch keeps one Python object per live storage).

Collectives are counted on the way through as well: each ``c10d`` op adds the bytes of its
largest tensor argument (the gathered output of an all-gather, the input of a reduce-scatter,
the buffer of an all-reduce / broadcast) to its type, which is what a ring or tree algorithm
moves ``(n - 1) / n`` of through each rank's link.

Why not ``torch.distributed._tools.FSDPMemTracker``: on torch 2.13 with fake tensors and a foreach
AdamW over DTensors it reported an optimizer state 13x the size the state dict holds, and no
activations in the forward (its module hooks miss HF's dict outputs); a plain count of live
storages is simpler (tests/unit/test_simulate.py checks its parameter and AdamW bytes exactly).
FSDP2 frees and re-allocates unsharded parameters in place (``storage.resize_``), which no
dispatch mode sees: :func:`fsdp_storage_resizes` reports those to the counter.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# What a phase's peak is split into; anything made while no other category is current is "activations".
# "activations" also holds temporaries and FSDP2's all-gathered blocks; "pipeline buffers" the pp
# schedule's per-micro-batch receive buffers (rlhf/ops/sim_pipeline.py)
CATEGORIES = ("parameters", "gradients", "optimizer", "rollout weights", "kv cache", "pipeline buffers",
              "activations", "host (offload)", "host (routes)")
# model.param_offload keeps the sharded parameters, their gradients and AdamW's state in host memory: counted
# under this category and left out of the (device) total. The simulated device is the host itself, so the
# label is what tells the two apart (fsdp_offload_on_host, rlhf/simulate.py)
HOST = "host (offload)"
# a CUDA sampler's MoE route record (rlhf.rollout.routes.RouteBook, staged in host memory; rlhf/ops/sim_rollout.py)
HOST_ROUTES = "host (routes)"
_HOSTS = (HOST, HOST_ROUTES)


def _plain(t: torch.Tensor) -> bool:
    """A tensor with its own storage (not a DTensor wrapper, whose local tensor is counted instead)."""
    return type(t).__name__ != "DTensor"


class LiveBytes(TorchDispatchMode):
    """Count the bytes of live storages by category and their peak; count collective bytes by type.

    Use inside ``FakeTensorMode`` (entered after it, so it sees ops first and their fake outputs).
    ``category(name)`` sets the label of new storages; ``adopt`` labels tensors that already exist
    (parameters, optimizer state); ``relabel`` moves tensors to another category (the gradients
    the backward left behind). ``phase(name)`` starts a new peak record.
    """

    def __init__(self, ranks_per_node: int = 8) -> None:
        super().__init__()
        self.live: dict[int, tuple[int, str]] = {}  # storage id -> (bytes, category)
        self.by_cat: dict[str, int] = defaultdict(int)
        self.current = "activations"
        self.peaks: dict[str, dict[str, int]] = {}  # phase -> category bytes at its peak (+ "total")
        self.comm: dict[str, dict[str, int]] = {}  # phase -> collective -> bytes
        self.calls: dict[str, dict[str, int]] = {}  # phase -> collective -> count
        self.comm_cross: dict[str, dict[str, int]] = {}  # phase -> collective -> bytes over groups spanning nodes
        self.ranks_per_node = ranks_per_node
        self._phase = "start"
        self._total = 0
        self._start_phase("start")

    # ------------------------------------------------------------------ bookkeeping

    def _start_phase(self, name: str) -> None:
        self._phase = name
        self.peaks[name] = {**{c: self.by_cat.get(c, 0) for c in CATEGORIES}, "total": self._total}
        self.comm.setdefault(name, defaultdict(int))
        self.calls.setdefault(name, defaultdict(int))
        self.comm_cross.setdefault(name, defaultdict(int))

    def _bump(self, cat: str, delta: int) -> None:
        """``delta`` bytes more under ``cat`` (host bytes stay out of the device total); a new peak is kept."""
        self.by_cat[cat] += delta
        self._total += delta if cat not in _HOSTS else 0
        if delta > 0 and self._total > self.peaks[self._phase]["total"]:
            self.peaks[self._phase] = {**{c: self.by_cat.get(c, 0) for c in CATEGORIES}, "total": self._total}

    def _free(self, key: int) -> None:
        n, cat = self.live.pop(key, (0, ""))
        if n:
            self._bump(cat, -n)

    def _add(self, t: torch.Tensor, cat: str) -> None:
        st = t.untyped_storage()
        key = st._cdata
        if key in self.live:
            return
        n = st.nbytes()
        self.live[key] = (n, cat)
        weakref.finalize(st, self._free, key)
        self._bump(cat, n)

    def resized(self, t: torch.Tensor) -> None:
        """``t``'s storage was resized in place (FSDP2 frees an unsharded parameter with
        ``storage.resize_(0)`` and brings it back with ``resize_(n)``, no new storage): count its new size."""
        st = t.untyped_storage()
        key = st._cdata
        if key not in self.live:
            if st.nbytes():
                self._add(t, self.current)
            return
        n, cat = self.live[key]
        delta = st.nbytes() - n
        self.live[key] = (n + delta, cat)
        self._bump(cat, delta)

    def adopt(self, tensors: Iterable[torch.Tensor], cat: str) -> None:
        """Register tensors made before counting began (or outside this mode) under ``cat``."""
        self.relabel(tensors, cat)  # (taking a DTensor's local view already registered it, as "activations")

    def relabel(self, tensors: Iterable[torch.Tensor], cat: str) -> None:
        """Move already-counted tensors to ``cat`` (e.g. ``.grad`` made during the backward)."""
        for t in tensors:
            local = t.to_local() if not _plain(t) else t
            key = local.untyped_storage()._cdata
            if key in self.live:
                n, old = self.live[key]
                self.by_cat[old] -= n
                self.by_cat[cat] += n
                self._total += n * ((old in _HOSTS) - (cat in _HOSTS))
                self.live[key] = (n, cat)
            else:
                self._add(local, cat)

    @contextmanager
    def category(self, name: str) -> Iterator[None]:
        prev, self.current = self.current, name
        try:
            yield
        finally:
            self.current = prev

    def phase(self, name: str) -> None:
        self._start_phase(name)

    @property
    def total(self) -> int:
        return self._total

    @contextmanager
    def repeated(self, times: int) -> Iterator[None]:
        """Count the collectives of the block ``1 + times`` times: work that would run ``times`` more
        times identically (e.g. pipeline micro-batches past the peak) without running it."""
        ph = self._phase
        tables = (self.comm[ph], self.calls[ph], self.comm_cross[ph])
        before = [dict(t) for t in tables]
        yield
        for t, b in zip(tables, before):
            for k, v in list(t.items()):
                t[k] += (v - b.get(k, 0)) * max(times, 0)

    def _crosses_nodes(self, args, kwargs, p2p: bool = False) -> bool:
        """Whether the collective's group spans more than one node of ``ranks_per_node`` consecutive
        ranks (its bytes then go over the inter-node network); unknown groups count as spanning. A
        ``send`` / ``recv`` (``p2p``) crosses when its peer (the group rank after the group) is on
        another node than this rank."""
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _resolve_process_group

        leaves = tree_leaves((args, kwargs))
        for i, a in enumerate(leaves):
            if isinstance(a, torch.ScriptObject):  # a c10d op's group argument (all_to_all_single's)
                a = dist.ProcessGroup.unbox(a)
            elif not isinstance(a, (str, dist.ProcessGroup)):  # (a bool would read as the default group)
                continue
            try:
                pg = _resolve_process_group(a) if isinstance(a, str) else a
                ranks = dist.get_process_group_ranks(pg)
            except (KeyError, ValueError, RuntimeError, TypeError, AttributeError):
                continue
            if p2p and i + 1 < len(leaves) and isinstance(leaves[i + 1], int):
                ranks = [dist.get_rank(), ranks[leaves[i + 1]]]
            return len({r // self.ranks_per_node for r in ranks}) > 1
        return True

    # ------------------------------------------------------------------ dispatch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns = func.namespace
        if ns in ("c10d", "_c10d_functional", "c10d_functional"):
            sizes = [t.untyped_storage().nbytes() if _plain(t) else 0
                     for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            kind = func._opname.rstrip("_").lstrip("_").replace("_base", "").replace("_into_tensor", "")
            kind = {"allgather": "all_gather", "allreduce": "all_reduce", "reduce_scatter_tensor": "reduce_scatter",
                    "all_gather_into_tensor": "all_gather", "_reduce_scatter_base": "reduce_scatter"}.get(kind, kind)
            if kind not in ("wait_tensor", "barrier"):
                self.comm[self._phase][kind] += max(sizes, default=0)
                self.calls[self._phase][kind] += 1
                if self._crosses_nodes(args, kwargs, p2p=kind in ("send", "recv")):
                    self.comm_cross[self._phase][kind] += max(sizes, default=0)
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not _plain(t):
                # a DTensor op's local work runs below this mode (unseen): its result's local tensor is
                # what it allocated (e.g. FSDP2's fp32 gradient accumulation of a TP parameter)
                t = t._local_tensor
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._add(t, self.current)
        return out


@contextmanager
def fsdp_storage_resizes(counter: LiveBytes) -> Iterator[None]:
    """Inside: FSDP2's in-place storage frees and re-allocations of unsharded parameters are counted.
    ``UntypedStorage.resize_`` does not pass through a dispatch mode, so FSDP2's two helpers that
    call it (``alloc_storage`` / ``free_storage``) report to ``counter`` after they run; without this
    every unsharded parameter would stay counted from its first all-gather on."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    real_alloc, real_free = _fsdp_param.alloc_storage, _fsdp_param.free_storage

    def alloc(t: torch.Tensor) -> None:
        real_alloc(t)
        counter.resized(t)

    def free(t: torch.Tensor) -> None:
        real_free(t)
        counter.resized(t)

    _fsdp_param.alloc_storage, _fsdp_param.free_storage, _fsdp_param_group.alloc_storage = alloc, free, alloc
    try:
        yield
    finally:
        _fsdp_param.alloc_storage, _fsdp_param.free_storage = real_alloc, real_free
        _fsdp_param_group.alloc_storage = real_alloc


@contextmanager
def fsdp_offload_on_host(counter: LiveBytes) -> Iterator[None]:
    """Inside: the sharded gradients FSDP2 reduce-scatters for a parameter with CPU offload are counted as
    host memory once the reduction returns (on a GPU it copies them to the host there and frees the device
    output; on the simulated host device that copy is a no-op, so the label stands in for it)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    real = _fsdp_param_group.foreach_reduce

    def reduce(fsdp_params, *args, **kwargs):
        out = real(fsdp_params, *args, **kwargs)
        counter.relabel([p.sharded_param.grad for p in fsdp_params
                         if p.offload_to_cpu and p.sharded_param.grad is not None], HOST)
        return out

    _fsdp_param_group.foreach_reduce = reduce
    try:
        yield
    finally:
        _fsdp_param_group.foreach_reduce = real
