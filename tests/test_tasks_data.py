import json
import logging

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import config as C
from tasks.char_tokenizer import build_char_tokenizer
from tasks.data import (
    PromptDataset,
    PromptSampler,
    load_eval_records,
    load_prompt_records,
    load_sft_records,
    shard_indices,
)

TEXT_ROWS = [
    {"prompt": "1+2=", "ground_truth": "3", "id": 0},
    {"prompt": "10+20=", "ground_truth": "30", "id": 1},
    {"prompt": "What is 7 plus 8?", "ground_truth": "15", "id": 2},
]
# verl's parquet layout: chat messages, the answer nested under reward_model.
CHAT_ROWS = [
    {
        "prompt": [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+2="}],
        "reward_model": {"ground_truth": "3", "style": "rule"},
    },
    {"prompt": [{"role": "user", "content": "4+4="}], "reward_model": {"ground_truth": "8", "style": "rule"}},
]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def write(rows: list[dict], path, fmt: str):
    """Write rows as `fmt` at `path` (+ suffix) and return the path the loaders take."""
    if fmt == "jsonl":
        path = path.with_suffix(".jsonl")
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "parquet":
        path = path.with_suffix(".parquet")
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


FORMATS = ["jsonl", "parquet", "save_to_disk"]


def without_columns(records: list[dict]) -> list[dict]:
    """The records less their data columns and where they came from."""
    return [{k: v for k, v in r.items() if k not in ("columns", "where")} for r in records]


@pytest.mark.parametrize("fmt", FORMATS)
def test_load_text_prompts(tmp_path, fmt):
    path = write(TEXT_ROWS, tmp_path / "data", fmt)
    records = load_prompt_records(path)
    assert without_columns(records) == [{"prompt": r["prompt"], "ground_truth": r["ground_truth"]} for r in TEXT_ROWS]
    # every other column reaches the reward functions by name
    assert [r["columns"] for r in records] == [{k: v for k, v in r.items() if k != "prompt"} for r in TEXT_ROWS]


@pytest.mark.parametrize("fmt", FORMATS)
def test_load_chat_prompts_with_nested_ground_truth(tmp_path, fmt):
    path = write(CHAT_ROWS, tmp_path / "data", fmt)
    records = without_columns(load_prompt_records(path, ground_truth_key="reward_model.ground_truth"))
    assert records == [{"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"]} for r in CHAT_ROWS]


@pytest.mark.parametrize("fmt", FORMATS)
def test_ground_truth_absent_or_numeric(tmp_path, fmt):
    rows = [{"question": "1+2=", "answer": 3}, {"question": "2+2=", "answer": 4}]
    path = write(rows, tmp_path / "data", fmt)
    assert without_columns(load_prompt_records(path, prompt_key="question")) == [
        {"prompt": r["question"], "ground_truth": None} for r in rows
    ]
    assert without_columns(load_prompt_records(path, prompt_key="question", ground_truth_key="answer")) == [
        {"prompt": r["question"], "ground_truth": str(r["answer"])} for r in rows
    ]


@pytest.mark.parametrize("fmt", FORMATS)
def test_missing_prompt_column_names_file_column_and_columns(tmp_path, fmt):
    path = write(TEXT_ROWS, tmp_path / "data", fmt)
    with pytest.raises(ValueError) as error:
        load_prompt_records(path, prompt_key="question")
    message = str(error.value)
    assert str(path) in message
    assert "'question'" in message
    assert str(sorted(TEXT_ROWS[0])) in message


