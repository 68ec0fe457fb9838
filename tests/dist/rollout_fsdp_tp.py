"""torchrun worker for tests/test_rollout_native.py: NativeEngine, slot and HF-forward paths, on an FSDP2-sharded
and on a TP=2 model.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist/rollout_fsdp_tp.py

Gloo on CPU. Every check compares against an unsharded copy of the same model run locally. On the first failed check
the rank prints a line with MISMATCH and exits 1; on success each rank prints 'rank R: all checks passed'.
"""

import copy
import dataclasses
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from transformers import AutoModelForCausalLM, Qwen2Config

from parallel.distributed import exit_process
from rollout.native import NativeEngine, RolloutOutput, SamplingParams

PAD = 0


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return AutoModelForCausalLM.from_config(config)


def check(ok: bool, what: str) -> None:
    if not ok:
        print(f"rank {dist.get_rank()}: MISMATCH {what}", flush=True)
        sys.exit(1)


def check_same(got: RolloutOutput, expected: RolloutOutput, what: str, atol: float = 1e-5) -> None:
    check(got.prompt_ids == expected.prompt_ids, f"{what}: prompt_ids {got.prompt_ids} != {expected.prompt_ids}")
    check(
        torch.equal(got.response_ids, expected.response_ids),
        f"{what}: response_ids\n{got.response_ids}\n!=\n{expected.response_ids}",
    )
    check(torch.equal(got.response_mask, expected.response_mask), f"{what}: response_mask differs")
    check(torch.allclose(got.logprobs, expected.logprobs, atol=atol), f"{what}: logprobs differ")


def check_fsdp(mesh: DeviceMesh) -> None:
    rank = dist.get_rank()
    model = tiny_model()
    # The HF-forward path on an unsharded copy is the reference for both paths on the sharded model.
    reference = NativeEngine(copy.deepcopy(model), PAD, compact_forward=False)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.train()
    engines = {
        "slots": NativeEngine(model, PAD, lockstep_group=mesh.get_group()),
        "hf-forward": NativeEngine(model, PAD, lockstep_group=mesh.get_group(), compact_forward=False),
    }
    check(engines["slots"].slots is not None, "fsdp: the slot path was not picked")
    # With the parameters unsharded once per rollout a missing lockstep would not hang here, so count the forwards.
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))

    for name, engine in engines.items():
        # Different prompts, lengths and stop tokens per rank, so the ranks finish at different steps.
        if rank == 0:
            prompts, params = [[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=3, temperature=0)
        else:
            prompts = [[7, 8, 9, 10], [11], [12, 13, 14, 15, 16, 17]]
            params = SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=(15, 40))
        check_same(engine.generate(prompts, params), reference.generate(prompts, params), f"fsdp {name} greedy")

        # A rank without prompts still takes part in its group's forwards.
        prompts = [] if rank == 0 else [[21, 22], [23, 24, 25]]
        params = SamplingParams(max_new_tokens=6, temperature=0)
        out = engine.generate(prompts, params)
        if rank == 0:
            check(out.response_ids.shape == (0, 0) and out.prompt_ids == [], f"fsdp {name} empty rank: {out}")
        else:
            check_same(out, reference.generate(prompts, params), f"fsdp {name} with an empty rank")
        counts = [None] * dist.get_world_size()
        dist.all_gather_object(counts, len(forwards))
        check(len(set(counts)) == 1, f"fsdp {name}: ranks made different numbers of forwards {counts}")

    # The slot engine is resident: it copied the gathered parameters into its own buffers and resharded before
    # decoding. After the weights change (an optimizer step's stand-in, exact in float32 on both copies) the same
    # call reuses its cache and decodes with the new weights.
    before = out
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().mul_(0.5)
        for p in reference.model.parameters():
            p.mul_(0.5)
    out = engines["slots"].generate(prompts, params)
    if rank == 1:
        check(engines["slots"].stats["new_run"] == 0, f"fsdp: the resident run was not reused {engines['slots'].stats}")
        check(not torch.allclose(out.logprobs, before.logprobs), "fsdp: the weight change changed nothing")
        check_same(out, reference.generate(prompts, params), "fsdp resident after a weight change")

    # The rollout puts back the reshard_after_forward the model was sharded with (FSDP2 has no public getter: its
    # parameter group keeps no post-forward mesh when it does not reshard).
    def reshards_after_forward() -> set[bool]:
        return {m._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None
                for m in model.modules() if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_group}

    check(reshards_after_forward() == {True}, "fsdp: reshard_after_forward=True not restored")
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_reshard_after_forward(False, recurse=False)
    kept = NativeEngine(model, PAD, lockstep_group=mesh.get_group(), reshard_after_forward=False)
    kept.generate([[1, 2]] if rank == 0 else [[3]], SamplingParams(max_new_tokens=2, temperature=0))
    check(reshards_after_forward() == {False}, "fsdp: reshard_after_forward=False overridden by the rollout")
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_reshard_after_forward(True, recurse=False)
    check(model.training, "fsdp: training flag not restored")
    check(all(isinstance(p, DTensor) for p in model.parameters()), "fsdp: parameters not resharded")
    # Training still works after the rollout toggled FSDP's reshard settings.
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    check(all(p.grad is not None for p in model.parameters()), "fsdp: backward after generate lost gradients")


