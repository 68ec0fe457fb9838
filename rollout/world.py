"""Generation on engines laid out apart from the actor's data: every rank of the world in split placement, and
vLLM's engines in any placement (`rollout.ranks`, config.world_rollout).

The actor's data-parallel ranks own the prompts (each its share; its tp peers hold the same) and want their samples
back in order. The engines ("units") are laid out otherwise: the actor's own engines plus one on every rank outside
the actor's pool (split placement, `units_of_split`), or vLLM's blocks of `rollout.vllm_tp` contiguous ranks
(`units_in_blocks`). Every rank of the world calls `WorldRollout.generate` at the same point, the actor's ranks with
their prompts, the others with none:

1. weights (`sync`): the actor's pool gathers its shards to whole tensors, bucket by bucket
   (parallel/reshard.weight_buckets); its first rank broadcasts each bucket to the ranks outside the pool; every
   engine that keeps its own copy (vLLM, a native replica) loads them. The actor's native engine generates on the
   actor's parameters in place and needs none.
2. prompts: the owners' prompts are all-gathered; their union, ordered by owner, is cut into contiguous chunks of
   near-equal size, one per unit; every rank of a unit passes its chunk to its engine.
3. samples: the first rank of each unit sends every sample to the ranks of its owner (all_to_all_single over the
   world: each a row of float64 [prompt index, sample index, length, token ids..., log-probs...]), which rebuild their
   RolloutOutput in their prompts' order.

The dealing is by prompt (its n samples stay together). On the native engine a prompt's samples do not depend on
the batch it shares, but on the generator's state: a split run's samples differ from a colocated run's of the same
seed, as a run on another number of ranks does. Greedy samples are the same wherever they are generated.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from parallel.distributed import anyone, comm_device
from parallel.layout import Pool
from parallel.reshard import broadcast_buckets, hf_name, named_weights, weight_buckets
from rollout.api import RolloutOutput, SamplingParams
from rollout.native import NativeEngine


@dataclass
class Units:
    """unit_of[rank]: the engine (unit) each global rank generates with, numbered 0.. in the order of the units'
    first ranks; every rank of a unit generates the same samples, its first rank sends them."""

    unit_of: list[int]

    @property
    def count(self) -> int:
        return max(self.unit_of) + 1

    def leader(self, unit: int) -> int:
        return self.unit_of.index(unit)


def units_in_blocks(world_size: int, size: int) -> Units:
    """Contiguous blocks of `size` ranks (vLLM's engines: its external launcher builds its TP groups so)."""
    if size < 1 or world_size % size:
        raise ValueError(f"rollout.vllm_tp={size} must divide the world size {world_size}")
    return Units([rank // size for rank in range(world_size)])


def units_of_split(world_size: int, actor: Pool) -> Units:
    """The actor pool's engines (one per data-parallel index, its tp peers together) and one engine on every other
    rank."""
    keys = [("actor", actor.dp_rank_of(rank)) if actor.has(rank) else ("rank", rank) for rank in range(world_size)]
    number: dict = {}
    return Units([number.setdefault(key, len(number)) for key in keys])


def chunks(count: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) of `parts` contiguous chunks of range(count), sizes differing by at most one, larger first."""
    base, extra = divmod(count, parts)
    bounds, start = [], 0
    for part in range(parts):
        end = start + base + (part < extra)
        bounds.append((start, end))
        start = end
    return bounds


class Replica:
    """The actor's architecture, whole, on a rank outside the actor's pool: the native engine over a copy of the
    weights, loaded from the stream the actor's pool sends before each rollout (the copy costs the model's size in
    `dtype` on this rank's device, beside the roles it hosts).

    model: an HF causal LM of the actor's config (its weights are overwritten by the first sync);
    engine_options: NativeEngine's keyword options (no lockstep or tp group: the replica is one rank's own)."""

    def __init__(self, model: nn.Module, pad_token_id: int, **engine_options):
        self.model = model.eval().requires_grad_(False)
        self.engine = NativeEngine(self.model, pad_token_id, **engine_options)
        self.stats = self.engine.stats
        self.loaded = False
        self._weights = {hf_name(name): tensor for name, tensor in named_weights(self.model)}

    def sync_weights(self, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> float:
        """Copy the stream into the replica's weights. The stream is read to its end before a mismatch is raised:
        its sender goes on broadcasting whatever this rank makes of it."""
        began = time.perf_counter()
        seen, problem = set(), None
        with torch.no_grad():
            for bucket in buckets:
                for name, tensor in bucket:
                    target = self._weights.get(name)
                    if target is None or target.shape != tensor.shape:
                        found = "no such name" if target is None else f"shape {tuple(target.shape)}"
                        problem = problem or (f"the actor's weight {name} {tuple(tensor.shape)} has no match in the "
                                              f"rollout replica ({found}); the replica is built from the actor's "
                                              "config.json")
                        continue
                    target.copy_(tensor)
                    seen.add(name)
        missing = sorted(set(self._weights) - seen)
        if problem is None and missing:
            problem = (f"the actor's weight stream left out {len(missing)} weights of the rollout replica, e.g. "
                       f"{missing[:3]}")
        if problem is not None:
            raise ValueError(problem)
        self.loaded = True
        self.stats["reshard_s"] = time.perf_counter() - began
        return self.stats["reshard_s"]

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 generator: torch.Generator | None = None) -> RolloutOutput:
        return self.engine.generate(prompts, params, generator)


class WorldRollout:
    """Every rank's side of a rollout over `units` (see the module's docstring).

    engine: this rank's engine, with generate(prompts, params, generator) -> RolloutOutput; with sync_weights(stream)
        when it keeps its own copy of the weights (vLLM, Replica), without it for the actor's in-place native engine.
    weights: the (name, tensor) stream of the actor's weights as the engines take them (a LoRA actor's merged ones,
        roles/lora.Adapters.merged_weights); None: the model's parameters.
    actor: the actor's pool (every rank holds the Pool object); model: the actor's sharded model on its ranks, None
        elsewhere. dtype: the dtype the weights travel and are loaded in. device: where outputs are returned.
    """

    def __init__(self, engine, units: Units, actor: Pool, model: nn.Module | None, pad_token_id: int,
                 dtype: torch.dtype, device: torch.device, bucket_bytes: int = 256 << 20,
                 weights: Callable[[], Iterable] | None = None):
        self.engine, self.units, self.actor, self.model, self.weights = engine, units, actor, model, weights
        self.pad_token_id, self.dtype, self.device, self.bucket_bytes = pad_token_id, dtype, device, bucket_bytes
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.unit = units.unit_of[self.rank]
        self.leads = units.leader(self.unit) == self.rank
        self.owner = actor.dp_rank_of(self.rank) if actor.has(self.rank) else None
        self.owner_ranks = collections.defaultdict(list)  # actor dp index -> its global ranks (tp peers)
        for rank in actor.ranks:
            self.owner_ranks[actor.dp_rank_of(rank)].append(rank)
        # the weights go from the actor's first rank to every rank outside its pool
        self.src = actor.ranks[0]
        outside = [rank for rank in range(self.world) if not actor.has(rank)]
        group = dist.new_group([self.src, *outside]) if outside else None  # collective: every rank creates it
        self.broadcast_group = group if self.rank in (self.src, *outside) and outside else None
        self.synced_version: int | None = None
        self.stats: dict[str, float] = {}

    # ------------------------------------------------------------------------------------------------ weights
    def sync(self, version: int) -> None:
        """Bring every engine's copy to the actor's weights after `version` updates (every rank calls; nothing
        happens when the engines hold them already). stats["reshard_s"]: the seconds it took here."""
        self.stats["reshard_s"] = 0.0
        keeps_copy = hasattr(self.engine, "sync_weights")
        if version == self.synced_version and (not keeps_copy or self.engine.loaded):
            return
        began = time.perf_counter()
        stream: Iterator | None = None
        if self.model is not None:
            device = self.device if keeps_copy or self.broadcast_group is not None else None
            stream = weight_buckets(self.model, self.bucket_bytes, dtype=self.dtype, device=device,
                                    weights=self.weights() if self.weights is not None else None)
        if self.broadcast_group is not None:
            stream = broadcast_buckets(stream, self.broadcast_group, self.src, comm_device(self.broadcast_group))
        error = None
        if stream is not None:
            try:
                if keeps_copy:
                    self.engine.sync_weights(stream)
                else:
                    collections.deque(stream, maxlen=0)  # the gathers are collective over the actor's pool
            except Exception as e:  # noqa: BLE001 - every rank raises it, below
                error = e
        self._agree(error, "the weight sync")
        self.synced_version = version
        self.stats["reshard_s"] = time.perf_counter() - began

    # ------------------------------------------------------------------------------------------------ generation
    def generate(self, prompts: list[list[int]] | None, params: SamplingParams, generator: torch.Generator | None,
                 version: int) -> RolloutOutput | None:
        """prompts: this actor rank's share (its tp peers pass the same), None outside the actor's pool. Returns the
        samples of `prompts` (RolloutOutput, n consecutive per prompt) on the actor's ranks, None elsewhere."""
        if (prompts is None) != (self.owner is None):
            raise ValueError("the actor's ranks pass their prompts, the other ranks None")
        self.sync(version)
        shares: list = [None] * self.world
        sends = self.owner is not None and self.actor.tp_rank_of(self.rank) == 0
        dist.all_gather_object(shares, (self.owner, prompts, params) if sends else None)
        sent = sorted((share for share in shares if share is not None), key=lambda share: share[0])
        by_owner = {owner: theirs for owner, theirs, _ in sent}
        # every engine samples with the first owner's settings, with room for every owner's sequences: the ranks
        # outside the actor's pool have none of their own, and the owners' differ at most in context_tokens
        params = dataclasses.replace(sent[0][2], context_tokens=max(theirs.context_tokens for _, _, theirs in sent))
        union = [(owner, index, prompt) for owner, theirs in by_owner.items() for index, prompt in enumerate(theirs)]
        start, end = chunks(len(union), self.units.count)[self.unit]
        mine = union[start:end]
        out, error = None, None
        try:
            out = self.engine.generate([prompt for _, _, prompt in mine], params, generator)
        except Exception as e:  # noqa: BLE001 - every rank raises it, below
            error = e
        self._agree(error, "generation")
        received = self._exchange(out if self.leads else None, mine, params.n)
        if self.owner is None:
            return None
        return self._assemble(prompts, params.n, received)

    def _agree(self, error: Exception | None, what: str) -> None:
        """Raise on every rank when `what` failed on some rank: the others would wait for it in the next collective.
        The rank that failed raises its own error."""
        failed = anyone(error is not None)
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(f"{what} of the rollout failed on another rank (its log says why)")

    def _exchange(self, out: RolloutOutput | None, mine: list, n: int) -> torch.Tensor:
        """Each unit's samples to the ranks of their owners; returns the float64 records this rank received (CPU)."""
        parts = [torch.empty(0, dtype=torch.float64)] * self.world
        if out is not None and mine:
            out_device = out.response_mask.device
            mask = out.response_mask.bool()
            index = torch.tensor([index for _, index, _ in mine], device=out_device).repeat_interleave(n)
            sample = torch.arange(n, device=out_device).repeat(len(mine))
            header = torch.stack([index, sample, mask.sum(-1)], dim=1)
            # one record per row: [prompt index, sample index, length, token ids..., log-probs...]; boolean indexing
            # of the padded rows reads them row by row, so each row's kept entries come out as its record
            table = torch.cat([header.double(), out.response_ids.double(), out.logprobs.double()], dim=1)
            keep = torch.cat([torch.ones_like(header, dtype=torch.bool), mask, mask], dim=1)
            owner_of_row = torch.tensor([owner for owner, _, _ in mine], device=out_device).repeat_interleave(n)
            for owner, ranks in self.owner_ranks.items():
                rows = owner_of_row == owner
                if bool(rows.any()):
                    record = table[rows][keep[rows]].cpu()
                    for rank in ranks:
                        parts[rank] = record
        device = comm_device()
        sizes = [part.numel() for part in parts]
        incoming = torch.empty(self.world, dtype=torch.long, device=device)
        dist.all_to_all_single(incoming, torch.tensor(sizes, dtype=torch.long, device=device))
        recv_sizes = incoming.tolist()
        recv = torch.empty(sum(recv_sizes), dtype=torch.float64, device=device)
        dist.all_to_all_single(recv, torch.cat(parts).to(device), recv_sizes, sizes)
        return recv.cpu()

    def _assemble(self, prompts: list[list[int]], n: int, flat: torch.Tensor) -> RolloutOutput:
        values = flat.numpy()
        where: dict[tuple[int, int], tuple[int, int]] = {}  # (prompt index, sample) -> (start of its tokens, length)
        pos = 0
        while pos < len(values):
            length = int(values[pos + 2])
            where[(int(values[pos]), int(values[pos + 1]))] = (pos + 3, length)
            pos += 3 + 2 * length
        expected = [(index, j) for index in range(len(prompts)) for j in range(n)]
        if sorted(where) != expected:
            raise RuntimeError(f"the rollout returned {len(where)} samples for {len(expected)} wanted")
        width = max((where[key][1] for key in expected), default=0)
        ids = torch.full((len(expected), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(expected), width), dtype=torch.long)
        logprobs = torch.zeros((len(expected), width), dtype=torch.float32)
        for i, key in enumerate(expected):
            start, length = where[key]
            ids[i, :length] = flat[start : start + length].long()
            mask[i, :length] = 1
            logprobs[i, :length] = flat[start + length : start + 2 * length].float()
        return RolloutOutput([list(p) for p in prompts for _ in range(n)], ids.to(self.device), mask.to(self.device),
                             logprobs.to(self.device))