def test_unknown_extension(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("prompt\n1+2=\n")
    with pytest.raises(ValueError, match=r"'\.csv'.*\.jsonl.*\.parquet.*save_to_disk"):
        load_prompt_records(path)


def test_missing_path(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_prompt_records(tmp_path / "nope.jsonl")


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    path = tmp_path / "data.jsonl"
    lines = [json.dumps(TEXT_ROWS[0]), "", '{"prompt": "2+2=", ', json.dumps(TEXT_ROWS[1])]
    path.write_text("\n".join(lines) + "\n")
    bad_line = lines.index('{"prompt": "2+2=", ') + 1
    with pytest.raises(ValueError, match=f"{path}:{bad_line}: malformed JSON"):
        load_prompt_records(path)


def test_jsonl_line_that_is_not_an_object(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('["1+2="]\n')
    with pytest.raises(ValueError, match=f"{path}:1: expected a JSON object"):
        load_prompt_records(path)


def test_bad_prompt_value(tmp_path):
    path = write([{"prompt": [{"role": "user"}]}], tmp_path / "data", "jsonl")
    with pytest.raises(ValueError, match="needs string 'role' and 'content'"):
        load_prompt_records(path)
    path = write([{"prompt": 12}], tmp_path / "data", "jsonl")
    with pytest.raises(ValueError, match=f"{path}:1: prompt must be text or"):
        load_prompt_records(path)


def test_dataset_dict_folder_asks_for_a_split(tmp_path):
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(TEXT_ROWS)})
    splits.save_to_disk(str(tmp_path / "splits"))
    with pytest.raises(ValueError, match="splits \\['train'\\]"):
        load_prompt_records(tmp_path / "splits")
    assert len(load_prompt_records(tmp_path / "splits" / "train")) == len(TEXT_ROWS)


def test_empty_file(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match="no records"):
        load_prompt_records(path)


def test_several_eval_files_are_tagged_by_file_and_named_as_sources(tmp_path):
    tagged = [{**TEXT_ROWS[0], "data_source": "gsm8k"}, *TEXT_ROWS[1:]]
    a, b = write(tagged, tmp_path / "math", "jsonl"), write(TEXT_ROWS[:2], tmp_path / "other", "parquet")
    records = load_eval_records([a, b])
    assert [r["file"] for r in records] == [0, 0, 0, 1, 1]
    # a record's own data_source wins; the others get their file's name
    assert [r["columns"]["data_source"] for r in records] == ["gsm8k", "math", "math", "other", "other"]
    assert without_columns(records)[3:] == [{**r, "file": 1} for r in without_columns(load_prompt_records(b))]
    # an error in a record names its file and line or row, not its place in the joined list
    messages = [{"prompt": [{"role": "user", "content": "1+2="}], "ground_truth": "3"}]
    chat = write(messages, tmp_path / "chat", "parquet")
    with pytest.raises(ValueError, match=f"^{chat} row 0: the prompt is a list of chat messages"):
        PromptDataset(load_eval_records([a, chat]), build_char_tokenizer("0123456789+="), 16, chat_template=False)
    # one file: nothing added (the overall eval metrics are the only ones)
    assert all("data_source" not in r["columns"] for r in load_eval_records([b]))
    # two files of one name: the paths tell them apart
    (tmp_path / "sub").mkdir()
    c = write(TEXT_ROWS[:1], tmp_path / "sub" / "math", "jsonl")
    assert {r["columns"]["data_source"] for r in load_eval_records([a, c])} == {"gsm8k", str(a), str(c)}


@pytest.mark.parametrize("fmt", FORMATS)
def test_load_sft_records(tmp_path, fmt):
    rows = [{"prompt": r["prompt"], "response": r["ground_truth"]} for r in TEXT_ROWS]
    path = write(rows, tmp_path / "sft", fmt)
    assert load_sft_records(path) == rows
    with pytest.raises(ValueError, match="no response column 'completion'"):
        load_sft_records(path, response_key="completion")


def test_prompt_dataset_drops_and_counts_long_prompts(caplog):
    tokenizer = build_char_tokenizer()
    records = [{"prompt": "1+" * n + "1=", "ground_truth": str(n + 1)} for n in range(12)]
    max_prompt_len = 10
    # One token per character, so the kept prompts are those of at most max_prompt_len characters.
    kept = [r for r in records if len(r["prompt"]) <= max_prompt_len]
    with caplog.at_level(logging.WARNING, logger="meshrl"):
        dataset = PromptDataset(records, tokenizer, max_prompt_len)
    assert dataset.n_dropped_too_long == len(records) - len(kept) > 0
    assert len(dataset) == len(kept)
    for item, record in zip(dataset, kept):
        assert item["prompt_text"] == record["prompt"]
        assert item["ground_truth"] == record["ground_truth"]
        assert tokenizer.decode(item["prompt_ids"]) == record["prompt"]
    assert any(f"dropped {dataset.n_dropped_too_long} of {len(records)}" in r.getMessage() for r in caplog.records)


def test_prompt_dataset_all_too_long():
    with pytest.raises(ValueError, match="all 1 prompts are longer than max_prompt_len=3"):
        PromptDataset([{"prompt": "1+2=", "ground_truth": "3"}], build_char_tokenizer(), max_prompt_len=3)


def test_prompt_dataset_text_gets_the_tokenizers_special_tokens():
    tokenizer = build_char_tokenizer(add_bos=True)
    dataset = PromptDataset([{"prompt": "1+2=", "ground_truth": None}], tokenizer, max_prompt_len=5)
    assert (
        dataset[0]["prompt_ids"] == [tokenizer.bos_token_id] + tokenizer("1+2=", add_special_tokens=False)["input_ids"]
    )
    assert dataset[0]["ground_truth"] is None


def test_prompt_dataset_applies_the_chat_template():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    records = [{"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"]} for r in CHAT_ROWS]
    dataset = PromptDataset(records, tokenizer, max_prompt_len=100)
    assert len(dataset) == len(records)
    for item, record in zip(dataset, records):
        expected_text = "".join(f"{m['role']}: {m['content']}\n" for m in record["prompt"]) + "assistant: "
        assert item["prompt_text"] == expected_text
        direct = tokenizer.apply_chat_template(record["prompt"], add_generation_prompt=True, tokenize=True)
        # transformers 5 returns a BatchEncoding here, 4.x a list of ids.
        direct_ids = direct["input_ids"] if hasattr(direct, "keys") else direct
        assert item["prompt_ids"] == direct_ids
        assert item["ground_truth"] == record["ground_truth"]


