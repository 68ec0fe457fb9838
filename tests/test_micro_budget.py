"""micro_batch_tokens: auto (issue 37, fast defaults): the budget sized from a GPU's free memory by the planner's model.

- the rule (plan.largest_budget with plan.auto_limit) against a slow scan over every whole-row budget with the
  planner's activation bytes (plan.activation_bytes);
- a config's budget (plan.auto_budgets, what train_ppo.py resolves at start-up through plan.resolve_at_start)
  against a slow scan over make_plan with each explicit budget: the largest whose phases fit the usable memory, a
  rank's rows when memory allows them all, the fewest rows any pool allows, the fixed budget on the CPU;
- `auto` parses (YAML and key=value), an integer still works as one, a bad value names the key;
- --plan prints auto's pick and why; a CPU run through train_ppo.py with the defaults trains at the fixed budget and
  writes it to the run's config.yaml; bench/ppo_step.py --defaults reports the ratio of its two runs.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import yaml

import config as C
import plan as P
from conftest import ROOT, explain, run_python

GiB = 2**30
QWEN_05B = str(ROOT / "configs" / "models" / "qwen2.5-0.5b.json")
QWEN_15B = str(ROOT / "configs" / "models" / "qwen2.5-1.5b.json")
# the bench's step (bench/ppo_step.py): 8 prompts x 8 samples of 128 + 256 tokens, GRPO without a reference
BENCH = ["data.batch_size=8", "rollout.n=8", "data.max_prompt_len=128", "rollout.max_new_tokens=256",
         "algorithm.adv_estimator=grpo", "algorithm.kl.in_reward=false", "algorithm.kl.in_loss=false",
         "data.eval_path=null", "run.device=auto"]
# PPO with a critic and a reference on a pool of their own: the reference's forwards use the actor's budget there
SPLIT = ["algorithm.adv_estimator=gae", "algorithm.kl.in_loss=true", "placement.mode=split",
         "placement.pools=[{name: a, size: 1, roles: [actor, reward]}, {name: b, size: 1, roles: [critic, reference]}]"]
FREE_GIB = (50, 30)  # each rank's free memory in the two-rank run (rank 1's pool then holds the actor's budget down)


def bench_config(tmp_path, model=QWEN_05B, *extra: str) -> C.Config:
    path = tmp_path / "bench.yaml"
    path.write_text(f"model: {{path: {model}}}\ndata: {{train_path: {tmp_path / 'absent.jsonl'}}}\n"
                    "reward: {functions: [{spec: gsm8k}]}\n")
    cfg = C.load_config(str(path), [*BENCH, *extra])
    P.check_plan(cfg, 1 if "placement.mode=split" not in extra else 2)
    return cfg


def usable(free: int) -> int:
    """What the phases may fill: the free bytes less 10% of them, 2 GiB at least (the rule as stated)."""
    return free - max(free // 10, 2 * GiB)


# ---------------------------------------------------------------------------------------------------------------
# the rule


@pytest.mark.parametrize("model,checkpointing", [(QWEN_05B, False), (QWEN_15B, False), (QWEN_15B, True)])
def test_the_rule_is_the_largest_whole_row_budget_whose_bytes_fit(model, checkpointing):
    m = P.model_shape(model, "lm", "model.path")
    width, rows, state = 384, 64, 3 * GiB  # a step's rows of 128 + 256 tokens; the training state beside them

    def cost(tokens: int) -> int:
        full, ckpt, _ = P.activation_bytes(m, tokens, width, 1, 2)
        return state + (ckpt if checkpointing else full)

    def slow(free: int) -> int:  # every budget of k whole rows, the largest that fits; one row when none does
        fitting = [k for k in range(1, rows + 1) if cost(k * width) <= usable(free)]
        return max(fitting, default=1) * width

    # free memory from too little for one row to more than all rows need, and each k's exact edge (the free memory
    # whose usable bytes equal the cost of k rows: k fits there, one byte less and it does not)
    frees = [n * GiB // 4 for n in range(1, 4 * 200)]
    for k in (1, 2, 17, 63, 64):
        edge = cost(k * width) + 2 * GiB if cost(k * width) < 18 * GiB else -(-cost(k * width) * 10 // 9)
        frees += [edge - 1, edge, edge + 1]
    assert P.auto_limit(10 * GiB) == usable(10 * GiB) and P.auto_limit(100 * GiB) == usable(100 * GiB)
    for free in frees:
        assert P.largest_budget(P.auto_limit(free), cost, width, rows) == slow(free), free / GiB
    # the ends: one row when nothing fits, all rows (and no more) when everything does
    assert slow(GiB) == width and slow(10_000 * GiB) == rows * width


# ---------------------------------------------------------------------------------------------------------------
# a config's budget


def slow_budget(cfg: C.Config, world: int, free: int, section: str = "actor") -> int:
    """The largest whole-row budget whose plan (make_plan with it explicit) keeps every phase it sizes within the
    usable bytes on every pool, scanning every row count up to a rank's share; one row when none fits."""
    width = P.row_width(cfg)
    rows = cfg.data.batch_size * cfg.rollout.n  # no pool holds more rows in one forward than the whole batch
    users = {"actor": ("actor", "reference", "reward", "teacher"), "critic": ("critic",)}[section]
    best = 1
    for k in range(1, rows + 1):
        # the other budget, if auto, at one row: it sizes none of these phases
        other = [(f"{o}.micro_batch_tokens", width) for o in ("actor", "critic")
                 if o != section and getattr(cfg, o).micro_batch_tokens == "auto"]
        trial = P.with_values(cfg, [(f"{section}.micro_batch_tokens", k * width), *other])
        plan = P.make_plan(trial, world, free)
        sized = [v for pp in plan.pools for phase, v in pp.phases.items() if phase.split()[0] in users]
        if max(sized) <= usable(free):
            best = k
    return best * width


