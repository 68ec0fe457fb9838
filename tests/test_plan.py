"""The memory and placement planner (plan/, `train_ppo.py --plan`) against what the code really allocates:

- parameter, gradient and optimizer bytes equal, to the byte, what roles/modeling's loaders and
  roles/update_loop.make_optimizer hold after one optimizer step on the CPU, and (torchrun, 2 gloo ranks) what one
  rank holds under FSDP2 and under tensor parallelism through parallel/fsdp.shard_model;
- an update's activations are within [0.95, 1.5] of the peak torch's memory profiler measures for a micro-batch
  through the actor's and the critic's real loss paths (gradients freed as FSDP2's reduce-scatter frees them);
- the command line: a config that fits exits 0 with the table, one that does not names config keys that fix it
  (and does fit with them), --suggest prints a placement block that loads and passes check_world, --json gives the
  per-rank totals, a bad --world exits 2 with the config error.
Models are tiny HF models built here; the planner reads only their config.json.
"""

from __future__ import annotations

import json
import shlex
import sys

import pytest
import torch

import config as C
import plan as P
from conftest import ROOT, explain, run_python, torchrun

TINY = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=160,
            max_position_embeddings=128)
# a graphed prefill's activations in the resident engine's pool: 4096 prompt tokens (slots.PREFILL_GRAPH_TOKENS) of
# 6 h + 3 i + 2 (q + 2 k) float32 values each (h 64, i 160, q = 4 heads x 16, k = 2 x 16)
PREFILL_POOL = 4096 * (6 * 64 + 3 * 160 + 2 * (64 + 2 * 32)) * 4


def tiny_model(directory, vocab_size=96, weights=True, **kwargs):
    from tasks.tiny_model import build_tiny_causal_lm

    model = build_tiny_causal_lm(vocab_size, **(TINY | kwargs))
    if weights:
        model.save_pretrained(directory)
    else:
        model.config.save_pretrained(directory)
    return str(directory)


def allocated(model, optimizer) -> tuple[int, int, int]:
    """Bytes of this rank's parameters, gradients and optimizer state (the local shard of a DTensor)."""
    def nbytes(t):
        return (t.to_local() if hasattr(t, "to_local") else t).nbytes

    params = sum(nbytes(p) for p in model.parameters())
    grads = sum(nbytes(p.grad) for p in model.parameters() if p.grad is not None)
    optim = sum(nbytes(v) for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))
    return params, grads, optim


def one_step(model, optimizer, seed=0):
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids).logits.float().square().mean().backward()
    optimizer.step()


def plan_of(role, model_dir, tp=1, shard=1):
    kind = "lm" if role == "actor" else "value"
    cfg = C.Config()
    cfg.model.path = model_dir
    return P.role_plan(cfg, role, P.model_shape(model_dir, kind, "model.path"), tp, shard, shard)


# ---------------------------------------------------------------------------------------------------------------
# bytes of the training state


@pytest.mark.parametrize("role,family,tied", [("actor", "qwen2", False), ("actor", "llama", True),
                                              ("critic", "qwen2", False)])
def test_state_bytes_equal_what_one_cpu_step_allocates(tmp_path, role, family, tied):
    from roles.modeling import load_causal_lm, load_value_model
    from roles.update_loop import make_optimizer

    path = tiny_model(tmp_path / "m", family=family, tie_word_embeddings=tied)
    model = (load_causal_lm if role == "actor" else load_value_model)(path)
    optimizer = make_optimizer(model, C.OptimConfig())
    one_step(model, optimizer)
    params, grads, optim = allocated(model, optimizer)
    planned = plan_of(role, path)
    assert (planned.params, planned.grads, planned.optim) == (params, grads, optim)


