"""Slot-based generation: a preallocated KV cache, continuous batching, decode steps replayed from CUDA graphs.

Every sequence being generated owns a slot: one row of the KV cache with room for its prompt and its response. A
generate call repeats:
1. admission (rollout/slot_admission.py): waiting sequences take the free slots. Prefill runs once per prompt
   (prompts batched, right-padded), writes the prompt's keys/values into the slots of all its admitted samples and
   samples each one's first token.
   With CUDA graphs a small prefill (up to PREFILL_GRAPH_TOKENS padded prompt tokens) is padded to a bucket shape and
   replayed from a graph, and a slot is refilled as soon as it is free. Launched op by op a small prefill is
   host-bound, several times its share of a large one, so without graphs admission waits until an eighth of the
   slots is free (or nothing decodes, or all that wait fit).
2. decode: STEPS_PER_CHECK steps over the first B slots (B a batch bucket covering every occupied slot), one token per
   live slot per step. Sampling, stop checks and the bookkeeping run on the device, so on CUDA a step is one replay
   of a graph captured for its (batch bucket, context bucket), and the host only enqueues replays.
3. check: the host reads the slots' live flags and positions (the one host sync per STEPS_PER_CHECK steps), frees the
   finished slots, and, once no sequence waits, moves the live slots to the front so a smaller bucket serves them.
Tokens and logprobs land in per-sequence output rows, so any slot can serve any sequence.

The forward is rollout/decoder.py's compact forward (the families rollout/families.py describes) over the model's
parameters (in place, or with a resident engine over its own buffers, refilled from them every call: the stacked
projections, and under FSDP2 a copy of every parameter); its blocks and the sampling step can be compiled with
torch.compile (CUDA only) before the graphs are captured.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from parallel.timing import DeviceClock
from rollout import kernels
from rollout.api import RolloutOutput, SamplingParams
from rollout.decoder import decode_layer, prefill_layer
from rollout.model_weights import SEPARATE_FIELDS, DecoderWeights, fill_weights, own_weights, read_weights
from rollout.sampling import take_first_tp_rank
from rollout.slot_admission import (  # noqa: F401  (the prefill's bucket constants and helpers, read as slots.X)
    MIN_CONTINUED_TOKENS,
    PREFILL_GRAPH_TOKENS,
    PREFILL_WIDTH_BUCKET,
    Admission,
    _continued,
    _prefill_shape,
    _size_bucket,
)
from rollout.slot_run import SlotRun
from rollout.step_pieces import decode_inputs, sample_and_record

STEPS_PER_CHECK = 16  # decode steps between two host syncs: a finished slot idles at most this many steps
MIN_BATCH_BUCKET = 8
ADMIT_SHARE = 8  # with sequences decoding, admission waits until this share (1/8) of the slots is free
CONTEXT_BUCKET = 128  # attention reads the cache up to a multiple of this past the longest live sequence
SLOT_ALIGN = 8  # slot length granularity: keeps the attention mask rows 16-byte aligned for SDPA's fused kernels
DECODE_KERNELS = ("auto", "triton", "torch")
# what the Triton kernels (rollout/kernels.py, rollout/sample_kernels.py) can take over
KERNEL_OPS = frozenset({"attention", "sampling"})
COMPILE_DYNAMIC: bool | None = None  # torch.compile's `dynamic` for the decode pieces (None: a recompile on change)
# compile the prefill's blocks too: its compile is ~12 s of a cold first rollout at 0.5B on an H200, for a prefill that
# runs once per rollout (bench/warmup.py's eager-prefill variant measures both sides)
COMPILE_PREFILL = True
# Dynamo counts compiled variants per code object over the whole process, and under fullgraph=True the one past its
# recompile limit (default 8) is an error, not a fallback. Every engine of a process and every setting that is a
# Python constant in these pieces (temperature, top-k/top-p, prefill vs decode, stop tokens, the kernels) adds
# variants: a training run with greedy evals meets about 8 of sample_and_record, tests and benchmarks more.
RECOMPILE_LIMIT = 64


def compile_piece(fn: Callable, **options) -> Callable:
    """torch.compile(fn, fullgraph=True) for a piece of the decode step, with Dynamo's recompile limit raised to
    RECOMPILE_LIMIT for the process (never lowered). options: more torch.compile arguments (tests: backend)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(fn, fullgraph=True, dynamic=COMPILE_DYNAMIC, **options)


