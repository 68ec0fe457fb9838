import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tasks.char_tokenizer import DEFAULT_CHARS, SPECIAL_TOKENS, build_char_tokenizer, load_tokenizer
from tasks.data import PromptDataset, load_prompt_records, load_sft_records
from tasks.reward_functions import gsm8k_match
from tasks.synthetic import make_addition_split, write_addition_dataset
from tasks.tiny_model import build_tiny_causal_lm, save_tiny_model

TEXTS = ["12+34=46", "  spaces  and\nnewlines\n", "Hello, World! #### $1,234.50 (x*y-z)/2 = 'q'?", "a"]


def parse(prompt: str) -> tuple[int, int]:
    a, b = prompt.removesuffix("=").split("+")
    return int(a), int(b)


def test_char_tokenizer_round_trips_through_save_and_load(tmp_path):
    tokenizer = build_char_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert len(loaded) == len(tokenizer) == len(SPECIAL_TOKENS) + len(DEFAULT_CHARS)
    for name in ("pad", "bos", "eos", "unk"):
        assert getattr(loaded, f"{name}_token_id") == getattr(tokenizer, f"{name}_token_id")
    assert len({tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id}) == 3
    assert loaded.chat_template is None
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert len(ids) == len(text)
        assert loaded(text)["input_ids"] == ids
        assert loaded.decode(ids) == tokenizer.decode(ids) == text
        with_eos = ids + [loaded.eos_token_id]
        assert loaded.decode(with_eos, skip_special_tokens=True) == text


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_char_tokenizer_beside_a_model_keeps_its_whitespace(tmp_path, family):
    # transformers 5.2x builds the family's own tokenizer class from the folder's config.json (Qwen2Tokenizer), whose
    # pre-tokenizer drops spaces and newlines; meshrl's entry points load a generic backend as it was saved
    tokenizer = build_char_tokenizer()
    save_tiny_model(tmp_path, tokenizer, hidden_size=32, intermediate_size=64, family=family)
    loaded = load_tokenizer(str(tmp_path))
    for text in TEXTS:
        assert loaded(text, add_special_tokens=False)["input_ids"] == tokenizer(text, add_special_tokens=False)[
            "input_ids"], text


def test_char_tokenizer_options(tmp_path):
    tokenizer = build_char_tokenizer(chars="0123456789+=", add_bos=True)
    assert len(tokenizer) == len(SPECIAL_TOKENS) + 12
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    ids = loaded("1+2=")["input_ids"]
    assert ids[0] == loaded.bos_token_id and len(ids) == len("1+2=") + 1
    assert loaded.decode(ids, skip_special_tokens=True) == "1+2="
    assert loaded("1-2")["input_ids"][2] == loaded.unk_token_id
    with pytest.raises(ValueError, match=r"duplicates \['1'\]"):
        build_char_tokenizer(chars="011")
    with pytest.raises(ValueError, match="chars is empty"):
        build_char_tokenizer(chars="")


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_tiny_model_save_and_load_give_identical_logits(tmp_path, family):
    tokenizer = build_char_tokenizer()
    model = save_tiny_model(tmp_path, tokenizer, family=family, seed=1)
    assert (tmp_path / "model.safetensors").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    loaded_tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.config.model_type == family
    assert loaded.config.vocab_size == len(loaded_tokenizer)
    assert loaded.config.eos_token_id == loaded_tokenizer.eos_token_id
    assert all(p.dtype == torch.float32 for p in loaded.parameters())
    input_ids = torch.tensor([loaded_tokenizer(text)["input_ids"][:6] for text in TEXTS[:3]])
    with torch.no_grad():
        assert torch.equal(model(input_ids).logits, loaded(input_ids).logits)


