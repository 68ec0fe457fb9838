"""The vLLM engine (rollout/vllm.py) against the native engine and stock vLLM, on one GPU, in one process.

    python bench/vllm_check.py --model runs/quickstart_assets/sft        # a trained model: parity
    python bench/vllm_check.py --model qwen2.5-0.5b --prompts 256        # random-init shape: speed and sync

With a trained HF folder (real weights, so greedy decoding is stable): greedy responses of the native engine and of
meshrl's vLLM engine on the same prompts (share of identical responses), and the vLLM log-probs of sampled responses
against the model's teacher-forced ones (mean and max |gap| per token). With a configs/models/<name>.json shape
(random bf16 weights): the weight sync time, then tokens/s of meshrl's vLLM engine and of the same vllm.LLM called
directly (stock: the same SamplingParams, no routing, no sleep / wake) on --prompts x (--prompt-len + --new), with
logprobs, in the same process. The last lines are a markdown table for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from algo.losses import logprobs_from_logits  # noqa: E402
from parallel.reshard import weight_buckets  # noqa: E402
from rollout.native import NativeEngine, SamplingParams  # noqa: E402
from rollout.vllm import VLLMEngine  # noqa: E402


def load(name: str, device: torch.device):
    from transformers import AutoConfig, AutoModelForCausalLM

    if name.endswith(".json") or not os.path.isdir(name):
        path = Path(name) if name.endswith(".json") else ROOT / "configs" / "models" / f"{name}.json"
        config = AutoConfig.for_model(**json.loads(path.read_text()))
        folder = Path("/tmp/vllm_check_model")
        config.save_pretrained(folder)  # vLLM reads the architecture; the weights come from the sync
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        return model.eval(), str(folder), False
    return AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32).to(device).eval(), name, True


def teacher_forced(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + response], device=next(model.parameters()).device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, len(prompt) - 1 : -1]
    return logprobs_from_logits(logits, ids[:, len(prompt) :])[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--data", default=None, help="jsonl with a 'prompt' column (trained model), for parity")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    args = parser.parse_args()
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "localhost"),
                       ("MASTER_PORT", "29533")):
        os.environ.setdefault(key, value)
    dist.init_process_group("nccl")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    model, path, trained = load(args.model, device)
    vocab = model.config.vocab_size
    engine = VLLMEngine(path, pad_token_id=0, gpu_memory_utilization=args.gpu_memory_utilization,
                        max_model_len=args.prompt_len + args.new + 8)
    sync_s = [engine.sync_weights(weight_buckets(model, dtype=torch.bfloat16, device=device)) for _ in range(3)]
    rows = [("engine init s", f"{engine.stats['engine_init_s']:.1f}"),
            ("weight sync s (3 runs)", " / ".join(f"{s:.3f}" for s in sync_s))]

    if trained:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
        texts = [json.loads(line)["prompt"] for line in open(args.data)][: args.prompts]
        prompts = [tokenizer(t)["input_ids"] for t in texts]
        stops = (tokenizer.eos_token_id,)
        greedy = SamplingParams(max_new_tokens=args.new, temperature=0, stop_token_ids=stops)
        native = NativeEngine(model, pad_token_id=tokenizer.pad_token_id).generate(prompts, greedy)
        ours = engine.generate(prompts, greedy)
        same = 0
        for i in range(len(prompts)):
            a = native.response_ids[i, : int(native.response_mask[i].sum())].tolist()
            b = ours.response_ids[i, : int(ours.response_mask[i].sum())].tolist()
            same += a == b
        sampled = engine.generate(prompts, SamplingParams(max_new_tokens=args.new, temperature=1.0, n=4,
                                                          stop_token_ids=stops), torch.Generator().manual_seed(0))
        gaps = []
        for i, prompt in enumerate(sampled.prompt_ids):
            n = int(sampled.response_mask[i].sum())
            ref = teacher_forced(model, prompt, sampled.response_ids[i, :n].tolist())
            gaps.append((sampled.logprobs[i, :n].float() - ref.float()).abs())
        gap = torch.cat(gaps)
        rows += [("greedy responses identical (native vs vLLM)", f"{same}/{len(prompts)}"),
                 ("vLLM log-prob gap to the model's, per token: mean / max",
                  f"{gap.mean():.4f} / {gap.max():.4f} nats over {gap.numel()} tokens")]
    else:
        gen = torch.Generator().manual_seed(1)
        prompts = torch.randint(1, vocab, (args.prompts, args.prompt_len), generator=gen).tolist()
        params = SamplingParams(max_new_tokens=args.new, min_new_tokens=args.new, temperature=1.0)
        engine.generate(prompts[:8], params, torch.Generator().manual_seed(0))  # warm-up
        began = time.perf_counter()
        out = engine.generate(prompts, params, torch.Generator().manual_seed(0))
        ours_s = time.perf_counter() - began
        tokens = int(out.response_mask.sum())
        engine.wake()
        vllm_params = engine.sampling_params(n=1, temperature=1.0, max_tokens=args.new, min_tokens=args.new,
                                             logprobs=0, detokenize=False, seed=0)
        requests = [engine.tokens_prompt(prompt_token_ids=p) for p in prompts]
        began = time.perf_counter()
        stock = engine.llm.generate(requests, vllm_params, use_tqdm=False)
        stock_s = time.perf_counter() - began
        stock_tokens = sum(len(o.outputs[0].token_ids) for o in stock)
        rows += [(f"meshrl vLLM engine tokens/s ({args.prompts} x ({args.prompt_len} + {args.new}), sleep/wake incl.)",
                  f"{tokens / ours_s:,.0f}"),
                 ("stock vllm.LLM.generate tokens/s (same process, same params)", f"{stock_tokens / stock_s:,.0f}"),
                 ("meshrl / stock", f"{(tokens / ours_s) / (stock_tokens / stock_s):.2f}")]
    print(f"\n| {args.model} | figure |\n| --- | --- |")
    for name, value in rows:
        print(f"| {name} | {value} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
