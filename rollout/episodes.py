"""Multi-turn episodes: the model's turns, sampled by any engine, interleaved with what an environment or the tools
answer (tasks/environments.py), in one token sequence per episode.

Each episode's response is [turn 1][observation 1][turn 2]...[turn k]: the turns are the engine's sampled ids as
they are (nothing is decoded and re-encoded, so the trained tokens are the sampled ones), with their log-probs and
mask 1; an observation is the tokens the chat template adds for the environment's messages (or the plain text
without a template), with mask 0 and log-prob 0, so no loss, KL, entropy or advantage falls on them. The episode
ends when the environment says done (or answers None), after `max_turns` turns, or when the next observation and a
whole turn would not fit the episode's token budget (truncated, counted). A turn cut by its length limit goes to
the environment as it is (under a chat template the observation then starts with the end-of-turn token, mask 0).

Every turn is one generate call for all the episodes still running, on every rank that shares the engine (the
ranks agree whether any episode is still running, so collective engines see the same number of calls); each call
prefills an episode's whole history again, which the native engine does at prefill speed and vLLM through its
prefix cache. The environments of all episodes step at once in their worker processes between turns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from rollout.api import RolloutOutput, SamplingParams

# an observation longer than this many characters per token of room left is not tokenised (a hostile or broken
# environment's 50 MB answer would take minutes): the episode ends there, truncated (tasks/data.py's bound for prompts)
MAX_CHARS_PER_TOKEN = 64
# the conversation a chat template renders before an observation: what an observation's tokens are cut from
_BASE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


class ObservationTokens:
    """The token ids an observation adds after a model turn.

    With a chat template (chat=True): the tokens the template renders after an assistant turn for the observation's
    messages (a str is a user message), up to and including the next assistant header, taken as the difference of
    two renderings of a fixed conversation; the template's own tokens after the assistant's end-of-turn token (a
    newline in ChatML) come first, and the end-of-turn token itself when the turn was cut by its length. Without
    one: the observation's text encoded as is (messages: their contents, one per line)."""

    def __init__(self, tokenizer, chat: bool, stop_ids: tuple[int, ...], template: str | None = None,
                 tools: list[dict] | None = None, template_kwargs: dict | None = None):
        self.tokenizer, self.chat, self.template, self.tools = tokenizer, chat, template, tools or None
        self.kwargs = template_kwargs or {}
        self.tail: list[int] = []
        if chat:
            base = self._render(_BASE, False)
            ids = tokenizer(base, add_special_tokens=False)["input_ids"]
            ends = [i for i, t in enumerate(ids) if t in stop_ids]
            if not ends:
                raise ValueError("the chat template writes none of the stop tokens "
                                 f"{[tokenizer.convert_ids_to_tokens(t) for t in stop_ids]} after an assistant turn, "
                                 "so a turn's end cannot be told; add its end-of-turn token to rollout.stop_token_ids")
            self.end, self.tail = ids[ends[-1]], ids[ends[-1] + 1:]
            self.base = base

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, chat_template=self.template, tools=self.tools,
                                                  add_generation_prompt=generation_prompt, tokenize=False,
                                                  **self.kwargs)

    def __call__(self, observation, turn_ended: bool = True) -> list[int]:
        if not self.chat:
            text = observation if isinstance(observation, str) else "\n".join(m["content"] for m in observation)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        messages = [{"role": "user", "content": observation}] if isinstance(observation, str) else observation
        full = self._render(_BASE + messages, True)
        if not full.startswith(self.base):
            raise ValueError("the chat template renders a conversation differently once messages follow it (it is "
                             "not prefix-stable), so the tokens between turns cannot be cut from it; roles "
                             f"{[m['role'] for m in messages]}")
        close = [] if turn_ended else [self.end]
        return close + self.tail + self.tokenizer(full[len(self.base):], add_special_tokens=False)["input_ids"]


def episode_record(item: dict) -> dict:
    """What an environment factory is given for a prompt: every data column, the prompt (its chat messages, or its
    text) and the ground truth."""
    prompt = item["messages"] if item.get("messages") is not None else item["prompt_text"]
    return {**item.get("columns", {}), "prompt": prompt, "ground_truth": item.get("ground_truth")}


@dataclasses.dataclass
class Episodes:
    """What run_episodes returns: `output` (a RolloutOutput whose response_mask has 0 on observation tokens),
    `lengths` [N] (the responses' lengths, observations included), `rewards` [N] (the environments'), per-episode
    `turns`, `transcripts` (each a list of {"role": "model" | "env", "text", "tokens"}), and metrics (sums over this
    rank's episodes; `count` episodes)."""

    output: RolloutOutput
    lengths: torch.Tensor
    rewards: torch.Tensor
    transcripts: list[list[dict]]
    sums: dict[str, float]
    count: int
    first_error: str | None


