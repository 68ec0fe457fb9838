"""train_sft.py: on 2 gloo ranks (FSDP2) the saved HF folder loads with transformers and has learned the pairs; in
this process (a world of one) LoRA's adapter folder, TRL's formats with the loss on the completions and the assistant
turns, the run folder (metrics, TensorBoard, config.yaml), the eval loss, the LR schedule, and a Ctrl-C'd run that
goes on from its checkpoint to the very weights of an uninterrupted one."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

import config as C
from conftest import explain, torchrun
from roles.sft import encode_pairs, sft_loss
from tasks.char_tokenizer import build_char_tokenizer
from tasks.tiny_model import save_tiny_model


def tiny(tmp_path, chat_template: str | None = None):
    tokenizer = build_char_tokenizer("0123456789+=")
    if chat_template:
        tokenizer.chat_template = chat_template
    save_tiny_model(tmp_path / "init", tokenizer, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                    intermediate_size=64, max_position_embeddings=64, seed=0)
    return tokenizer


def sft_config(tmp_path, pairs, lora: bool = False, **sft) -> str:
    from test_lora import LORA

    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    cfg = {"run": {"device": "cpu", "seed": 0, "output_dir": str(tmp_path / "runs"), "name": "sft",
                   "tensorboard": False},
           "model": {"path": str(tmp_path / "init")},
           "actor": {"fsdp": {"param_dtype": "float32"}, **(LORA if lora else {})},
           "sft": {"train_path": str(tmp_path / "sft.jsonl"), "steps": 60, "batch_size": 8, "lr": 1e-2,
                   "output_dir": str(tmp_path / "out"), **sft}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    return str(tmp_path / "c.yaml")


ADDITION = [{"prompt": f"{a}+{a}=", "response": str(2 * a)} for a in range(10)]


def assert_learned(tmp_path, tokenizer, lora: bool) -> None:
    encoded = encode_pairs(ADDITION, tokenizer)
    before = AutoModelForCausalLM.from_pretrained(tmp_path / "init")
    with torch.no_grad():
        loss_before = sft_loss(before, encoded, torch.device("cpu")).item()
    if lora:
        from peft import PeftModel

        assert (tmp_path / "out" / "adapter_config.json").is_file() and not (tmp_path / "out" / "config.json").exists()
        after = PeftModel.from_pretrained(before, tmp_path / "out").eval()
    else:
        after = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
        assert AutoTokenizer.from_pretrained(tmp_path / "out").encode("12+3=") == tokenizer.encode("12+3=")
    with torch.no_grad():
        loss_after = sft_loss(after, encoded, torch.device("cpu")).item()
    # 10 pairs, 60 steps at lr 1e-2: memorised, far below the ~ln(16) of a random model
    assert loss_after < 0.5 * loss_before, (loss_before, loss_after)


def test_sft_two_ranks_saves_a_loadable_model_that_learned(tmp_path):
    """The full model, sharded over 2 ranks, saves as an HF folder; the held-out loss is taken on both ranks."""
    tokenizer = tiny(tmp_path)
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(p) + "\n" for p in ADDITION[:3]))
    cfg = sft_config(tmp_path, ADDITION, eval_path=str(tmp_path / "eval.jsonl"))
    proc = torchrun(["train_sft.py", "--config", cfg], nproc=2, timeout=300)
    assert proc.returncode == 0, explain(proc)
    assert_learned(tmp_path, tokenizer, lora=False)
    rows = [json.loads(line) for line in (tmp_path / "runs" / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 0 and rows[-1]["step"] == 60 and rows[-1]["eval/loss"] < 0.5 * rows[0]["eval/loss"]


def run_sft(*argv: str) -> int:
    """train_sft.py's main in this process (a world of one), on one thread as the launched runs (OMP_NUM_THREADS=1:
    two threads of two test processes on two cores run several times slower)."""
    import train_sft

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train_sft.main(list(argv))
    finally:
        torch.set_num_threads(threads)


def test_lora_sft_saves_an_adapter_folder_that_learned(tmp_path):
    """With actor.lora (tests/test_lora.py's adapters) an adapter folder only, which peft puts on the start model."""
    tokenizer = tiny(tmp_path)
    # checkpoint.save_final false: the adapter folder is written, no checkpoint at the end
    assert run_sft("--config", sft_config(tmp_path, ADDITION, lora=True), "checkpoint.save_final=false") == 0
    assert_learned(tmp_path, tokenizer, lora=True)
    assert not list((tmp_path / "runs").glob("*/checkpoints/step_*"))


# a user's turn ends in '=', an assistant's in '+' (the char tokenizer knows no other symbols)
TURNS = "{% for m in messages %}{{ m['content'] }}{{ '=' if m['role'] == 'user' else '+' }}{% endfor %}"
TRL_RECORDS = [
    {"prompt": "1+1", "response": "2"},  # ours
    {"prompt": [{"role": "user", "content": "2+2"}], "completion": [{"role": "assistant", "content": "4"}]},  # TRL
    {"prompt": "3+3", "completion": "6"},  # TRL's prompt/completion, text
    {"messages": [{"role": "user", "content": "4+4"}, {"role": "assistant", "content": "8"},  # TRL's messages
                  {"role": "user", "content": "1+2"}, {"role": "assistant", "content": "3"}]},
]


def test_trl_formats_train_the_completions_and_the_assistant_turns_only(tmp_path):
    """prompt/completion (text or conversational) as prompt/response; a conversation's loss on its assistant turns
    (TRL's assistant_only_loss), each turn encoded as train_ppo.py would have the model generate it."""
    from tasks.data import load_sft_records

    tokenizer = build_char_tokenizer("0123456789+=")
    tokenizer.chat_template = TURNS
    (tmp_path / "trl.jsonl").write_text("".join(json.dumps(r) + "\n" for r in TRL_RECORDS))
    records = load_sft_records(tmp_path / "trl.jsonl")
    assert records[1] == {"prompt": [{"role": "user", "content": "2+2"}], "response": "4"}
    assert records[2] == {"prompt": "3+3", "response": "6"}
    encoded = encode_pairs(records, tokenizer, chat_template=True)
    trained = [[tokenizer.decode(ids[a:b]) for a, b in ([(spans, len(ids))] if isinstance(spans, int) else spans)]
               for ids, spans in encoded]
    eos = tokenizer.eos_token
    assert trained == [["2" + eos], ["4" + eos], ["6" + eos], ["8+", "3+"]], trained
    assert tokenizer.decode(encoded[3][0]) == "4+4=8+1+2=3+"
    # the loss takes exactly those tokens: a model's loss over the trained tokens equals sft_loss
    model = save_tiny_model(tmp_path / "m", tokenizer, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                            intermediate_size=32, max_position_embeddings=64, seed=0).eval()
    ids = torch.tensor([encoded[3][0]])
    with torch.no_grad():
        logp = model(input_ids=ids).logits.log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
        picked = [t - 1 for a, b in encoded[3][1] for t in range(a, b)]
        assert -logp[picked].mean().item() == pytest.approx(sft_loss(model, [encoded[3]], torch.device("cpu")).item(),
                                                            rel=1e-5)
    with pytest.raises(ValueError, match="rewrites earlier turns"):
        tokenizer.chat_template = "{% for m in messages[-2:] %}{{ m['content'] }}={% endfor %}"
        encode_pairs(records[3:], tokenizer)


def test_run_folder_eval_schedule_and_ctrl_c_then_resume_reach_the_uninterrupted_weights(tmp_path, monkeypatch,
                                                                                         capfd):
    """Two runs of TRL-format records with an eval file, warmup then cosine: one uninterrupted, one Ctrl-C'd during
    step 3 (it finishes the step, saves and exits 0 without an output folder) and started again (it goes on from
    step 3). Both log every step to metrics.jsonl (once each), eval/loss at 0, 3 and 6, TensorBoard events and
    config.yaml, a console line every run.log_every steps; the second ends with the first's weights, bit for bit."""
    from safetensors.torch import load_file

    import train_sft
    from roles.update_loop import lr_factor

    tiny(tmp_path, TURNS)
    (tmp_path / "eval.jsonl").write_text(json.dumps(TRL_RECORDS[3]) + "\n")
    sft = {"steps": 6, "batch_size": 4, "warmup_steps": 2, "schedule": "cosine", "min_lr_ratio": 0.1,
           "eval_path": str(tmp_path / "eval.jsonl"), "eval_every": 3}
    cfg = sft_config(tmp_path, TRL_RECORDS * 2, **sft)
    common = ["--config", cfg, "run.log_every=2", "run.tensorboard=true", "data.chat_template=true"]
    assert run_sft(*common, "run.name=whole", f"sft.output_dir={tmp_path / 'whole'}") == 0
    console = capfd.readouterr().out
    assert [line.split()[1] for line in console.splitlines() if line.startswith("step ")] == \
        ["0/6", "2/6", "3/6", "4/6", "6/6"], console

    calls = {"n": 0}
    step = train_sft.sft_step

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return step(*args, **kwargs)

    monkeypatch.setattr(train_sft, "sft_step", interrupted)
    again = [*common, "run.name=again", f"sft.output_dir={tmp_path / 'again'}"]
    assert run_sft(*again) == 0
    assert "Ctrl-C: finishing this step" in capfd.readouterr().err
    run = tmp_path / "runs" / "again"
    assert sorted(os.listdir(run / "checkpoints")) == ["latest", "step_00000003"] and not (tmp_path / "again").exists()
    monkeypatch.setattr(train_sft, "sft_step", step)
    assert run_sft(*again) == 0
    assert "resuming at step 3" in capfd.readouterr().out

    whole, resumed = (load_file(tmp_path / name / "model.safetensors") for name in ("whole", "again"))
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[k], resumed[k]) for k in whole)
    rows = {name: [json.loads(line) for line in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]
            for name in ("whole", "again")}
    assert [r["step"] for r in rows["again"]] == list(range(7))
    assert [r.get("sft/loss") for r in rows["again"]] == [r.get("sft/loss") for r in rows["whole"]]
    assert [r["step"] for r in rows["whole"] if "eval/loss" in r] == [0, 3, 6]
    schedule = C.SFTConfig(lr=1e-2, **{k: v for k, v in sft.items() if k not in ("eval_path",)})
    assert [r["sft/lr"] for r in rows["whole"][1:]] == pytest.approx([1e-2 * lr_factor(k, schedule, 6)
                                                                      for k in range(6)])
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(run))
    assert yaml.safe_load((run / "config.yaml").read_text())["sft"]["eval_every"] == 3


