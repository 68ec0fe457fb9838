"""Periodic parameter averaging across replicas, i.e. local SGD with an adaptive period (comm.param_averaging)."""

import torch
import torch.distributed as dist
import torch.nn as nn


class ReplicaAverager:
    """Local SGD over the replicas: each replica (dp_replicate index) steps on its own gradients, and every k
    optimizer steps the parameters are averaged over `group`; k adapts between k_min and k_max.

    The model's gradients must not be reduced over the replicas (FSDP2 over dp_shard alone, as for
    allreduce_replicas). The rule for k: each replica keeps an exponential moving average of its loss (`beta`; a
    mini-batch loss alone is too noisy to difference), averaged over the replicas on the same all-reduce as the
    parameters, and compared with its value at the previous average: a relative change per step above `fast` halves k
    (the loss moves fast, so do the replicas, and they drift apart), below `slow` doubles it (a plateau: little to
    gain from syncing often). AdaComm (Wang & Joshi 2019) argues for the opposite direction late in training, to lower
    the error floor; k_max bounds the drift either way. Every replica takes the same decision because it uses the
    averaged value. Optimizer states are not averaged, as in post-local-SGD. Parameters are averaged in float32
    buckets of at most `bucket_numel` local elements.
    """

    def __init__(self, group: dist.ProcessGroup | None, k_min: int = 1, k_max: int = 16, slow: float = 0.02,
                 fast: float = 0.1, beta: float = 0.9, bucket_numel: int = 1 << 25):
        if not 1 <= k_min <= k_max:
            raise ValueError(f"k_min={k_min}, k_max={k_max}: need 1 <= k_min <= k_max")
        self.group = group or dist.group.WORLD
        self.k_min, self.k_max, self.slow, self.fast, self.beta = k_min, k_max, slow, fast, beta
        self.bucket_numel = bucket_numel
        self.k, self.since = k_min, 0
        self.ema: float | None = None
        self.last_loss: float | None = None
        self.rounds = 0

    @torch.no_grad()
    def step(self, model: nn.Module, loss: float) -> dict[str, float]:
        """Call after every optimizer step with this replica's loss. Returns comm/sync_period (the k in force) and
        comm/averaged (1.0 on the steps that averaged)."""
        self.since += 1
        loss = float(loss)
        self.ema = loss if self.ema is None else self.beta * self.ema + (1 - self.beta) * loss
        if self.since < self.k:
            return {"comm/sync_period": float(self.k), "comm/averaged": 0.0}
        n = self.group.size()
        params = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
        mean_loss = None
        for lo, hi in self._buckets(params):
            bucket = params[lo:hi]
            flat = torch.cat([t.reshape(-1).float() for t in bucket] or [torch.zeros(0)])
            last = hi == len(params)
            if last:  # the smoothed loss rides on the last bucket's all-reduce
                flat = torch.cat([flat, flat.new_tensor([self.ema])])
            flat.div_(n)
            dist.all_reduce(flat, group=self.group)
            if last:
                mean_loss = float(flat[-1])
            offset = 0
            for t in bucket:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
        self._adapt(mean_loss)
        self.rounds += 1
        return {"comm/sync_period": float(self.k), "comm/averaged": 1.0}

    def state_dict(self) -> dict:
        """What decides the next averages, for a checkpoint: {"k", "since", "ema", "last_loss", "rounds"} (ints,
        and floats or None). The same on every replica except `ema`, this replica's own smoothed loss."""
        return {"k": self.k, "since": self.since, "ema": self.ema, "last_loss": self.last_loss, "rounds": self.rounds}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict`; ValueError naming a missing key, or a k outside this averager's [k_min, k_max]."""
        missing = [key for key in ("k", "since", "ema", "last_loss", "rounds") if key not in state]
        if missing:
            raise ValueError(f"ReplicaAverager.load_state_dict: missing {', '.join(missing)} (got {sorted(state)})")
        if not self.k_min <= state["k"] <= self.k_max:
            raise ValueError(f"ReplicaAverager.load_state_dict: k={state['k']} is outside [k_min, k_max]="
                             f"[{self.k_min}, {self.k_max}] (comm.averaging_k_min / averaging_k_max changed?)")
        self.k, self.since, self.rounds = int(state["k"]), int(state["since"]), int(state["rounds"])
        self.ema = None if state["ema"] is None else float(state["ema"])
        self.last_loss = None if state["last_loss"] is None else float(state["last_loss"])

    def _buckets(self, params: list[torch.Tensor]) -> list[tuple[int, int]]:
        bounds, lo, size = [], 0, 0
        for i, t in enumerate(params):
            if size and size + t.numel() > self.bucket_numel:
                bounds.append((lo, i))
                lo, size = i, 0
            size += t.numel()
        return [*bounds, (lo, len(params))]

    def _adapt(self, loss: float | None) -> None:
        steps, self.since = self.since, 0
        if loss is None or self.last_loss is None:
            self.last_loss = loss
            return
        rate = abs(loss - self.last_loss) / max(abs(self.last_loss), 1e-12) / steps
        if rate > self.fast:
            self.k = max(self.k_min, self.k // 2)
        elif rate < self.slow:
            self.k = min(self.k_max, self.k * 2)
        self.last_loss = loss
