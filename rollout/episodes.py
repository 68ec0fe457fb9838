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
ranks agree whether any episode is still running, so collective engines see the same number of calls). A turn's
call continues the last one (SamplingParams.continues, the weights unchanged between turns): the native slot engine
keeps each episode's keys and values in its slot (slots sized for the episode's whole budget, context_tokens) and
prefills only the observation and what follows; vLLM finds the history in its prefix cache. The environments of all
episodes step at once in their worker processes between turns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist

from rollout.api import RolloutOutput, SamplingParams

# an observation longer than this many characters per token of room left is not tokenised (a hostile or broken
# environment's 50 MB answer would take minutes): the episode ends there, truncated (tasks/data.py's bound for prompts)
MAX_CHARS_PER_TOKEN = 64
# the conversation a chat template renders before an observation; the assistant's text marks where its turn is
_MARK = "meshrl-assistant-turn"
_BASE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _MARK}]


def observation_text(observation, sep: str = "") -> str:
    """An observation's text: itself, or its messages' contents joined by `sep`."""
    return observation if isinstance(observation, str) else sep.join(m["content"] for m in observation)


class ObservationTokens:
    """The token ids an observation adds after a model turn.

    With a chat template (chat=True): what the template renders after an assistant turn's end-of-turn token for the
    observation's messages (a str is a user message), up to and including the next assistant header: cut from one
    rendering of a fixed conversation with the messages after it, so a template that renders earlier turns otherwise
    once more follow (Qwen3 drops an old turn's empty thinking block) gives the same tokens; the end-of-turn token
    comes first when the turn did not end with it (cut by its length, or ended by another stop token). Without one:
    the observation's text encoded as is (messages: their contents, one per line). A template that renders no
    end-of-turn stop token after an assistant turn, or none of a user and a tool message after it, fails here."""

    def __init__(self, tokenizer, chat: bool, stop_ids: tuple[int, ...], template: str | None = None,
                 tools: list[dict] | None = None, template_kwargs: dict | None = None):
        self.tokenizer, self.chat, self.template, self.tools = tokenizer, chat, template, tools or None
        self.kwargs = template_kwargs or {}
        self.end = None
        if chat:
            base = self._render(_BASE, False)
            after = base[base.rfind(_MARK) + len(_MARK):] if _MARK in base else ""
            ends = [t for t in tokenizer(after, add_special_tokens=False)["input_ids"] if t in stop_ids]
            if not ends:
                raise ValueError("the chat template writes none of the stop tokens "
                                 f"{[tokenizer.convert_ids_to_tokens(t) for t in stop_ids]} after an assistant turn, "
                                 "so a turn's end cannot be told; add its end-of-turn token to rollout.stop_token_ids")
            self.end, self.end_text = ends[0], tokenizer.decode([ends[0]])
            for probe in ("probe", [{"role": "tool", "content": "probe"}]):  # a template that cannot: now
                self(probe)

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, chat_template=self.template, tools=self.tools,
                                                  add_generation_prompt=generation_prompt, tokenize=False,
                                                  **self.kwargs)

    def __call__(self, observation, turn_ended: bool = True) -> list[int]:
        if not self.chat:
            return self.tokenizer(observation_text(observation, "\n"), add_special_tokens=False)["input_ids"]
        messages = [{"role": "user", "content": observation}] if isinstance(observation, str) else observation
        try:
            full = self._render(_BASE + messages, True)
        except Exception as e:  # the template's own refusals (raise_exception): a role it does not know
            raise ValueError(f"the chat template refused messages of roles {[m['role'] for m in messages]} after "
                             f"an assistant turn: {e}") from e
        at = full.find(_MARK)
        end = full.find(self.end_text, at + len(_MARK)) if at >= 0 else -1
        if end < 0:
            raise ValueError("the chat template does not render an assistant turn and its end before messages of "
                             f"roles {[m['role'] for m in messages]}, so the tokens between turns cannot be cut")
        close = [] if turn_ended else [self.end]
        return close + self.tokenizer(full[end + len(self.end_text):], add_special_tokens=False)["input_ids"]


