"""train_sft.py on 2 gloo ranks (FSDP2): the saved HF folder loads with transformers and has learned the pairs."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import explain, torchrun
from roles.sft import encode_pairs, sft_loss
from tasks.char_tokenizer import build_char_tokenizer
from tasks.tiny_model import save_tiny_model


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_sft_two_ranks_saves_a_loadable_model_that_learned(tmp_path, lora):
    """The full model saves as an HF folder; with actor.lora (tests/test_lora.py's adapters) an adapter folder only,
    which peft puts on the start model."""
    from test_lora import LORA

    tokenizer = build_char_tokenizer("0123456789+=")
    save_tiny_model(tmp_path / "init", tokenizer, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                    intermediate_size=64, max_position_embeddings=64, seed=0)
    pairs = [{"prompt": f"{a}+{a}=", "response": str(2 * a)} for a in range(10)]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    cfg = {"run": {"device": "cpu", "seed": 0}, "model": {"path": str(tmp_path / "init")},
           "actor": {"fsdp": {"param_dtype": "float32"}, **(LORA if lora else {})},
           "sft": {"train_path": str(tmp_path / "sft.jsonl"), "steps": 60, "batch_size": 8, "lr": 1e-2,
                   "output_dir": str(tmp_path / "out")}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    proc = torchrun(["train_sft.py", "--config", str(tmp_path / "c.yaml")], nproc=2, timeout=300)
    assert proc.returncode == 0, explain(proc)

    encoded = encode_pairs(pairs, tokenizer)
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
