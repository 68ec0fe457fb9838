"""Prompt data: loading records from disk, tokenising them, and sampling batches reproducibly across restarts.

Records come from a .jsonl file, a .parquet file, a folder written by `datasets.Dataset.save_to_disk`, or a Hugging
Face hub dataset id (org/name[/subset][:split], tasks/hub.py).
A prompt is text or a list of chat messages (`{"role", "content"}` dicts); the ground truth is optional.
Column keys may be dotted (`reward_model.ground_truth`) to reach into nested records, as in verl's parquet files.
"""

import json
import logging
import math
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("meshrl")

VALID_FORMATS = ".jsonl file, .parquet file, or a folder written by datasets' save_to_disk"


class _DuplicateKey(Exception):
    pass


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """json's object_pairs_hook: a dict, unless a key comes twice (json.loads would keep the last one silently)."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _read_rows(path: str | Path) -> list[tuple[str, dict]]:
    """Every record of `path` as (where, row), `where` naming the file and line or row for error messages."""
    path = Path(path)
    if not path.exists():
        from tasks.hub import dataset_problem, dataset_rows, parse_dataset_id

        why = dataset_problem(str(path)) if parse_dataset_id(str(path)) is not None else None
        if parse_dataset_id(str(path)) is not None and why is None:
            return dataset_rows(str(path))  # org/name[/subset][:split] on the Hugging Face hub (or its cache)
        raise ValueError(f"{path} does not exist; expected a {VALID_FORMATS}, or a Hugging Face hub dataset id"
                         + (f" ({why})" if why else ""))
    if path.is_dir():
        # imported here: datasets and pyarrow are only needed for these formats (a GPU image may lack them)
        from datasets import DatasetDict, load_from_disk

        try:
            dataset = load_from_disk(str(path))
        except FileNotFoundError as e:
            raise ValueError(f"{path} is a folder but not one written by datasets' save_to_disk: {e}") from e
        if isinstance(dataset, DatasetDict):
            raise ValueError(
                f"{path} holds a DatasetDict with splits {list(dataset)}; point to one split's folder, "
                f"e.g. {path / next(iter(dataset))}"
            )
        return [(f"{path} row {i}", row) for i, row in enumerate(dataset.to_list())]
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return [(f"{path} row {i}", row) for i, row in enumerate(pq.read_table(path).to_pylist())]
    if path.suffix == ".jsonl":
        rows = []
        with open(path, "rb") as f:
            for line_number, data in enumerate(f, start=1):
                where = f"{path}:{line_number}"
                try:
                    line = data.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(f"{where}: byte 0x{data[e.start]:02x} at column {e.start + 1} is not UTF-8 text "
                                     "(save the file as UTF-8)") from None
                if not line.strip():
                    continue
                try:
                    row = json.loads(line, object_pairs_hook=_unique_keys)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: malformed JSON line ({e.msg} at column {e.colno})") from e
                except _DuplicateKey as e:
                    raise ValueError(f"{where}: the key {e.args[0]!r} appears twice in one object; JSON readers "
                                     "disagree on which value wins, so remove one") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{where}: expected a JSON object per line, got {type(row).__name__}")
                rows.append((where, row))
        return rows
    raise ValueError(f"{path}: unsupported extension {path.suffix!r}; expected a {VALID_FORMATS}")


def _lookup(row: dict, key: str) -> tuple[object, bool]:
    """(value, found) for `key`, which may be dotted to reach into nested dicts."""
    if key in row:
        return row[key], True
    value = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None, False
        value = value[part]
    return value, True


def _required(row: dict, key: str, where: str, role: str) -> object:
    value, found = _lookup(row, key)
    if not found:
        raise ValueError(f"{where}: no {role} column {key!r}; the columns are {sorted(row)}")
    return value


def _check_prompt(prompt: object, where: str) -> str | list[dict]:
    """The prompt as text or as a list of messages; message keys set to None are dropped because parquet and
    datasets store messages as structs, which give every message every key any message has."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        messages = [{k: v for k, v in m.items() if v is not None} for m in prompt]
        for m in messages:
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"{where}: chat message {m!r} needs string 'role' and 'content'")
        return messages
    raise ValueError(
        f"{where}: prompt must be text or a non-empty list of {{'role', 'content'}} messages, got {prompt!r:.200}"
    )