def test_chat_template_kwargs_reach_the_template():
    # Qwen3's switch, in the shape its template has it: an empty thinking block after the generation prompt when off
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = (CHAT_TEMPLATE.replace("assistant: ", "assistant: {% if enable_thinking is defined and "
                                                     "enable_thinking is false %}<think></think>{% endif %}"))
    records = [{"prompt": [{"role": "user", "content": "1+2="}], "ground_truth": "3"}]
    thinking = PromptDataset(records, tokenizer, max_prompt_len=100)[0]["prompt_text"]
    off = PromptDataset(records, tokenizer, max_prompt_len=100, template_kwargs={"enable_thinking": False})
    assert off[0]["prompt_text"] == thinking + "<think></think>" and thinking.endswith("assistant: ")
    cfg = C.load_config(None, ["data.chat_template_kwargs={enable_thinking: false}"])
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(C.ConfigError, match="expected a mapping"):
        C.load_config(None, ["data.chat_template_kwargs=[1]"])


def test_prompt_dataset_chat_template_switch():
    tokenizer = build_char_tokenizer()
    text_records = [{"prompt": "1+2=", "ground_truth": "3"}]
    chat_records = [{"prompt": [{"role": "user", "content": "1+2="}], "ground_truth": "3"}]
    with pytest.raises(ValueError, match="no chat template"):
        PromptDataset(chat_records, tokenizer, max_prompt_len=100)
    with pytest.raises(ValueError, match="chat_template=true but the tokenizer has no chat template"):
        PromptDataset(text_records, tokenizer, max_prompt_len=100, chat_template=True)

    tokenizer.chat_template = CHAT_TEMPLATE
    wrapped = PromptDataset(text_records, tokenizer, max_prompt_len=100, chat_template=True)
    assert wrapped[0] == {**PromptDataset(chat_records, tokenizer, max_prompt_len=100)[0], "messages": None}
    assert PromptDataset(text_records, tokenizer, max_prompt_len=100)[0]["prompt_text"] == "1+2="
    with pytest.raises(ValueError, match="chat_template=False"):
        PromptDataset(chat_records, tokenizer, max_prompt_len=100, chat_template=False)