def fsdp_worker(model_dir: str, out: str) -> None:
    """torchrun --nproc_per_node 2 tests/test_plan.py MODEL_DIR OUT: FSDP2 (dp_shard 2) and TP (tp 2) through
    shard_model; writes each case's largest rank's (params, grads, optim) bytes."""
    import torch.distributed as dist

    from parallel.distributed import init_distributed
    from parallel.fsdp import shard_model
    from parallel.layout import build_layout
    from roles.modeling import load_causal_lm, load_value_model
    from roles.update_loop import make_optimizer

    init_distributed("gloo", device="cpu")
    results = {}
    for role, tp in (("actor", 1), ("actor", 2), ("critic", 1)):
        pool = build_layout([C.PoolConfig(name="p", size=2, roles=[role], tp=tp)], "cpu").pools[0]
        model = (load_causal_lm if role == "actor" else load_value_model)(model_dir)
        model = shard_model(model, pool, C.FSDPConfig())
        optimizer = make_optimizer(model, C.OptimConfig())
        one_step(model, optimizer, seed=dist.get_rank())
        largest = torch.tensor(allocated(model, optimizer), dtype=torch.float64)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        results[f"{role} {tp}"] = [int(x) for x in largest.tolist()]
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def test_state_bytes_equal_one_rank_of_fsdp2_and_tp_on_two_gloo_ranks(tmp_path):
    # 5 query heads' rows do not split evenly over 2 FSDP shards: the plan must count FSDP2's padding
    path = tiny_model(tmp_path / "m", vocab_size=97, hidden_size=80, num_heads=4, num_kv_heads=2)
    out = tmp_path / "bytes.json"
    proc = torchrun([__file__, path, str(out)], nproc=2, timeout=180)
    assert proc.returncode == 0, explain(proc)
    measured = json.loads(out.read_text())
    for case, (params, grads, optim) in measured.items():
        role, tp = case.split()
        planned = plan_of(role, path, tp=int(tp), shard=2 // int(tp))
        assert (planned.params, planned.grads, planned.optim) == (params, grads, optim), case


# ---------------------------------------------------------------------------------------------------------------
# activations


def measured_update_peak(model, micro_batch, kind, trace) -> int:
    """The largest bytes allocated beyond the parameters during one forward and backward of `micro_batch`
    (torch.profiler's memory timeline on the CPU), through the actor's or the critic's loss path."""
    from torch.profiler import ProfilerActivity, profile

    from algo.losses import logprobs_and_entropy
    from roles.modeling import at_response, forward, response_logits

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        if kind == "lm":
            logp, _ = logprobs_and_entropy(response_logits(model, micro_batch), micro_batch["response_ids"])
        else:
            logp = at_response(forward(model, micro_batch).squeeze(-1), micro_batch).float()
        loss = (logp * micro_batch["response_mask"]).sum()
        del logp
        loss.backward()
    prof.export_memory_timeline(str(trace), device="cpu")
    _, sizes = json.loads(trace.read_text())
    return max(map(sum, sizes)) - sum(p.nbytes for p in model.parameters())


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("kind,checkpointing,vocab", [("lm", False, 2048), ("lm", True, 2048), ("lm", False, 256),
                                                      ("value", False, 256)])
def test_activations_within_the_stated_factor_of_the_measured_peak(tmp_path, kind, checkpointing, vocab):
    from roles.micro_batches import micro_batches

    path = tiny_model(tmp_path / "m", vocab_size=vocab, hidden_size=128, num_layers=4, intermediate_size=352,
                      max_position_embeddings=256, weights=False)
    model = random_model(path, kind)
    if checkpointing:  # what parallel/fsdp.shard_model turns on
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # bfloat16 compute as under FSDP2's param_dtype; each gradient freed when it is ready, as the reduce-scatter does
    model.to(torch.bfloat16).train()
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    rows, width = 4, 128
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(width // 4, width // 2, (rows,), generator=g)
    response = width - prompt - 4 * torch.arange(rows)  # rows of different lengths: a padding mask
    ids = torch.randint(4, vocab, (rows, width), generator=g)
    resp_ids = torch.zeros(rows, int(response.max()), dtype=torch.long)
    mask = torch.zeros(rows, int(response.max()))
    for b in range(rows):
        resp_ids[b, : response[b]] = ids[b, prompt[b] : prompt[b] + response[b]]
        mask[b, : response[b]] = 1
    batch = dict(input_ids=ids, prompt_len=prompt, response_len=response, response_ids=resp_ids, response_mask=mask)
    (micro,) = micro_batches(batch, rows * width, None)
    measured = measured_update_peak(model, micro, kind, tmp_path / "timeline.json")
    full, ckpt, _ = P.activation_bytes(P.model_shape(path, kind, "model.path"), rows * width, width, 1, 2)
    ratio = (ckpt if checkpointing else full) / measured
    assert 0.95 <= ratio <= 1.5, f"plan {ckpt if checkpointing else full} / measured {measured} = {ratio:.3f}"


def random_model(path, kind):
    """The model roles/modeling loads, with random weights: a causal LM, or the one-label token head."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    arch = AutoConfig.from_pretrained(path)
    if kind == "lm":
        return AutoModelForCausalLM.from_config(arch)
    arch.num_labels, arch.classifier_dropout = 1, 0.0
    return AutoModelForTokenClassification.from_config(arch)


# ---------------------------------------------------------------------------------------------------------------
# the command line


def write_config(tmp_path, reward_model: bool = True) -> str:
    """GRPO with a small actor of a large vocabulary and a much larger reward model (config.json files only); the
    data files do not exist (a plan reads none)."""
    actor = tiny_model(tmp_path / "actor", vocab_size=32000, weights=False)
    lines = [f"base: {ROOT / 'configs' / 'quickstart.yaml'}", "quickstart: {enabled: false}",
             "run: {device: auto}", f"model: {{path: {actor}}}",
             f"data: {{train_path: {tmp_path / 'absent.jsonl'}, eval_path: null}}",
             "algorithm: {adv_estimator: grpo, kl: {in_reward: false}}", "actor: {micro_batch_tokens: 128}"]
    if reward_model:
        reward = tiny_model(tmp_path / "reward", vocab_size=512, weights=False, hidden_size=1024, num_layers=8,
                            num_heads=8, num_kv_heads=4, intermediate_size=2048)
        lines.append(f"reward: {{model_path: {reward}, functions: []}}")
    path = tmp_path / "plan.yaml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def plan_cli(argv, monkeypatch, capsys) -> tuple[int, str, str]:
    """train_ppo.main in this process (its --plan route), with torchrun's variables unset: (code, stdout, stderr)."""
    import train_ppo

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    try:
        code = train_ppo.main(argv)
    except SystemExit as e:  # parse_or_exit on a config error
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_config_that_fits_prints_the_table_and_exits_0(tmp_path):
    config = write_config(tmp_path)
    proc = run_python(["train_ppo.py", "--config", config, "--plan", "--world", "4", "--gpu-memory", "80"])
    assert proc.returncode == 0, explain(proc)
    for text in ("plan: world 4, 80.0 GiB", "pool all: ranks 0-3", "params", "optim", "act.ckpt",
                 "rollout (native)", "KV cache", "peak", "fits"):
        assert text in proc.stdout, text


def test_too_little_memory_names_the_keys_that_fix_it(tmp_path, monkeypatch, capsys):
    config = write_config(tmp_path)
    code, out, _ = plan_cli(["--config", config, "--plan", "--world", "4", "--gpu-memory", "0.3"], monkeypatch, capsys)
    assert code == 1 and "DOES NOT FIT" in out, out
    fixes = [line.split("fix: ", 1)[1].split("  -> ")[0] for line in out.splitlines() if "fix: " in line
             and "(everything fits)" in line]
    assert fixes, out
    for fix in fixes:
        words = shlex.split(fix)
        overrides = [w for w in words if "=" in w]
        C.load_config(config, overrides)  # the names are the config's own keys
        code, again, _ = plan_cli(["--config", config, "--plan", "--world", "4", "--gpu-memory", "0.3", *words],
                                  monkeypatch, capsys)
        assert code == 0, f"{fix}\n{again}"


@pytest.mark.parametrize("gpu,mode", [("0.5", "split"), ("0.7", "colocate")])
def test_suggest_prints_a_placement_that_loads_and_checks(tmp_path, monkeypatch, capsys, gpu, mode):
    config = write_config(tmp_path)
    colocated = C.load_config(config)
    P.check_plan(colocated, 4)
    fits = P.make_plan(colocated, 4, int(float(gpu) * P.GiB)).fits
    assert fits == (mode == "colocate")  # at 0.5 GiB the colocated pool does not fit: split it is
    code, out, _ = plan_cli(["--config", config, "--plan", "--world", "4", "--gpu-memory", gpu, "--suggest"],
                            monkeypatch, capsys)
    assert code == 0, out
    block = out[out.rindex("\nplacement:") + 1:]
    suggested = tmp_path / "suggested.yaml"
    suggested.write_text(f"base: {config}\n{block}")
    cfg = C.load_config(str(suggested))
    assert cfg.placement.mode == mode
    C.check_world(cfg, 4)
    if mode == "split":
        assert sum(p.size for p in cfg.placement.pools) == 4 and len(cfg.placement.pools) == 2
    code, out, _ = plan_cli(["--config", str(suggested), "--plan", "--world", "4", "--gpu-memory", gpu],
                            monkeypatch, capsys)
    assert code == 0, out


def test_json_gives_the_per_rank_totals(tmp_path, monkeypatch, capsys):
    config = write_config(tmp_path, reward_model=False)
    code, out, _ = plan_cli(["--config", config, "--plan", "--world", "2", "--gpu-memory", "80", "--json",
                             "placement.mode=split", "placement.pools=[{name: a, size: 1, roles: [actor, reward]},"
                             " {name: b, size: 1, roles: [critic, reference]}]"], monkeypatch, capsys)
    assert code == 0, out
    plan = json.loads(out)
    assert plan["world"] == 2 and plan["fits"] is True and plan["gpu_memory_bytes"] == 80 * P.GiB
    assert [r["rank"] for r in plan["ranks"]] == [0, 1]
    assert [r["pool"] for r in plan["ranks"]] == ["a", "b"]
    actor_pool = plan["pools"][0]
    assert plan["ranks"][0]["peak_bytes"] == max(actor_pool["phases"].values()) > 0
    assert plan["ranks"][1]["peak_bytes"] == 0  # GRPO: no critic, no reference; this pool idles


def test_a_rollout_over_the_world_plans_an_engine_on_every_pool(tmp_path, monkeypatch, capsys):
    # rollout.ranks=all: the pool without the actor generates too, on a whole copy of the actor's weights (tp 1)
    config = write_config(tmp_path, reward_model=False)

    def pools(tp: int, *extra: str) -> list[dict]:
        placement = (f"placement.pools=[{{name: a, size: 2, roles: [actor, reward], tp: {tp}}},"
                     " {name: b, size: 1, roles: [critic, reference]}]")
        code, out, _ = plan_cli(["--config", config, "--plan", "--world", "3", "--gpu-memory", "80", "--json",
                                 "placement.mode=split", placement, "algorithm.adv_estimator=gae", *extra],
                                monkeypatch, capsys)
        assert code == 0, out
        return json.loads(out)["pools"]

    whole = pools(1, "rollout.ranks=all")[0]["engine"]["weights"]  # the actor's engine at tp 1: the whole model
    actor, other = pools(2, "rollout.ranks=all")
    assert other["engine"]["kind"] == "native" and other["phases"]["rollout"] > 0
    assert other["engine"]["weights"] == whole > actor["engine"]["weights"]
    alone = pools(2)[1]  # rollout.ranks=auto with the native engine: the actor's pool alone generates
    assert alone["engine"] is None
    # the replica stays between rollouts: every phase of the critic and the reference holds it too
    assert alone["phases"].keys() == other["phases"].keys() - {"rollout"} == {"critic update", "critic forward"}
    # and, resident (the default), its fused copies, KV cache and graphs' pool (slots x vocabulary x 16, and a graphed
    # prefill's activations)
    graphs = other["engine"]["slots"] * 32000 * 16 + PREFILL_POOL
    assert other["engine"]["kept"] == other["engine"]["fused"] + other["engine"]["kv"] + graphs > graphs
    assert all(other["phases"][k] == v + whole + other["engine"]["kept"] for k, v in alone["phases"].items())


def test_a_resident_engine_holds_its_copy_and_cache_in_every_phase(tmp_path, monkeypatch, capsys):
    # rollout.resident on the actor's pool (FSDP2): the engine copies the gathered model and keeps the copy, its
    # KV cache and its decode graphs' pool between rollouts; the gathered model is freed before the decoding and
    # gathered again next time beside what is kept.
    from tasks.tiny_model import build_tiny_causal_lm

    config = write_config(tmp_path, reward_model=False)

    def pool(resident: bool) -> dict:
        code, out, _ = plan_cli(["--config", config, "--plan", "--world", "1", "--gpu-memory", "80", "--json",
                                 f"rollout.resident={str(resident).lower()}"], monkeypatch, capsys)
        assert code == 0, out
        return json.loads(out)["pools"][0]

    kept, plain = pool(True), pool(False)
    whole = 4 * sum(p.numel() for p in build_tiny_causal_lm(32000, **TINY).parameters())  # float32 (quickstart)
    # quickstart: 32 prompts x 4 samples on one rank, slots of 16 + 5 tokens rounded up to 8; per token 2 (k, v)
    # x 2 layers x 2 kv heads x 16 (head_dim) floats
    kv = 32 * 4 * 24 * (2 * 2 * 2 * 16 * 4)
    graphs = 32 * 4 * 32000 * 16 + PREFILL_POOL  # 128 slots' logits and sampling temporaries, a graphed prefill
    e, p = kept["engine"], plain["engine"]
    assert (e["weights"], e["fused"], e["kv"], e["kept"], e["frees_gathered"]) == \
        (whole, whole, kv, whole + kv + graphs, True)
    assert (p["kept"], p["frees_gathered"]) == (0, False) and 0 < p["fused"] < whole
    assert kept["phases"].keys() == plain["phases"].keys()
    for phase, held in plain["phases"].items():
        if phase != "rollout":
            assert kept["phases"][phase] == held + whole + kv + graphs, phase
    state = plain["phases"]["rollout"] - (p["weights"] + p["fused"] + p["work"] + p["kv"])
    assert kept["phases"]["rollout"] == state + whole + kv + max(whole + graphs, e["work"])
    # A cache the GPU share cuts short (here fewer slots than the 128 sequences) is not kept by the engine, but a
    # first rollout, before the optimizer's state exists, may keep it uncut: the plan counts the uncut cache as kept.
    cfg = C.load_config(config, ["rollout.max_new_tokens=100"])
    # slots of 16 + 100 tokens rounded to 120
    uncut = whole + 128 * 120 * (2 * 2 * 2 * 16 * 4) + 128 * 32000 * 16 + PREFILL_POOL
    for gib, cut in ((0.54, True), (0.62, False)):
        e = P.make_plan(cfg, 1, int(gib * P.GiB)).pools[0].engine
        assert e.error is None and (e.slots < 128) == cut, (gib, e)
        assert e.kept == uncut
        assert e.total == whole + max(uncut, e.kv + e.work)  # copy + (kept + gathered, or cache + transient)
    # kv_cache_tokens sizes the cache the engine keeps: 40 slots of 120 tokens
    e = P.make_plan(C.load_config(config, ["rollout.max_new_tokens=100", "rollout.kv_cache_tokens=4800"]), 1,
                    int(0.62 * P.GiB)).pools[0].engine
    assert e.slots == 40 and e.kept == whole + e.kv + 40 * 32000 * 16 + PREFILL_POOL


def test_world_from_torchrun_environment(tmp_path, monkeypatch, capsys):
    import train_ppo

    config = write_config(tmp_path, reward_model=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert train_ppo.main(["--config", config, "--plan", "--gpu-memory", "80"]) == 0
    assert "plan: world 2," in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--world", "0"], "config error: --world 0: must be > 0"),
    (["--world", "3", "placement.tp=2"], "placement.tp=2: must divide the pool size 3"),
    (["--world", "3", "placement.mode=split", "placement.pools=[{name: a, size: 2, roles: [actor, reward]}, "
      "{name: b, size: 2, roles: [critic]}]"], "pool sizes add up to 4 (a=2 + b=2) but the world size is 3"),
    (["--world", "2", "model.path=/nonexistent"], "model.path='/nonexistent': no config.json there"),
])
def test_bad_world_or_model_exits_2_with_the_config_error(tmp_path, monkeypatch, capsys, argv, message):
    config = write_config(tmp_path, reward_model=False)
    code, _, err = plan_cli(["--config", config, "--plan", *argv], monkeypatch, capsys)
    assert code == 2 and message in err, err


def test_quickstart_before_its_first_run_says_so(tmp_path, monkeypatch, capsys):
    code, _, err = plan_cli(["--config", "configs/quickstart.yaml", "--plan", f"quickstart.workdir={tmp_path}",
                             f"model.path={tmp_path / 'sft'}"], monkeypatch, capsys)
    assert code == 2 and "quickstart.enabled=true: the tiny model is built at run time" in err, err


if __name__ == "__main__":
    from parallel.distributed import exit_process

    fsdp_worker(sys.argv[1], sys.argv[2])
    exit_process(0)  # gloo aborts about one interpreter shutdown in ten (parallel/distributed.exit_process)