def test_a_config_gets_the_largest_budget_that_fits_and_all_of_a_ranks_rows_when_memory_allows(tmp_path):
    cfg = bench_config(tmp_path)
    assert (cfg.actor.micro_batch_tokens, cfg.critic.micro_batch_tokens) == ("auto", "auto")  # the defaults
    width = 384  # 128 + 256, a multiple of 16
    for free_gib in (6, 12, 20, 40, 60, 80):
        tokens, pools = P.auto_budgets(cfg, 1, free_gib * GiB)["actor"]
        assert tokens == slow_budget(cfg, 1, free_gib * GiB), free_gib
        assert pools[0].limit == usable(free_gib * GiB)
    # a GPU with room for the whole step: every one of the rank's 64 rows in one forward (the bench's own budget)
    assert P.auto_budgets(cfg, 1, 141 * GiB)["actor"][0] == 8 * 8 * width
    # two ranks share the batch: at most 32 rows each
    assert P.auto_budgets(cfg, 2, 141 * GiB)["actor"][0] == 8 * 8 // 2 * width
    # a budget no role of the run uses (GRPO: no critic) is the fixed one, as on the CPU
    assert P.auto_budgets(cfg, 1, 141 * GiB)["critic"] == (C.FIXED_MICRO_BATCH_TOKENS, [])
    cpu = P.with_values(cfg, [("run.device", "cpu")])
    assert {s: t for s, (t, _) in P.auto_budgets(cpu, 1, 141 * GiB).items()} == \
        {"actor": C.FIXED_MICRO_BATCH_TOKENS, "critic": C.FIXED_MICRO_BATCH_TOKENS}
    # an explicit integer is left as it is
    fixed = P.with_values(cfg, [("actor.micro_batch_tokens", 4096)])
    assert list(P.auto_budgets(fixed, 1, 141 * GiB)) == ["critic"]
    assert P.resolved(fixed, 1, 141 * GiB).actor.micro_batch_tokens == 4096


def test_the_critic_and_split_pools_each_hold_the_budget_to_what_fits_them(tmp_path):
    cfg = bench_config(tmp_path, QWEN_15B, *SPLIT)
    for free_gib in (30, 50):
        found = P.auto_budgets(cfg, 2, free_gib * GiB)
        assert found["actor"][0] == slow_budget(cfg, 2, free_gib * GiB, "actor"), free_gib
        assert found["critic"][0] == slow_budget(cfg, 2, free_gib * GiB, "critic"), free_gib
        assert [b.pool for b in found["actor"][1]] == ["a", "b"] and [b.pool for b in found["critic"][1]] == ["b"]


def test_the_start_up_resolution_sets_the_config_as_the_plan_says(tmp_path):
    cfg = bench_config(tmp_path)
    want = P.auto_budgets(cfg, 1, 40 * GiB)["actor"][0]
    lines = P.resolve_at_start(cfg, 0, 1, torch.device("cpu"), free=40 * GiB)
    assert cfg.actor.micro_batch_tokens == want and cfg.critic.micro_batch_tokens == C.FIXED_MICRO_BATCH_TOKENS
    assert lines[0].startswith(f"actor.micro_batch_tokens=auto -> {want} ({want // 384} rows of 384 tokens: the "
                               "most rows that fit; pool all: actor update plans"), lines
    assert P.resolve_at_start(cfg, 0, 1, torch.device("cpu")) == []  # nothing left to size
    cpu = bench_config(tmp_path)  # on the CPU without a measured free memory: the fixed budget
    assert P.resolve_at_start(cpu, 0, 1, torch.device("cpu")) == [
        f"{s}.micro_batch_tokens=auto -> {C.FIXED_MICRO_BATCH_TOKENS}: the fixed budget on the CPU"
        for s in ("actor", "critic")]
    assert (cpu.actor.micro_batch_tokens, cpu.critic.micro_batch_tokens) == (C.FIXED_MICRO_BATCH_TOKENS,) * 2