def test_prompt_dataset_bad_arguments():
    tokenizer = build_char_tokenizer()
    with pytest.raises(ValueError, match="max_prompt_len=0"):
        PromptDataset([{"prompt": "1", "ground_truth": None}], tokenizer, max_prompt_len=0)
    with pytest.raises(ValueError, match="no records"):
        PromptDataset([], tokenizer, max_prompt_len=8)
    with pytest.raises(ValueError, match="record 0: the prompt '' tokenises to no tokens"):
        PromptDataset([{"prompt": "", "ground_truth": None}], tokenizer, max_prompt_len=8)


def draw(sampler: PromptSampler, n_batches: int) -> list[list[int]]:
    return [sampler.next_batch() for _ in range(n_batches)]


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("shuffle", [True, False])
def test_sampler_resume_draws_the_same_prompts(drop_last, shuffle):
    kwargs = dict(dataset_len=10, batch_size=4, seed=3, shuffle=shuffle, drop_last=drop_last)
    uninterrupted = draw(PromptSampler(**kwargs), 12)
    for stop in (1, 2, 3, 5, 7):
        first = PromptSampler(**kwargs)
        head = draw(first, stop)
        state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint as plain data
        resumed = PromptSampler(**kwargs)
        resumed.load_state_dict(state)
        assert head + draw(resumed, 12 - stop) == uninterrupted


def test_sampler_epochs():
    n, batch_size, seed = 10, 4, 3
    batches = draw(PromptSampler(n, batch_size, seed=seed, drop_last=True), 6)
    per_epoch = n // batch_size
    for epoch in range(3):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        epoch_batches = batches[epoch * per_epoch : (epoch + 1) * per_epoch]
        assert sum(epoch_batches, []) == order[: per_epoch * batch_size]

    batches = draw(PromptSampler(n, batch_size, seed=seed, shuffle=False, drop_last=False), 6)
    assert [len(b) for b in batches] == [4, 4, 2, 4, 4, 2]
    assert sum(batches[:3], []) == list(range(n)) == sum(batches[3:], [])


def test_sampler_errors():
    with pytest.raises(ValueError, match="batch_size=11 is larger than the dataset"):
        PromptSampler(10, 11)
    assert len(PromptSampler(10, 11, drop_last=False).next_batch()) == 10
    with pytest.raises(ValueError, match="dataset_len=0"):
        PromptSampler(0, 1)
    state = PromptSampler(10, 2, seed=1).state_dict()
    with pytest.raises(ValueError, match="dataset_len=10 but this sampler has dataset_len=12"):
        PromptSampler(12, 2, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=1 but this sampler has seed=2"):
        PromptSampler(10, 2, seed=2).load_state_dict(state)


def test_shard_indices():
    indices = [7, 3, 9, 1, 4, 0]
    world = 3
    shards = [shard_indices(indices, rank, world) for rank in range(world)]
    assert sum(shards, []) == indices
    assert {len(s) for s in shards} == {len(indices) // world}
    with pytest.raises(ValueError, match="6 prompts does not split evenly over 4 ranks"):
        shard_indices(indices, 0, 4)
    with pytest.raises(ValueError, match="rank=3"):
        shard_indices(indices, 3, 3)


def test_system_prompt_goes_first_in_templated_prompts():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    text = [{"prompt": "1+2=", "ground_truth": "3"}]
    with_system = [{"prompt": [{"role": "system", "content": "9"}, {"role": "user", "content": "1+2="}],
                    "ground_truth": "3"}]
    made = PromptDataset(text, tokenizer, max_prompt_len=100, chat_template=True, system_prompt="9")
    assert made[0]["prompt_text"] == PromptDataset(with_system, tokenizer, max_prompt_len=100)[0]["prompt_text"]
    # a prompt that has its own system message keeps it
    kept = PromptDataset(with_system, tokenizer, max_prompt_len=100, system_prompt="8")
    assert kept[0]["prompt_text"] == made[0]["prompt_text"]
    with pytest.raises(ValueError, match="system prompt is set but this text prompt is not templated"):
        PromptDataset(text, tokenizer, max_prompt_len=100, system_prompt="9")