def test_chat_message_prompts_are_templated_as_the_ppo_prompts_are():
    from tasks.char_tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer("0123456789+=")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}={% endfor %}"
    [(ids, prompt_len)] = encode_pairs([{"prompt": [{"role": "user", "content": "1+2"}], "response": "3"}], tokenizer)
    assert tokenizer.decode(ids[:prompt_len]) == "1+2=" and prompt_len == 4
    assert ids[prompt_len:] == tokenizer("3", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def test_text_prompts_take_data_chat_template_and_system_prompt_as_ppo_does():
    """train_sft.py / train_rm.py pass data.chat_template and data.system_prompt: their prompt ids are those of
    train_ppo.py's PromptDataset for the same prompt (text prompts were encoded raw before, whatever the config)."""
    from tasks.char_tokenizer import build_char_tokenizer
    from tasks.data import PromptDataset

    tokenizer = build_char_tokenizer("0123456789+=")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}={% endfor %}"
    records = [{"prompt": "1+2", "response": "3"}]
    for template, system in ((None, None), (True, None), (True, "9")):
        [(ids, prompt_len)] = encode_pairs(records, tokenizer, template, system)
        ppo = PromptDataset([{"prompt": "1+2"}], tokenizer, 64, template, system)[0]["prompt_ids"]
        assert ids[:prompt_len] == ppo, (template, system)
    assert tokenizer.decode(encode_pairs(records, tokenizer, True, "9")[0][0][:5]) == "9=1+2"
    with pytest.raises(ValueError, match="a system prompt is set but this text prompt is not templated"):
        encode_pairs(records, tokenizer, None, "9")