def resolve_worker(tmp: str, out: str) -> None:
    """torchrun --nproc_per_node 2 tests/test_micro_budget.py TMP OUT: resolve_at_start on two gloo ranks of SPLIT,
    each with its own free memory; writes each rank's resolved budgets."""
    from pathlib import Path

    import torch.distributed as dist

    from parallel.distributed import init_distributed

    info = init_distributed("gloo", device="cpu")
    own = Path(tmp) / f"rank{info.rank}"  # a config file of its own
    own.mkdir()
    cfg = bench_config(own, QWEN_15B, *SPLIT)
    P.resolve_at_start(cfg, info.rank, 2, torch.device("cpu"), free=FREE_GIB[info.rank] * GiB)
    Path(f"{out}.{info.rank}").write_text(json.dumps([cfg.actor.micro_batch_tokens, cfg.critic.micro_batch_tokens]))
    dist.destroy_process_group()


def test_ranks_agree_on_the_fewest_rows_any_ranks_memory_allows(tmp_path):
    from conftest import torchrun

    proc = torchrun([__file__, str(tmp_path), str(tmp_path / "out")], nproc=2, timeout=180)
    assert proc.returncode == 0, explain(proc)
    got = [json.loads((tmp_path / f"out.{rank}").read_text()) for rank in (0, 1)]
    # each pool by its own rank's memory (pool_budget), then the fewest rows any pool allows
    cfg = bench_config(tmp_path, QWEN_15B, *SPLIT)
    base = P.with_values(cfg, [("actor.micro_batch_tokens", 384), ("critic.micro_batch_tokens", 384)])
    models, pools = P.role_models(cfg), C.pools_of(cfg, 2)
    want = []
    for section in ("actor", "critic"):
        found = [P.pool_budget(base, models, section, pool, i, FREE_GIB[i] * GiB) for i, pool in enumerate(pools)]
        found = [b for b in found if b is not None]
        held = [b.rows for b in found if b.rows < b.cap]  # a pool at its cap holds the budget to nothing
        want.append((min(held) if held else max(b.cap for b in found)) * 384)
    assert got == [want, want]
    assert want[0] < P.auto_budgets(cfg, 2, FREE_GIB[0] * GiB)["actor"][0]  # the poorer rank held the budget down


# ---------------------------------------------------------------------------------------------------------------
# the config key


def test_auto_parses_an_integer_stays_one_and_a_bad_value_names_the_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("actor: {micro_batch_tokens: auto}\ncritic: {micro_batch_tokens: 16384}\n")
    cfg = C.load_config(str(path))
    assert cfg.actor.micro_batch_tokens == "auto" and cfg.critic.micro_batch_tokens == 16384
    cfg = C.load_config(None, ["actor.micro_batch_tokens=4096", "critic.micro_batch_tokens=auto"])
    assert (cfg.actor.micro_batch_tokens, cfg.critic.micro_batch_tokens) == (4096, "auto")
    assert C.load_config(None).actor.micro_batch_tokens == "auto"
    C.check_ranges(cfg, C.PPO_RANGES)  # auto passes the range check
    for value in ("big", "1.5", "true", "[8192]"):
        with pytest.raises(C.ConfigError, match=r"^actor\.micro_batch_tokens=.*: expected an integer or 'auto'$"):
            C.load_config(None, [f"actor.micro_batch_tokens={value}"])
    with pytest.raises(C.ConfigError, match=r"critic\.micro_batch_tokens=0: must be in \[1, inf\)"):
        C.check_ranges(C.load_config(None, ["critic.micro_batch_tokens=0"]), C.PPO_RANGES)


# ---------------------------------------------------------------------------------------------------------------
# the command lines