def check_tp(mesh: DeviceMesh) -> None:
    model = tiny_model()
    reference = NativeEngine(copy.deepcopy(model), PAD, compact_forward=False)
    plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)
    check(model.model.layers[0].self_attn.q_proj.weight.to_local().shape[0] == 16, "tp: q_proj is not sharded")
    engines = {
        "slots": NativeEngine(model, PAD, tp_group=mesh.get_group(), max_num_seqs=2),
        "hf-forward": NativeEngine(model, PAD, tp_group=mesh.get_group(), compact_forward=False),
    }
    check(engines["slots"].slots is not None, "tp: the slot path was not picked")
    try:
        NativeEngine(model, PAD).generate([[1, 2]], SamplingParams(max_new_tokens=2))
        check(False, "tp: a tensor-parallel model without tp_group did not raise")
    except ValueError as error:
        check("pass tp_group" in str(error), f"tp: unclear error without tp_group: {error}")
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    for engine_name, engine in engines.items():
        params = SamplingParams(max_new_tokens=10, temperature=0, stop_token_ids=(30,))
        check_same(engine.generate(prompts, params), reference.generate(prompts, params), f"tp {engine_name} greedy")

        params = SamplingParams(max_new_tokens=10, temperature=1.0, n=2)
        for name, seed in (("same seed", 1234), ("seed differing per rank", 100 + dist.get_rank())):
            out = engine.generate(prompts, params, torch.Generator().manual_seed(seed))
            mine = (out.response_ids.tolist(), out.response_mask.tolist(), out.logprobs.tolist())
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
            check(all(o == everyone[0] for o in everyone), f"tp {engine_name} sampling with {name}: ranks diverged")

    # The resident slot engine keeps its stacked copies of the local shards and its run: after the shards change in
    # place, the same call reuses the run and decodes with the new values.
    params = SamplingParams(max_new_tokens=10, temperature=0, stop_token_ids=(30,))
    before = engines["slots"].generate(prompts, params)
    with torch.no_grad():
        for p in model.parameters():
            (p.to_local() if isinstance(p, DTensor) else p).mul_(0.5)
        for p in reference.model.parameters():
            p.mul_(0.5)
    out = engines["slots"].generate(prompts, params)
    check(engines["slots"].stats["new_run"] == 0, f"tp: the resident run was not reused {engines['slots'].stats}")
    check(not torch.allclose(out.logprobs, before.logprobs), "tp: the weight change changed nothing")
    check_same(out, reference.generate(prompts, params), "tp resident after a weight change")

    # A call that continues the last one (multi-turn episodes): each rank prefills only the new tokens into its
    # heads' cache and samples what the unsharded model samples from the whole prompts.
    histories = [list(range(1, 21)), list(range(21, 41))]
    params = SamplingParams(max_new_tokens=6, temperature=0, context_tokens=48)
    first = engines["slots"].generate(histories, params)
    lengths = first.response_mask.sum(-1).tolist()
    histories = [h + r[:n] + [5, 6] for h, r, n in zip(histories, first.response_ids.tolist(), lengths)]
    out = engines["slots"].generate(histories, dataclasses.replace(params, continues=True))
    check(engines["slots"].stats["continued"] == 2, f"tp: the histories were not continued {engines['slots'].stats}")
    check_same(out, reference.generate(histories, params), "tp continued")


def check_tp_kernels(mesh: DeviceMesh) -> None:
    """rollout/kernels.py's Triton kernels (Triton's interpreter on CPU; tests/conftest.py sets TRITON_INTERPRET=1)
    on each rank's heads of a TP=2 model: one key/value head and its two query heads per rank (head_dim 16, the
    kernels' smallest), the rotary embedding and the cache write in the attention kernel, the sampling kernel on
    rank 0's logits. Greedy and sampled output equal the unsharded model's through PyTorch's SDPA and sampler."""
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(config).eval()
    reference = NativeEngine(copy.deepcopy(model), PAD, decode_kernels="torch")
    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)
    engine = NativeEngine(model, PAD, tp_group=mesh.get_group(), max_num_seqs=4, decode_kernels="triton")
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    params = SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=(30,))
    out = engine.generate(prompts, params)
    check(engine.stats["kernel_attention"] == engine.stats["kernel_sampling"] == 1,
          f"tp kernels: the kernels did not run {engine.stats}")
    check_same(out, reference.generate(prompts, params), "tp kernels greedy")
    # Sampling: the kernel's draw with the same seed as the unsharded engine's PyTorch form (the noise agrees to a
    # few float32 steps: a token could differ only on a near-tie, which 64 float32 logits do not hold).
    params = SamplingParams(max_new_tokens=12, temperature=1.0, n=2)
    out = engine.generate(prompts, params, torch.Generator().manual_seed(1234))
    check_same(out, reference.generate(prompts, params, torch.Generator().manual_seed(1234)), "tp kernels sampling")


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    check_fsdp(mesh)
    check_tp(mesh)
    check_tp_kernels(mesh)
    print(f"rank {dist.get_rank()}: all checks passed", flush=True)
    dist.destroy_process_group()
    exit_process(0)


if __name__ == "__main__":
    main()