class SlotEngine(Admission):
    """Generation with a slot KV cache on the parameters of a model rollout/families.py describes; see the module
    docstring.

    max_num_seqs: slots at most (the decode batch). kv_cache_tokens: the KV cache's size in tokens (slots x slot
    length); None sizes it on CUDA from gpu_memory_utilization (the share of the GPU's memory this process may hold
    in all, weights and training state included) and on CPU from max_num_seqs. max_prefill_tokens: prompt tokens
    (padded) per prefill forward, which bounds its activations. cuda_graphs / compile: capture the decode step (and
    each small prefill's bucket shape) in CUDA graphs, and compile its blocks and sampling with torch.compile first
    (CUDA only; compile is skipped under tensor parallelism, whose all-reduce runs between the compiled pieces).
    fused_projections: decode with stacked q/k/v and gate/up weights, copied every call (rollout/decoder).
    decode_kernels: "auto" (the Triton kernels of rollout/kernels.py and sample_kernels.py where they run: CUDA with
    Triton, head_dim a power of two; else PyTorch's SDPA and sampling.py), "triton" (the kernels or an error saying
    why not) or "torch". kernel_ops: which of them (KERNEL_OPS: decode attention; sampling, top-k and top-p
    included) - all unless a benchmark measures them one by one.
    resident: keep the decode weights, the KV cache and the captured graphs from one call to the next, so that a call
    of the same shapes captures nothing and allocates nothing. The weights are then the engine's own buffers (the
    stacked q/k/v and gate/up, and, when FSDP2 shards the model, a copy of every parameter: FSDP2 unshards into new
    storage each time), refilled from the parameters by load_weights or at the start of each call; the memory stays
    held between calls (through training). A call the kept run fits (as many sequences or fewer, responses as long
    or shorter, slots as long, the same sampling settings) reuses it; any other replaces it. A call with
    SamplingParams.continues may start its prompts with what the last call's sequences left in their slots (their
    prompts and responses): those slots are kept and only the rest of each prompt is prefilled (_extend).
    """

    def __init__(
        self,
        model: nn.Module,
        pad_token_id: int,
        tp_group: dist.ProcessGroup | None,
        max_num_seqs: int,
        kv_cache_tokens: int | None,
        gpu_memory_utilization: float,
        max_prefill_tokens: int,
        cuda_graphs: bool,
        compile: bool,
        fused_projections: bool = True,
        decode_kernels: str = "auto",
        kernel_ops: frozenset[str] = KERNEL_OPS,
        resident: bool = True,
    ):
        if decode_kernels not in DECODE_KERNELS:
            raise ValueError(f"decode_kernels must be one of {DECODE_KERNELS}, got {decode_kernels!r}")
        if not kernel_ops <= KERNEL_OPS:
            raise ValueError(f"kernel_ops must be a subset of {sorted(KERNEL_OPS)}, got {sorted(kernel_ops)}")
        self.decode_kernels = decode_kernels
        self.kernel_ops = kernel_ops
        self.model = model
        self.fused_projections = fused_projections
        self.pad_token_id = pad_token_id
        self.tp_group = tp_group
        self.max_num_seqs = max_num_seqs
        self.kv_cache_tokens = kv_cache_tokens
        self.gpu_memory_utilization = gpu_memory_utilization
        self.max_prefill_tokens = max_prefill_tokens
        self.cuda_graphs = cuda_graphs
        self.compile = compile
        self.resident = resident
        self._loaded: DecoderWeights | None = None  # read by load_weights for the next call
        self._kept: DecoderWeights | None = None  # resident: the engine's weight buffers
        self._kept_key: tuple = ()  # what the model's parameters were like when _kept was made
        self._run: SlotRun | None = None  # resident: the last call's run
        self._gathered_bytes = 0  # resident, FSDP2: the gathered parameters' bytes, which the next rollout gathers
        self._compiled: dict[str, Callable] = {}
        # with sequences decoding, admit waiting ones once this many slots are free (None: where prefills replay
        # CUDA graphs the samples per prompt, n, up to slots // ADMIT_SHARE; else slots // ADMIT_SHARE)
        self.admit_min_free: int | None = None
        # pad a prefill chunk of at most PREFILL_GRAPH_TOKENS to its bucket shape (_prefill_shape) and, with CUDA
        # graphs, replay it from a graph: None, where graphs are used (cuda_graphs on CUDA); False, never (every
        # prefill launched op by op); True pads it on any device (tests: padding changes nothing)
        self.pad_prefills: bool | None = None
        self._warm: set[tuple] = set()  # (bucket, run shapes) that ran once before, so capture needs no warm-up run
        # of the last generate call: slots, decode_steps, prefills, prefills_padded (to a bucket shape: on CUDA, the
        # ones replayed from a graph), graphs and prefill_graphs (captured), kernel_attention and kernel_sampling (1:
        # by the Triton kernel), new_run (1: the cache was allocated in this call, 0: a resident run reused); seconds
        # of its phases: prefill_s (the prefill forwards' device time), capture_s (host time capturing graphs, first
        # runs of new shapes included), decode_s (the decode steps' device time)
        self.stats: dict[str, float] = {}

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        generator: torch.Generator | None,
        limits: list[int],
        samples: list[int] | None = None,
    ) -> RolloutOutput:
        """prompts: non-empty token lists; limits: max_new_tokens per prompt; samples: sequences per prompt (params.n
        each when None). Called with the parameters unsharded (unless load_weights read them since) and autograd off
        (NativeEngine.generate). With params.tail_share the call may return before every sequence ended (partial
        rollouts): RolloutOutput.unfinished marks those."""
        w = self._loaded if self._loaded is not None else self._read_weights()
        self._loaded = None
        if w.row_parallel != (self.tp_group is not None):
            raise ValueError(
                f"tp_group is {'set' if self.tp_group is not None else 'None'} but the model's attention heads are "
                f"{'split' if w.row_parallel else 'whole'} on this rank: pass tp_group exactly when the model is "
                "tensor-parallel"
            )
        device = w.embed.device
        triton = self._use_kernels(w.head_dim, device)
        kernel_attention = triton and "attention" in self.kernel_ops
        kernel_sampling = triton and "sampling" in self.kernel_ops
        n = params.n
        counts = samples if samples is not None else [n] * len(prompts)
        owner = [i for i, count in enumerate(counts) for _ in range(count)]  # sequence -> its prompt
        num_seqs = len(owner)
        max_new = max(limits)
        longest = max(len(p) + limit for p, limit in zip(prompts, limits))
        slot_len = -(-max(longest, params.context_tokens) // SLOT_ALIGN) * SLOT_ALIGN
        sampling = (w.form, params.temperature, params.top_k, params.top_p, params.min_new_tokens, kernel_sampling)
        config = (num_seqs, max_new, bool(params.stop_token_ids), sampling, w.dtype, kernel_attention)
        run = self._run
        # a kept run serves a call it fits (as many slots as a new run would get: kv_cache_tokens may have cut it)
        fresh_slots = min(self.max_num_seqs, num_seqs, (self.kv_cache_tokens or 1 << 62) // slot_len)
        new_run = (run is None or run.config[2:] != config[2:] or run.num_seqs < num_seqs or run.max_new < max_new
                   or run.slot_len < slot_len or run.slots < fresh_slots)
        # partial rollouts: the number of sequences changes from call to call (the carried ones come on top), so
        # the output rows get room for more and a kept run serves the next calls
        rows = _size_bucket(num_seqs) if params.tail_share > 0 else num_seqs
        held = run.held() if params.continues and not new_run else {}
        if new_run:
            self._run = run = None  # the kept run's memory counts as free when the new one is sized
            slots, by_share = self._slot_count(w, slot_len, longest, num_seqs, device)
            run = SlotRun(slots, slot_len, (rows, *config[1:]), w, device)
            # A cache the GPU share cut short fills that share: kept, it would hold it through training (sized
            # before the optimizer's state exists, even), so it lives for this call only.
            if self.resident and not by_share:
                self._run = run
        else:
            run.reset()
        self.stats = dict(slots=run.slots, decode_steps=0, prefills=0, prefills_padded=0, graphs=0, prefill_graphs=0,
                          new_run=int(new_run), continued=0, continued_tokens=0,
                          kernel_attention=int(kernel_attention), kernel_sampling=int(kernel_sampling),
                          prefill_s=0.0, capture_s=0.0, decode_s=0.0)
        clock = DeviceClock(device)
        use_graphs = self.cuda_graphs and device.type == "cuda"
        compiled = self.compile and device.type == "cuda" and self.tp_group is None
        layer, inputs, sample = (self._fn(f, compiled) for f in (decode_layer, decode_inputs, sample_and_record))
        prefill = self._fn(prefill_layer, compiled and COMPILE_PREFILL)
        reduce = broadcast = None
        if self.tp_group is not None:
            reduce = partial(_all_reduce, group=self.tp_group)
            broadcast = partial(take_first_tp_rank, group=self.tp_group)
        # The seed of the counter-based sampling noise: drawn from `generator`, so a seed reproduces the output.
        seed_device = generator.device if generator is not None else device
        seed, stop_mask = run.seed, run.stop_mask
        seed.copy_(torch.randint(2**31 - 1, (1,), generator=generator, device=seed_device))
        if stop_mask is not None:
            stop_mask.zero_()
            stop_mask[list(params.stop_token_ids)] = True

        def sample_rows(hidden, residual, rows, advance_positions):
            sample(hidden, residual, rows, w.norm, w.lm_head, run.state, seed, stop_mask, *sampling,
                   advance_positions, broadcast)

        def step(batch: int, length: int) -> None:
            st = run.state
            pos = st.pos[:batch]
            positions = None if kernel_attention else run.positions[:length]
            hidden, cos, sin, mask = inputs(st.token[:batch], pos, w.embed, run.cos, run.sin, positions,
                                            w.form.embed_scale)
            residual = torch.zeros_like(hidden)
            for block, spec, k, v in zip(w.layers, w.specs, run.k, run.v):
                hidden, residual = layer(hidden, residual, block, k, v, pos, cos[spec.rope], sin[spec.rope], mask,
                                         w.form, spec, w.head_dim, reduce, length)
            sample_rows(hidden, residual, run.rows[:batch], True)

        waiting = deque(range(num_seqs))
        continued = _continued(held, prompts, [0, *itertools.accumulate(counts)][:-1])
        if continued:
            self._extend(run, w, prompts, owner, limits, continued, reduce, sample_rows, clock)
            waiting = deque(seq for seq in waiting if seq not in continued)
        graphed_prefills = use_graphs and self.pad_prefills is not False
        # with graphs at once, but for a whole prompt's n samples (one prefill each, not one per sample)
        eighth = max(1, run.slots // ADMIT_SHARE)
        admit_min_free = self.admit_min_free or (min(n, eighth) if graphed_prefills else eighth)
        while True:
            free = [s for s, seq in enumerate(run.slot_seq) if seq is None]
            occupied = run.occupied()
            # With sequences still decoding, admission waits for admit_min_free free slots (or room for all that
            # wait): launched op by op, a prefill of a few prompts costs several times their share of a large one.
            if waiting and free and (len(free) >= min(admit_min_free, len(waiting)) or not occupied):
                admitted = [(waiting.popleft(), slot) for slot in free[: len(waiting)]]
                self._prefill(run, w, prompts, owner, limits, admitted, partial(prefill, reduce=reduce),
                              sample_rows, clock, use_graphs)
                occupied = run.occupied()
            if not occupied:
                break
            batch = _batch_bucket(max(occupied) + 1, run.slots)
            # 0 when every occupied slot finished at its prefill (max_new_tokens 1): no step, no graph to capture
            steps = min(STEPS_PER_CHECK, max(run.slot_left[s] for s in occupied))
            needed = max(run.slot_pos[s] for s in occupied) + steps
            length = min(run.slot_len, -(-needed // CONTEXT_BUCKET) * CONTEXT_BUCKET)
            key = ("decode", batch, length)
            if use_graphs and steps and key not in run.graphs:
                with clock("capture_s", host=True):
                    self._graph(run, key, partial(step, batch, length))
                self.stats["graphs"] += 1
            with clock("decode_s"):
                for _ in range(steps):
                    if use_graphs:
                        run.graphs[key].replay()
                    else:
                        step(batch, length)
            self.stats["decode_steps"] += steps
            self._check(run, batch, steps, compact=not waiting)
            if not waiting and _tail_reached(run, params, num_seqs):
                break

        unfinished = torch.zeros(num_seqs, dtype=torch.bool)
        unfinished[[run.slot_seq[s] for s in run.occupied()]] = True
        self.stats["unfinished"] = int(unfinished.sum())

        lengths = run.state.out_len[:num_seqs]
        width = int(lengths.max())
        self.stats.update(clock.pop())
        mask = torch.arange(width, device=device)[None, :] < lengths[:, None]
        response = run.state.out_tokens[:num_seqs, :width].masked_fill(~mask, self.pad_token_id)
        if self._run is run:  # kept: the next call may continue these sequences (copies: the caller owns its lists)
            run.last = ([list(p) for p in prompts], owner, response.clone(), lengths.clone(), dict(run.finished_at))
        return RolloutOutput(
            prompt_ids=[list(prompts[i]) for i in owner],
            response_ids=response,
            response_mask=mask.long(),
            logprobs=run.state.out_logprobs[:num_seqs, :width].masked_fill(~mask, 0.0),
            unfinished=unfinished.to(device) if params.tail_share > 0 else None,
        )

    def load_weights(self) -> None:
        """Read the model's parameters (unsharded) for the next generate call. A resident engine copies them into
        its own buffers, so the caller may reshard the model before generating."""
        self._loaded = self._read_weights()

    def _read_weights(self) -> DecoderWeights:
        fuse = self.fused_projections
        views = read_weights(self.model, fuse=fuse and not self.resident)
        if not self.resident:
            return views
        copy_all = any(isinstance(m, FSDPModule) for m in self.model.modules())
        tensors = [views.embed, views.norm, views.lm_head]
        tensors += [getattr(block, name) for block in views.layers for name in SEPARATE_FIELDS]
        # buffers that stay the model's parameters are valid while those stay where they are
        key = (fuse, copy_all, *((t.shape, t.dtype, t.device, None if copy_all else t.data_ptr())
                                 for t in tensors if t is not None))
        if key != self._kept_key:
            self._kept = self._run = None  # their memory is free before the new buffers take theirs
            self._kept, self._kept_key = own_weights(views, fuse, copy_all), key
            unique = {t.data_ptr(): t.numel() * t.element_size() for t in tensors if t is not None}
            self._gathered_bytes = sum(unique.values()) if copy_all else 0
        fill_weights(self._kept, views)
        return self._kept

    def _use_kernels(self, head_dim: int, device: torch.device) -> bool:
        """Whether the decode step runs the Triton kernels of rollout/kernels.py and sample_kernels.py (auto: on CUDA
        where they can)."""
        if self.decode_kernels == "torch":
            return False
        reason = kernels.available(head_dim, device)
        if reason is not None and self.decode_kernels == "triton":
            raise ValueError(f"rollout.decode_kernels is 'triton' but the kernels cannot run: {reason}")
        return reason is None and (device.type == "cuda" or self.decode_kernels == "triton")

    def _fn(self, fn: Callable, compiled: bool) -> Callable:
        if not compiled:
            return fn
        if fn.__name__ not in self._compiled:
            self._compiled[fn.__name__] = compile_piece(fn)
        return self._compiled[fn.__name__]

    def _slot_count(self, w: DecoderWeights, slot_len: int, longest: int, num_seqs: int,
                    device) -> tuple[int, bool]:
        """How many slots of slot_len tokens the KV cache budget holds, at most max_num_seqs and num_seqs; and
        whether the share of the GPU (gpu_memory_utilization, no kv_cache_tokens) cut them below that."""
        budget, wanted = self.kv_cache_tokens, min(self.max_num_seqs, num_seqs)
        if budget is None and device.type == "cuda":
            bytes_per_token = 2 * len(w.layers) * w.kv_heads * w.head_dim * w.embed.element_size()
            free, total = torch.cuda.mem_get_info(device)
            allocated = torch.cuda.memory_allocated(device)
            cached = torch.cuda.memory_reserved(device) - allocated
            available = min(free + cached, self.gpu_memory_utilization * total - allocated)
            # a resident engine with its own copy of a sharded model holds it while the next rollout gathers the
            # model again: that gathering needs room beside the cache, as the decoding's transients do
            budget = int(available - max(self._activation_bytes(w), self._gathered_bytes)) // bytes_per_token
        if budget is None:
            return wanted, False
        if budget < slot_len:
            source = "kv_cache_tokens" if self.kv_cache_tokens is not None else "gpu_memory_utilization"
            raise ValueError(
                f"the KV cache budget of {max(budget, 0)} tokens (from {source}) cannot hold one sequence of {longest} "
                f"tokens (longest prompt + max_new_tokens; a slot takes {slot_len}): raise {source} or shorten the "
                "prompts or max_new_tokens"
            )
        slots = min(wanted, budget // slot_len)
        return slots, self.kv_cache_tokens is None and slots < wanted

    def _activation_bytes(self, w: DecoderWeights) -> int:
        """A rough bound on the transient memory of a prefill forward and a decode step, kept out of the KV cache."""
        hidden, inter = w.embed.shape[1], w.layers[0].gate.shape[0]
        width = w.layers[0].q.shape[0] + 2 * w.kv_heads * w.head_dim
        # an eager prefill's, and beside it a graphed prefill's activations held in the graphs' pool
        tokens = self.max_prefill_tokens + (PREFILL_GRAPH_TOKENS if self.cuda_graphs else 0)
        prefill = tokens * (6 * hidden + 3 * inter + 2 * width) * w.embed.element_size()
        logits = self.max_num_seqs * w.embed.shape[0] * 16  # logits and their float32 temporaries
        return prefill + logits

    def _graph(self, run: SlotRun, key: tuple, step: Callable[[], None]) -> None:
        """Capture `step` (a decode step, or a prefill over its input buffers) as the CUDA graph run.graphs[key].

        The first capture of a shape needs one run before it (torch.compile compiles, kernels initialise). That run
        really advances the slots, so their state is put back after it; the cache entries and output cells it wrote
        are rewritten by the first replay with the same values, since sampling is a pure function of the state and
        the seed. Later generate calls with the same shapes capture straight away. Capture goes through
        capture_begin/end rather than torch.cuda.graph, which empties the allocator's cache before every capture.
        """
        if (key, run.shapes) not in self._warm:
            st = run.state
            saved = [t.clone() for t in (st.token, st.pos, st.gen, st.live)]
            step()
            for t, old in zip((st.token, st.pos, st.gen, st.live), saved):
                t.copy_(old)
            self._warm.add((key, run.shapes))
        graph = torch.cuda.CUDAGraph()
        stream = run.capture_stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=run.pool)
            try:
                step()
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        run.graphs[key] = graph

    def _check(self, run: SlotRun, batch: int, steps: int, compact: bool) -> None:
        """Read the live flags and positions of the first `batch` slots (a host sync), free finished slots, and with
        `compact` move the live slots to the front when that lets a smaller batch bucket serve them."""
        st = run.state
        live, pos = torch.stack([st.live[:batch].long(), st.pos[:batch]]).tolist()
        for slot in range(batch):
            if run.slot_seq[slot] is None:
                continue
            if live[slot]:
                run.slot_pos[slot] = pos[slot]
                run.slot_left[slot] -= steps
            else:
                run.finished_at[slot] = run.slot_seq[slot]
                run.slot_seq[slot] = None
        occupied = run.occupied()
        slots = len(run.slot_seq)
        if not compact or not occupied or _batch_bucket(len(occupied), slots) >= _batch_bucket(occupied[-1] + 1, slots):
            return
        count = len(occupied)
        src = torch.tensor(occupied, device=st.pos.device)
        # Gathered before written: the source and destination slots may overlap.
        length = max(run.slot_pos[s] for s in occupied)
        for cache in (*run.k, *run.v):
            cache[:count, :, :length] = cache[src, :, :length]
        for slot, moved in enumerate(occupied):
            if slot != moved:
                run.finished_at.pop(slot, None)
        for t in (st.token, st.pos, st.gen, st.limit, st.live, st.seq):
            t[:count] = t[src]
        st.live[count:] = False
        for field in ("slot_seq", "slot_pos", "slot_left"):
            values = getattr(run, field)
            moved = [values[s] for s in occupied]
            values[:] = moved + ([None] * (slots - count) if field == "slot_seq" else [0] * (slots - count))


def _tail_reached(run: SlotRun, params: SamplingParams, num_seqs: int) -> bool:
    """Partial rollouts (params.tail_share > 0): whether the call may return now, with no sequence waiting: fewer
    than tail_share of the slots this call can fill (a kept run may have more than its sequences) still decode, and
    none of them is one of the first params.finish_first sequences (those always end in this call)."""
    occupied = run.occupied()
    return (0 < len(occupied) < params.tail_share * min(run.slots, num_seqs)
            and all(run.slot_seq[s] >= params.finish_first for s in occupied))


def _batch_bucket(needed: int, slots: int) -> int:
    """The decode batch for `needed` leading slots: a power of two (at least MIN_BATCH_BUCKET), at most `slots`, so
    only a few graphs are captured."""
    bucket = MIN_BATCH_BUCKET
    while bucket < needed:
        bucket *= 2
    return min(bucket, slots)


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    dist.all_reduce(x, group=group)
    return x