def _finite_number(value: object, what: str, where: str) -> float:
    """A data column's number (a margin, a logged score): finite, not a bool."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}: {what} must be a finite number, got {type(value).__name__} {value!r:.200}")
    return float(value)


def _as_text(value: object, key: str, where: str) -> str:
    # Numbers are accepted because answer columns are often stored as ints or floats.
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise ValueError(f"{where}: column {key!r} must be text or a number, got {type(value).__name__} {value!r:.200}")


def load_prompt_records(
    path: str | Path, prompt_key: str = "prompt", ground_truth_key: str = "ground_truth"
) -> list[dict]:
    """Records `{"prompt": str | list[dict], "ground_truth": str | None, "columns": dict, "where": "file:line"}`
    (`where` names the record in PromptDataset's errors); the ground truth is None
    where absent; `columns` holds every other column of the row by name (the ground truth's too), for reward
    functions that read them (`data_source`, `extra_info`, ...)."""
    records = []
    for where, row in _read_rows(path):
        prompt = _check_prompt(_required(row, prompt_key, where, "prompt"), where)
        ground_truth, found = _lookup(row, ground_truth_key)
        if found and ground_truth is not None:
            ground_truth = _as_text(ground_truth, ground_truth_key, where)
        columns = {k: v for k, v in row.items() if k != prompt_key}
        records.append({"prompt": prompt, "ground_truth": ground_truth, "columns": columns, "where": where})
    if not records:
        raise ValueError(f"{path} holds no records")
    return records


def load_eval_records(paths: list[str], prompt_key: str = "prompt", ground_truth_key: str = "ground_truth"
                      ) -> list[dict]:
    """The prompt records of several eval files, each tagged with its file's position (`file`). With more than one
    file, a record without a `data_source` column gets its file's name as one, so eval reports each file apart."""
    names = [Path(p).stem for p in paths]
    names = names if len(set(names)) == len(names) else [str(p) for p in paths]
    records = []
    for k, path in enumerate(paths):
        for record in load_prompt_records(path, prompt_key, ground_truth_key):
            if len(paths) > 1 and record["columns"].get("data_source") is None:
                record["columns"]["data_source"] = names[k]
            records.append({**record, "file": k})
    return records


def load_sft_records(path: str | Path, prompt_key: str = "prompt", response_key: str = "response",
                     messages_key: str = "messages") -> list[dict]:
    """Supervised records from the same formats as prompts, each in one of TRL's SFT formats: a pair
    `{"prompt": str | list[dict], "response": str}` from the prompt and response columns (TRL's
    `completion` column where the response column is absent; a response may be one assistant message, TRL's
    conversational prompt/completion), or a conversation `{"messages": list[dict], "where"}` from a row with a
    messages column and no prompt column (TRL's `messages`)."""
    records = []
    for where, row in _read_rows(path):
        found_prompt = _lookup(row, prompt_key)[1]
        if not found_prompt and _lookup(row, messages_key)[1]:
            messages = _check_prompt(_required(row, messages_key, where, "messages"), where)
            if isinstance(messages, str):
                raise ValueError(f"{where}: column {messages_key!r} must be a list of chat messages, got text")
            records.append({"messages": messages, "where": where})
            continue
        if not found_prompt:
            raise ValueError(f"{where}: no {prompt_key!r} (with {response_key!r} or 'completion') or "
                             f"{messages_key!r} column; the columns are {sorted(row)}")
        prompt = _check_prompt(_required(row, prompt_key, where, "prompt"), where)
        key = "completion" if response_key == "response" and not _lookup(row, response_key)[1] and \
            _lookup(row, "completion")[1] else response_key
        response = _check_response(_required(row, key, where, "response"), key, where)
        records.append({"prompt": prompt, "response": response})
    if not records:
        raise ValueError(f"{path} holds no records")
    return records


def _check_response(value: object, key: str, where: str) -> str:
    """A response as text (a number too), or as chat messages: one assistant message, whose content is the text."""
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        messages = _check_prompt(value, where)
        if len(messages) != 1 or messages[0]["role"] != "assistant":
            raise ValueError(f"{where}: column {key!r} holds messages with roles {[m['role'] for m in messages]}; a "
                             "response given as chat messages is one assistant message (the prompt column holds the "
                             "conversation before it)")
        return messages[0]["content"]
    return _as_text(value, key, where)


def load_preference_records(path: str | Path, prompt_key: str = "prompt", chosen_key: str = "chosen",
                            rejected_key: str = "rejected", margin_key: str = "margin") -> list[dict]:
    """Preference pairs `{"prompt": str | list[dict], "chosen": str, "rejected": str, "margin": float}` from the same
    formats as prompts. A response is text or one assistant message; the margin (the score gap the chosen response
    should win by) is 0 where the column is absent or null."""
    records = []
    for where, row in _read_rows(path):
        prompt = _check_prompt(_required(row, prompt_key, where, "prompt"), where)
        chosen = _check_response(_required(row, chosen_key, where, "chosen"), chosen_key, where)
        rejected = _check_response(_required(row, rejected_key, where, "rejected"), rejected_key, where)
        margin, _ = _lookup(row, margin_key)
        margin = 0.0 if margin is None else _finite_number(margin, f"column {margin_key!r}", where)
        records.append({"prompt": prompt, "chosen": chosen, "rejected": rejected, "margin": margin, "where": where})
    if not records:
        raise ValueError(f"{path} holds no records")
    return records


# A text of more than this many characters per token allowed is taken as too long without tokenising it: tokens
# average a few characters, and no vocabulary we know comes near this over a whole text.
MAX_CHARS_PER_TOKEN = 64


def text_chars(value: object) -> int:
    """The characters of a prompt or response: its text, or its chat messages' contents together (0 for anything
    else, which the checks that follow refuse)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(len(m["content"]) for m in value if isinstance(m, dict) and isinstance(m.get("content"), str))
    return 0


def is_template_text(value: str) -> bool:
    """A data.chat_template string is Jinja text when it has a tag; otherwise it names a file holding one."""
    return "{%" in value or "{{" in value


def chat_template_text(value: str) -> str:
    """The Jinja text a data.chat_template string gives: itself, or the file it names (TRL's chat_template_path)."""
    if is_template_text(value):
        return value
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"data.chat_template={value!r}: not a template (no {{% or {{{{) and no file to read one "
                         f"from ({e.strerror})") from None


NO_TEMPLATE = ("give one with data.chat_template (Jinja text, or a file holding it: TRL's chat_template_path), or "
               "give prompts as text")


def render_prompts(records: list[dict], tokenizer: PreTrainedTokenizerBase,
                   chat_template: bool | str | None = None,
                   system_prompt: str | None = None, tools: list[dict] | None = None,
                   template_kwargs: dict | None = None) -> tuple[list[str], list[list[int]]]:
    """(rendered text, token ids) of each record's "prompt" (text or chat messages), templated as PromptDataset's
    docstring says; train_sft.py and train_rm.py encode their prompts with it too, so a model fine-tuned or scored
    there sees the prompts train_ppo.py generates from. tools: JSON schemas the chat template shows (rollout.tools);
    template_kwargs: the template's other variables (data.chat_template_kwargs)."""
    template = chat_template_text(chat_template) if isinstance(chat_template, str) else None
    chat_template = True if template is not None else chat_template  # a template given: every prompt goes through it
    has_template = template is not None or getattr(tokenizer, "chat_template", None) is not None
    if chat_template and not has_template:
        raise ValueError(f"data.chat_template=true but the tokenizer has no chat template; {NO_TEMPLATE}")

    prompt_texts, templated = [], []
    for i, record in enumerate(records):
        where = record.get("where", f"record {i}")
        prompt = _check_prompt(record["prompt"], where)
        if isinstance(prompt, str) and not chat_template:
            if system_prompt is not None:
                raise ValueError(f"{where}: a system prompt is set but this text prompt is not templated; "
                                 "template text prompts too (data.chat_template=true) or drop the system prompt")
            prompt_texts.append(prompt)
            templated.append(False)
            continue
        if chat_template is False:
            raise ValueError(f"{where}: the prompt is a list of chat messages but chat_template=False")
        if not has_template:
            raise ValueError(f"{where}: the prompt is a list of chat messages but the tokenizer has no chat template; "
                             f"{NO_TEMPLATE}")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if system_prompt is not None and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": system_prompt}, *messages]
        try:
            prompt_texts.append(tokenizer.apply_chat_template(messages, chat_template=template, tools=tools or None,
                                                              add_generation_prompt=True, tokenize=False,
                                                              **(template_kwargs or {})))
        except Exception as e:  # the template's own checks (raise_exception): an unknown role, a bad order
            raise ValueError(f"{where}: the tokenizer's chat template refused this prompt (roles "
                             f"{[m.get('role') for m in messages]}): {e}") from e
        templated.append(True)

    # Rendering then encoding without special tokens is what apply_chat_template(tokenize=True) does, since the
    # template writes its own; doing it in two steps keeps the rendered text and lets one call encode them all.
    prompt_ids: list[list[int]] = [[] for _ in records]
    for is_templated in (True, False):
        at = [i for i, t in enumerate(templated) if t == is_templated]
        if at:
            encoded = tokenizer([prompt_texts[i] for i in at], add_special_tokens=not is_templated)["input_ids"]
            for i, ids in zip(at, encoded):
                prompt_ids[i] = ids

    return prompt_texts, prompt_ids


class PromptDataset:
    """Tokenised prompts: items `{"prompt_ids": list[int], "ground_truth": str | None, "prompt_text": str,
    "columns": dict}`.

    `chat_template`: None applies the tokenizer's chat template to message prompts and tokenises text as is; True
    also wraps text prompts as one user message; False refuses message prompts; a string is a template (Jinja text,
    or a file holding it) used instead of the tokenizer's, as True. Templated prompts end with the
    generation prompt (the assistant header). Text prompts get the tokenizer's own special tokens (e.g. a bos).
    `system_prompt`: a system message put first in every templated prompt that has none (text prompts must then be
    templated: chat_template=True).
    Prompts longer than `max_prompt_len` tokens are dropped and counted in `n_dropped_too_long`.
    """

    def __init__(
        self,
        records: list[dict],
        tokenizer: PreTrainedTokenizerBase,
        max_prompt_len: int,
        chat_template: bool | str | None = None,
        system_prompt: str | None = None,
        tools: list[dict] | None = None,
        template_kwargs: dict | None = None,
    ):
        if max_prompt_len < 1:
            raise ValueError(f"max_prompt_len={max_prompt_len} must be at least 1")
        if not records:
            raise ValueError("PromptDataset got no records")
        # a prompt far too long by its characters is dropped before the tokenizer sees it: a 50 MB line would take
        # many GB and minutes to tokenise, only to be dropped for its length
        short = [r for r in records if text_chars(r["prompt"]) <= max_prompt_len * MAX_CHARS_PER_TOKEN]
        prompt_texts, prompt_ids = render_prompts(short, tokenizer, chat_template, system_prompt, tools,
                                                  template_kwargs) if short \
            else ([], [])

        self.items = []
        for i, record in enumerate(short):
            if not prompt_ids[i]:
                raise ValueError(f"{record.get('where', f'record {i}')}: the prompt {record['prompt']!r:.200} "
                                 "tokenises to no tokens")
            if len(prompt_ids[i]) <= max_prompt_len:
                self.items.append(
                    {
                        "prompt_ids": prompt_ids[i],
                        "ground_truth": record.get("ground_truth"),
                        "prompt_text": prompt_texts[i],
                        # chat messages as given (TRL-style rewards get them as `prompts`), None for a text prompt
                        "messages": record["prompt"] if isinstance(record["prompt"], list) else None,
                        "columns": record.get("columns", {}),
                        "file": record.get("file", 0),
                    }
                )
        self.n_dropped_too_long = len(records) - len(self.items)
        if not self.items:
            shortest = f"{min(len(ids) for ids in prompt_ids)} tokens" if prompt_ids else \
                f"over {max_prompt_len * MAX_CHARS_PER_TOKEN} characters"
            raise ValueError(
                f"all {len(records)} prompts are longer than max_prompt_len={max_prompt_len} tokens "
                f"(the shortest has {shortest})"
            )
        if self.n_dropped_too_long:
            logger.warning(
                "dropped %d of %d prompts longer than max_prompt_len=%d tokens",
                self.n_dropped_too_long,
                len(records),
                max_prompt_len,
            )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        return self.items[index]


class PromptSampler:
    """Batches of dataset indices, reshuffled each epoch from `seed + epoch`.

    The state is (epoch, position), so a run resumed from `state_dict()` draws exactly the prompts an uninterrupted
    run would. With `drop_last`, the tail of an epoch that cannot fill a batch is skipped; otherwise it comes out as
    a short batch.
    """

    def __init__(self, dataset_len: int, batch_size: int, seed: int = 0, shuffle: bool = True, drop_last: bool = True):
        if dataset_len < 1:
            raise ValueError(f"dataset_len={dataset_len} must be at least 1")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be at least 1")
        if drop_last and batch_size > dataset_len:
            raise ValueError(
                f"batch_size={batch_size} is larger than the dataset ({dataset_len} prompts) and drop_last=True, "
                "so no batch fits; use a smaller batch or drop_last=False"
            )
        self.dataset_len, self.batch_size, self.seed = dataset_len, batch_size, seed
        self.shuffle, self.drop_last = shuffle, drop_last
        self.epoch, self.position = 0, 0
        self._order: list[int] | None = None

    def _epoch_order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.dataset_len))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.dataset_len, generator=generator).tolist()

    def next_batch(self) -> list[int]:
        remaining = self.dataset_len - self.position
        if remaining == 0 or (self.drop_last and remaining < self.batch_size):
            self.epoch, self.position, self._order = self.epoch + 1, 0, None
        if self._order is None:
            self._order = self._epoch_order()
        batch = self._order[self.position : self.position + self.batch_size]
        self.position += len(batch)
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "dataset_len": self.dataset_len, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        for key in ("dataset_len", "seed"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key}={state[key]} but this sampler has {key}={getattr(self, key)}; "
                    "resuming would draw different prompts"
                )
        if not 0 <= state["position"] <= self.dataset_len:
            raise ValueError(f"sampler state position={state['position']} is outside [0, {self.dataset_len}]")
        self.epoch, self.position, self._order = state["epoch"], state["position"], None


def padding_id(tokenizer: PreTrainedTokenizerBase, where: str) -> int:
    """The id right-padded batches use: the tokenizer's pad token, else its eos token (many causal LMs ship without
    a pad token; padding never reaches a loss). ValueError naming `where` (the tokenizer's folder) when it has
    neither."""
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return int(token_id)
    raise ValueError(f"the tokenizer at {where} has neither a pad token nor an eos token: set pad_token (or "
                     "eos_token) in its tokenizer_config.json / special_tokens_map.json")


def shard_indices(indices: list[int], rank: int, world: int) -> list[int]:
    """This rank's contiguous block of a global batch; the batch must split evenly over `world` ranks."""
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank} must be in [0, world={world})")
    if len(indices) % world:
        raise ValueError(f"a batch of {len(indices)} prompts does not split evenly over {world} ranks")
    size = len(indices) // world
    return indices[rank * size : (rank + 1) * size]