def test_plan_prints_what_auto_picks_and_why(tmp_path):
    cfg = bench_config(tmp_path, QWEN_15B)
    want = P.auto_budgets(cfg, 1, 80 * GiB)["actor"][0]
    config = tmp_path / "bench.yaml"
    args = ["train_ppo.py", "--config", str(config), "--plan", "--gpu-memory", "80", *BENCH]
    proc = run_python(args)
    assert proc.returncode == 0, explain(proc)
    line = next(x for x in proc.stdout.splitlines() if "actor.micro_batch_tokens=auto" in x)
    assert line.strip().startswith(f"actor.micro_batch_tokens=auto -> {want} ({want // 384} rows of 384 tokens: "
                                   "the most rows that fit"), line
    assert f"of {usable(80 * GiB) / GiB:.2f} usable at {want // 384} rows" in line
    proc = run_python([*args, "--json"])
    assert proc.returncode == 0, explain(proc)
    assert json.loads(proc.stdout)["auto_budgets"]["actor.micro_batch_tokens"]["tokens"] == want


def test_a_cpu_run_with_the_defaults_trains_at_the_fixed_budget(tmp_path):
    from tasks.char_tokenizer import build_char_tokenizer
    from tasks.synthetic import write_addition_dataset
    from tasks.tiny_model import save_tiny_model

    tokenizer = build_char_tokenizer("0123456789+=")
    save_tiny_model(tmp_path / "model", tokenizer, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                    intermediate_size=64, max_position_embeddings=64, seed=0)
    write_addition_dataset(tmp_path, n_train=16, n_test=4, seed=0, digits=(1, 1))
    cfg = {"run": {"name": "t", "output_dir": str(tmp_path / "runs"), "total_steps": 2, "eval_every": 0,
                   "device": "cpu", "tensorboard": False},
           "model": {"path": str(tmp_path / "model")},
           "data": {"train_path": str(tmp_path / "train.jsonl"), "eval_path": None, "max_prompt_len": 8,
                    "batch_size": 4},
           "rollout": {"n": 2, "max_new_tokens": 4},
           "algorithm": {"adv_estimator": "gae"},  # a critic too: both budgets auto
           "reward": {"functions": [{"spec": "tests.user_rewards:ones_fraction"}], "num_workers": 1},
           "checkpoint": {"save_every": 0}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = run_python(["train_ppo.py", "--config", str(path)])
    assert proc.returncode == 0, explain(proc)
    for section in ("actor", "critic"):
        assert f"{section}.micro_batch_tokens=auto -> {C.FIXED_MICRO_BATCH_TOKENS}: the fixed budget on the CPU" \
            in proc.stderr
    saved = yaml.safe_load((tmp_path / "runs" / "t" / "config.yaml").read_text())
    assert saved["actor"]["micro_batch_tokens"] == saved["critic"]["micro_batch_tokens"] == \
        C.FIXED_MICRO_BATCH_TOKENS
    rows = [json.loads(x) for x in (tmp_path / "runs" / "t" / "metrics.jsonl").read_text().splitlines()]
    assert sum("timing_s/step" in r for r in rows) == 2


def test_the_bench_reports_the_defaults_against_the_bench_config(tmp_path):
    # bench/ppo_step.py --defaults: each meshrl point twice, the bench config's run then the default config's; the
    # report (also from saved results) gives both steady s/step and their ratio
    bench = [0.50] * 3 + [0.52, 0.50, 0.51]
    defaults = [0.9] * 3 + [0.54, 0.56, 0.55]
    common = dict(model="qwen2.5-0.5b", lengths="fixed", params=494_000_000, tokens=24576, response_len=256.0,
                  start_s=10.0, nproc=1, update_actor=[0.16] * 6)
    results = [dict(common, system="meshrl", steps=bench, defaults=False, micro_batch_tokens=24576),
               dict(common, system="meshrl (defaults: micro-batch auto -> 24576)", steps=defaults, defaults=True,
                    micro_batch_tokens=24576)]
    saved = tmp_path / "results.json"
    saved.write_text(json.dumps(results))
    proc = subprocess.run([sys.executable, "bench/ppo_step.py", "--report", str(saved)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, explain(proc)
    steady_bench, steady_defaults = sorted(bench[3:])[1], sorted(defaults[3:])[1]  # medians after the first three
    assert (f"defaults qwen2.5-0.5b fixed: {steady_defaults:.3f} s/step (micro-batch auto -> 24576) vs bench config "
            f"{steady_bench:.3f} s/step (micro-batch 24576): {steady_defaults / steady_bench:.3f}x (target <= 1.10)") \
        in proc.stdout, proc.stdout


if __name__ == "__main__":
    from parallel.distributed import exit_process

    resolve_worker(sys.argv[1], sys.argv[2])
    exit_process(0)  # gloo aborts about one interpreter shutdown in ten (parallel/distributed.exit_process)