def run_episodes(generate: Callable[[list[list[int]], SamplingParams], RolloutOutput], prompts: list[list[int]],
                 records: list[dict], envs, observe: ObservationTokens, params: SamplingParams, *, max_turns: int,
                 max_tokens: int, reward_mode: str, decode: Callable[[list[int]], str],
                 any_running: Callable[[bool], bool]) -> Episodes:
    """params.n episodes per prompt (consecutive, as an engine's samples), each with its own environment made from
    its prompt's record. generate(prompts, params) samples one turn per prompt (n=1 is passed); max_tokens bounds
    the response (turns and observations; an observation is added only when a whole turn fits after it, so the
    history never outgrows prompt + max_tokens); reward_mode "sum" or "last" of the steps' rewards. `any_running(flag)`:
    True when some rank sharing the engine still has an episode running (collective)."""
    n = params.n
    count = len(prompts) * n
    turn_params = dataclasses.replace(params, n=1)
    history = [list(prompts[e // n]) for e in range(count)]
    ids: list[list[int]] = [[] for _ in range(count)]
    mask: list[list[int]] = [[] for _ in range(count)]
    logprobs: list[list[float]] = [[] for _ in range(count)]
    transcripts: list[list[dict]] = [[] for _ in range(count)]
    rewards = [0.0] * count
    turns = [0] * count
    sums = {"episode/turns": 0.0, "episode/truncated": 0.0, "episode/turns_cut": 0.0, "episode/env_errors": 0.0,
            "episode/env_timeouts": 0.0}
    info_sums: dict[str, float] = {}
    running, broken = set(range(count)), set()

    def ended(e: int, result) -> bool:
        """Book an environment's answer; True when the episode ends with it."""
        if result.error is not None:
            sums["episode/env_timeouts" if result.timeout else "episode/env_errors"] += 1
            rewards[e] = 0.0
            return True
        for key, value in result.info.items():
            info_sums[f"env/{key}"] = info_sums.get(f"env/{key}", 0.0) + value
        rewards[e] = rewards[e] + result.reward if reward_mode == "sum" else result.reward
        return result.done or result.observation is None

    def append_observation(e: int, observation, turn_ended: bool) -> bool:
        """Put an observation's tokens in the episode; False when they and a whole turn after them do not fit."""
        text = observation if isinstance(observation, str) else "".join(m["content"] for m in observation)
        if len(text) > (max_tokens - len(ids[e])) * MAX_CHARS_PER_TOKEN:
            return False
        tokens = observe(observation, turn_ended)
        if len(ids[e]) + len(tokens) + params.max_new_tokens > max_tokens:
            return False
        ids[e] += tokens
        mask[e] += [0] * len(tokens)
        logprobs[e] += [0.0] * len(tokens)
        history[e] += tokens
        transcripts[e].append({"role": "env", "text": decode(tokens), "tokens": len(tokens)})
        return True

    if count:
        opened = envs.open({e: records[e // n] for e in range(count)})
        for e in range(count):
            result = opened[e]
            if result.error is not None:  # no environment: one turn, not stepped (a response is never empty)
                ended(e, result)
                broken.add(e)
            elif result.observation is not None:  # shown before the first turn: part of the prompt
                tokens = observe(result.observation)
                if observe.chat:  # after the prompt's generation prompt, not after an assistant turn
                    raise ValueError("env.reset() returned an observation for a chat-templated prompt: put it in "
                                     "the prompt's messages (the data), or return None")
                history[e] += tokens

    for turn in range(max_turns):
        order = sorted(running)
        if not any_running(bool(order)):
            break
        out = generate([history[e] for e in order], turn_params)
        lengths = out.response_mask.sum(-1).tolist()
        texts, stopped, cut = {}, {}, {}
        for row, e in enumerate(order):
            room = max_tokens - len(ids[e])
            length = min(int(lengths[row]), room)
            tokens = out.response_ids[row, :length].tolist()
            ids[e] += tokens
            mask[e] += [1] * length
            logprobs[e] += out.logprobs[row, :length].tolist()
            history[e] += tokens
            turns[e] += 1
            transcripts[e].append({"role": "model", "text": decode(tokens), "tokens": length})
            stopped[e] = length > 0 and tokens[-1] in params.stop_token_ids
            cut[e] = length < int(lengths[row])  # by the episode's budget
            sums["episode/turns_cut"] += not stopped[e]
            if e not in broken:
                texts[e] = decode(tokens)
        results = envs.step(texts)  # every turn goes to its environment, the last one too (its reward)
        for e in order:
            if e in broken or ended(e, results[e]):
                running.discard(e)
            elif turn == max_turns - 1 or cut[e] or not append_observation(e, results[e].observation, stopped[e]):
                sums["episode/truncated"] += 1  # the environment would have gone on
                running.discard(e)
    envs.close_episodes(range(count))

    width = max((len(x) for x in ids), default=0) or 1
    response = torch.zeros((count, width), dtype=torch.long)
    response_mask = torch.zeros((count, width), dtype=torch.long)
    response_logprobs = torch.zeros((count, width), dtype=torch.float32)
    for e in range(count):
        k = len(ids[e])
        response[e, :k] = torch.tensor(ids[e], dtype=torch.long)
        response_mask[e, :k] = torch.tensor(mask[e], dtype=torch.long)
        response_logprobs[e, :k] = torch.tensor(logprobs[e], dtype=torch.float32)
    sums["episode/turns"] = float(sum(turns))
    sums["episode/env_reward"] = float(sum(rewards))
    sums["episode/length"] = float(sum(len(x) for x in ids))
    sums["episode/model_tokens"] = float(sum(sum(m) for m in mask))
    sums.update(info_sums)
    prompt_ids = [history[e][: len(history[e]) - len(ids[e])] for e in range(count)]
    return Episodes(RolloutOutput(prompt_ids, response, response_mask, response_logprobs),
                    torch.tensor([len(x) for x in ids], dtype=torch.long),
                    torch.tensor(rewards, dtype=torch.float32), transcripts, sums, count, envs.first_error)