class SharedEnvironments:
    """The environments of ranks that must see the same episodes (tensor-parallel peers, which generate together):
    the pool (tasks/environments.EnvironmentPool) runs on the group's rank `src` only, and each call's results go
    to the others, so an environment runs once, and a random or timed-out one cannot make the peers' histories
    differ. pool: the pool on `src`, None elsewhere."""

    def __init__(self, pool, group: dist.ProcessGroup, src: int):
        self.pool, self.group, self.src = pool, group, src

    def _shared(self, call: str, argument):
        result = [getattr(self.pool, call)(argument) if self.pool is not None else None]
        dist.broadcast_object_list(result, src=self.src, group=self.group)
        return result[0]

    def open(self, records: dict) -> dict:
        return self._shared("open", records)

    def step(self, texts: dict) -> dict:
        return self._shared("step", texts)

    def close_episodes(self, episodes) -> None:
        if self.pool is not None:
            self.pool.close_episodes(episodes)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


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


def run_episodes(generate: Callable[[list[list[int]], SamplingParams], RolloutOutput], prompts: list[list[int]],
                 records: list[dict], envs, observe: ObservationTokens, params: SamplingParams, *, max_turns: int,
                 max_tokens: int, reward_mode: str, decode: Callable[[list[int]], str],
                 any_running: Callable[[bool], bool], max_prompt_tokens: int | None = None) -> Episodes:
    """params.n episodes per prompt (consecutive, as an engine's samples), each with its own environment made from
    its prompt's record. generate(prompts, params) samples one turn per prompt (n=1 is passed); max_tokens bounds
    the response (turns and observations; an observation is added only when a whole turn fits after it, so the
    history never outgrows prompt + max_tokens); reward_mode "sum" or "last" of the steps' rewards. `any_running(flag)`:
    True when some rank sharing the engine still has an episode running (collective). max_prompt_tokens bounds the
    prompt with reset()'s observation (plain text only: under a chat template that belongs in the data); an episode
    whose first observation is refused runs one turn unstepped, counted as an environment error."""
    n = params.n
    count = len(prompts) * n
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
        if len(observation_text(observation)) > (max_tokens - len(ids[e])) * MAX_CHARS_PER_TOKEN:
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
                room = (max_prompt_tokens or 1 << 30) - len(history[e])
                too_long = len(observation_text(result.observation)) > room * MAX_CHARS_PER_TOKEN
                tokens = [] if observe.chat or too_long else observe(result.observation)
                if observe.chat or not 0 < len(tokens) <= room:  # refused: counted, and the episode runs unstepped
                    sums["episode/env_errors"] += 1
                    broken.add(e)
                else:
                    history[e] += tokens

    # room in every slot for the longest episode (ranks sharing an engine pass the same prompts, so the same figure)
    context = max((len(h) for h in history), default=0) + max_tokens
    for turn in range(max_turns):
        order = sorted(running)
        if not any_running(bool(order)):
            break
        out = generate([history[e] for e in order],
                       dataclasses.replace(params, n=1, context_tokens=context, continues=turn > 0))
        lengths = out.response_mask.sum(-1).tolist()
        texts, closed, cut = {}, {}, {}
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
            stopped = length > 0 and tokens[-1] in params.stop_token_ids
            # under a chat template a turn is closed by the template's own end token only (another stop token, as
            # Qwen's <|endoftext|>, gets it added before the observation)
            closed[e] = stopped and (observe.end is None or tokens[-1] == observe.end)
            cut[e] = length < int(lengths[row])  # by the episode's budget
            sums["episode/turns_cut"] += not stopped
            if e not in broken:
                texts[e] = decode(tokens)
        results = envs.step(texts)  # every turn goes to its environment, the last one too (its reward)
        for e in order:
            if e in broken or ended(e, results[e]):
                running.discard(e)
            elif turn == max_turns - 1 or cut[e] or not append_observation(e, results[e].observation, closed[e]):
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
                    torch.tensor(rewards, dtype=torch.float32), transcripts, sums, count)
