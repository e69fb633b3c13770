"""Value fingerprints of tensors, computed on the tensor's own device and read back once per pass.

    batch = FingerprintBatch()
    slot = batch.add(tensor)          # queues device-side reductions; no host sync
    ...
    values = batch.collect()          # ONE device->host copy per device and kind
    values[slot]                      # [sum, abs_sum] for floats, [sum, weighted_sum] for ints/bools

Floats: float32 sum and float32 sum of absolute values (upcasting to float64 costs 2-4x more).
Integers and bools: exact int64 sum and position-weighted sum, so a permutation (topk picking the
same experts in another order) changes the fingerprint.
"""

from __future__ import annotations

import torch

_INT_KINDS = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}


def _local(t: torch.Tensor) -> torch.Tensor | None:
    """The plain tensor to reduce: a DTensor's local shard (reducing the DTensor itself would run a
    collective, and `.tolist()` refuses subclasses); an in-flight collective's result once it arrived
    (AsyncCollectiveTensor); None for other wrapper subclasses."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return t
    local = getattr(t, "_local_tensor", None)  # DTensor (also as a Parameter)
    if isinstance(local, torch.Tensor):
        return local
    wait = getattr(t, "trigger_wait", None)  # AsyncCollectiveTensor: wait for the collective's values
    if callable(wait) and hasattr(t, "elem"):
        waited = wait()
        return waited if type(waited) is torch.Tensor else None
    return t if not hasattr(t, "__tensor_flatten__") else None


class FingerprintBatch:
    """Deferred fingerprints of many tensors, collected with one sync per device and kind."""

    def __init__(self) -> None:
        # (kind, device) -> two lists of 0-d tensors: the first and the second number of each pair
        self._buckets: dict[tuple[str, torch.device], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self._slots: list[tuple[str, torch.device, int]] = []
        self._weights: dict[torch.device, torch.Tensor] = {}
        self._kept: list[tuple[torch.Tensor, int]] = []

    def add(self, t: torch.Tensor) -> int | None:
        """Queue a fingerprint of `t`; returns its slot, or None for tensors that cannot be reduced."""
        t = _local(t)
        if t is None:
            return None
        dtype = t.dtype
        if t.is_complex() or t.is_sparse or t.is_quantized or t.layout != torch.strided or t.is_meta:
            return None
        device = t.device
        if dtype in _INT_KINDS:
            flat = t.reshape(-1)
            first = flat.sum(dtype=torch.int64)
            second = (flat * self._weight(device, flat.numel())).sum(dtype=torch.int64)
            kind = "i"
        elif dtype.is_floating_point:
            first = t.sum(dtype=torch.float32)
            second = torch.linalg.vector_norm(t, 1, dtype=torch.float32)
            kind = "f"
        else:
            return None
        firsts, seconds = self._buckets.setdefault((kind, device), ([], []))
        firsts.append(first)
        seconds.append(second)
        self._slots.append((kind, device, len(firsts) - 1))
        return len(self._slots) - 1

    def keep(self, t: torch.Tensor) -> int:
        """Keep a small tensor's values (a copy on its device) to read back at collect time."""
        local = _local(t)
        self._kept.append((local.detach().clone() if local is not None else torch.zeros(0), len(self._kept)))
        return len(self._kept) - 1

    def _weight(self, device: torch.device, n: int) -> torch.Tensor:
        w = self._weights.get(device)
        if w is None or w.numel() < n:
            w = torch.arange(1, max(n, 1024) + 1, dtype=torch.int64, device=device)
            self._weights[device] = w
        return w[:n]

    def collect(self) -> tuple[list[list[float] | None], list[list]]:
        """Read everything back: (fingerprint per slot, kept values as nested lists)."""
        read = {key: torch.stack((torch.stack(a), torch.stack(b))).tolist() for key, (a, b) in self._buckets.items()}
        out: list[list[float] | None] = []
        for kind, device, i in self._slots:
            firsts, seconds = read[(kind, device)]
            out.append([firsts[i], seconds[i]])
        kept = [t.tolist() for t, _ in self._kept]
        return out, kept

    def __len__(self) -> int:
        return len(self._slots)