def test_tiny_model_is_a_function_of_its_seed():
    rng_state = torch.random.get_rng_state()
    first = build_tiny_causal_lm(50, seed=7)
    assert torch.equal(torch.random.get_rng_state(), rng_state)
    same = build_tiny_causal_lm(50, seed=7)
    other = build_tiny_causal_lm(50, seed=8)
    names = [name for name, _ in first.named_parameters()]
    params = [dict(m.named_parameters()) for m in (first, same, other)]
    assert all(torch.equal(params[0][n], params[1][n]) for n in names)
    assert not all(torch.equal(params[0][n], params[2][n]) for n in names)
    assert first.lm_head.weight.data_ptr() != first.get_input_embeddings().weight.data_ptr()
    tied = build_tiny_causal_lm(50, tie_word_embeddings=True)
    assert tied.lm_head.weight.data_ptr() == tied.get_input_embeddings().weight.data_ptr()


def test_tiny_model_argument_errors(tmp_path):
    with pytest.raises(ValueError, match="family='gpt2'"):
        build_tiny_causal_lm(50, family="gpt2")
    with pytest.raises(ValueError, match="hidden_size=60 must be divisible by num_heads=8"):
        build_tiny_causal_lm(50, hidden_size=60, num_heads=8)
    with pytest.raises(ValueError, match="num_heads=4 must be divisible by num_kv_heads=3"):
        build_tiny_causal_lm(50, num_kv_heads=3)
    with pytest.raises(ValueError, match="vocab_size"):
        save_tiny_model(tmp_path, build_char_tokenizer(), vocab_size=10)


@pytest.mark.parametrize("digits", [1, (1, 2), (2, 3)])
def test_addition_split(digits):
    low_digits, high_digits = (digits, digits) if isinstance(digits, int) else digits
    n = 80  # fewer than the 100 problems that one-digit operands allow
    problems = make_addition_split(n, digits=digits, seed=5)
    assert len(problems) == len({p["prompt"] for p in problems}) == n
    for problem in problems:
        a, b = parse(problem["prompt"])
        assert problem["ground_truth"] == str(a + b)
        for operand in (a, b):
            assert low_digits <= len(str(operand)) <= high_digits
    assert make_addition_split(n, digits=digits, seed=5) == problems
    assert make_addition_split(n, digits=digits, seed=6) != problems


def test_addition_split_capacity():
    every_pair = make_addition_split(100, digits=1, seed=0)  # operands 0..9
    assert sorted(parse(p["prompt"]) for p in every_pair) == [(a, b) for a in range(10) for b in range(10)]
    with pytest.raises(ValueError, match="allows only 100 distinct"):
        make_addition_split(101, digits=1)
    with pytest.raises(ValueError, match="digits="):
        make_addition_split(5, digits=(2, 1))
    with pytest.raises(ValueError, match="digits="):
        make_addition_split(5, digits=0)


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_write_addition_dataset(tmp_path):
    n_train, n_test = 200, 50
    paths = write_addition_dataset(tmp_path / "a", n_train, n_test, seed=11)
    train, test, sft = (read_jsonl(paths[name]) for name in ("train", "test", "sft"))
    assert (len(train), len(test)) == (n_train, n_test)
    assert not {p["prompt"] for p in train} & {p["prompt"] for p in test}
    assert sft == [{"prompt": p["prompt"], "response": p["ground_truth"]} for p in train]

    again = write_addition_dataset(tmp_path / "b", n_train, n_test, seed=11)
    assert all(paths[name].read_bytes() == again[name].read_bytes() for name in paths)

    tokenizer = build_char_tokenizer()
    records = load_prompt_records(paths["train"])
    assert load_sft_records(paths["sft"]) == sft
    # The longest prompt is two 2-digit operands: "99+99=" has 6 characters, hence 6 tokens.
    dataset = PromptDataset(records, tokenizer, max_prompt_len=6)
    assert dataset.n_dropped_too_long == 0
    assert all(gsm8k_match(item["ground_truth"], item["ground_truth"]) == 1.0 for item in dataset)
    with pytest.raises(ValueError, match="n_train=0"):
        write_addition_dataset(tmp_path / "c", 0, 5)
