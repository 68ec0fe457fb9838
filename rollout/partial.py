"""Partial rollouts: a step's generation ends at its tail, and what the tail holds continues in the next step.

With long-tailed response lengths the last sequences of a step decode at a shrinking batch (the draining tail). With
`rollout.partial_tail` the engine returns once no sample waits and fewer than that share of its slots still decode
(SamplingParams.tail_share); the unfinished samples are carried:
- the next step's call puts each one first, as a prompt of its own (the group's prompt and the tokens so far,
  prefilled again under the new weights) with the rest of the response budget as its limit, before that step's
  fresh prompts; its new tokens and their log-probs are appended to what it had;
- a group (the n samples of a prompt) trains in the step in which its last sample ends, all n together, so the group
  baselines see whole groups; its samples' behaviour log-probs (rollout_logprobs) are those of the policy that
  sampled each token, and the importance correction the config requires (actor.tis_cap or rollout_correction)
  weighs the older ones against the policy being trained;
- staleness: a sample whose first token is max_staleness or more updates old when a call starts is among the call's
  first sequences (SamplingParams.finish_first) and decodes to its end, so no trained sample spans more than
  max_staleness + 1 policies.
The engine's randomness differs between a continued sequence and an uninterrupted one (each call draws its seed), so
under an unchanged policy a continued sample is distributed as an uninterrupted one; greedy, it is token for token
the same. Pure bookkeeping over RolloutOutput: no processes, no model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn.utils.rnn import pad_sequence

from rollout.api import RolloutOutput


@dataclass
class Sample:
    tokens: torch.Tensor  # [L] long, the response so far
    logprobs: torch.Tensor  # [L] float32, each token's log-prob under the policy that sampled it
    born: int  # the step whose rollout sampled its first token
    done: bool = False
    budget: int | None = None  # its response's token limit (None: the run's max_new_tokens)


@dataclass
class Group:
    index: int  # the prompt's index in the train set
    prompt: list[int]
    samples: list[Sample] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return all(s.done for s in self.samples)


@dataclass
class Call:
    """One generate call: prompts with their sample counts and response limits; the first finish_first sequences
    must end in the call; entries says what each prompt is (a carried group's sample to continue, or a fresh
    prompt's index)."""

    prompts: list[list[int]]
    samples: list[int]
    limits: list[int]
    finish_first: int
    entries: list[tuple[Group, int] | int]
    budgets: list[int | None] = field(default_factory=list)  # per entry: a fresh prompt's own budget, or None


class PartialRollouts:
    """The samples a step left unfinished, per actor dp rank (tp peers hold the same), and the assembly of each
    step's call and trained groups. n: samples per prompt; max_new_tokens: a response's budget."""

    def __init__(self, n: int, max_new_tokens: int, max_staleness: int):
        if max_staleness < 1:
            raise ValueError(f"max_staleness must be >= 1, got {max_staleness}")
        self.n, self.max_new_tokens, self.max_staleness = n, max_new_tokens, max_staleness
        self.carried: list[Group] = []

    def call(self, fresh: list[tuple[int, list[int]]], step: int, limits: list[int] | None = None) -> Call:
        """The call of the rollout at `step`: the carried samples to continue (the ones at the staleness bound
        first), then the fresh prompts ((index, prompt ids) each, n samples); limits: each fresh prompt's response
        budget (default max_new_tokens), which its samples keep when they are carried."""
        carried = [(g, i) for g in self.carried for i, s in enumerate(g.samples) if not s.done]
        # stable: within each class the carried order is kept
        carried.sort(key=lambda gi: step - gi[0].samples[gi[1]].born < self.max_staleness)
        finish_first = sum(step - g.samples[i].born >= self.max_staleness for g, i in carried)
        prompts = [g.prompt + g.samples[i].tokens.tolist() for g, i in carried] + [p for _, p in fresh]
        if limits is not None and len(limits) != len(fresh):
            raise ValueError(f"{len(limits)} limits for {len(fresh)} fresh prompts")
        own = list(limits) if limits is not None else [None] * len(fresh)  # None: the run's max_new_tokens
        left = [self._budget(g.samples[i]) - len(g.samples[i].tokens) for g, i in carried]
        left += [self.max_new_tokens if b is None else b for b in own]
        return Call(prompts, [1] * len(carried) + [self.n] * len(fresh), left, finish_first,
                    [*carried, *(index for index, _ in fresh)], [None] * len(carried) + own)

    def collect(self, call: Call, out: RolloutOutput, step: int) -> tuple[list[Group], dict[str, float]]:
        """The groups that ended with this call (the carried ones first, then the fresh, each in call order), and
        this rank's counts: continued (samples resumed), unfinished (samples cut short now), carried_groups (groups
        left for the next step). The rest is carried."""
        tokens, logprobs = out.response_ids.cpu(), out.logprobs.cpu().float()
        lengths = out.response_mask.sum(-1).cpu().tolist()
        cut = out.unfinished.cpu().tolist() if out.unfinished is not None else [False] * len(lengths)
        row, fresh_groups = 0, []
        for entry, count, budget in zip(call.entries, call.samples, call.budgets):
            if isinstance(entry, tuple):  # a carried sample: its new tokens appended
                group, i = entry
                s = group.samples[i]
                s.tokens = torch.cat([s.tokens, tokens[row, : lengths[row]]])
                s.logprobs = torch.cat([s.logprobs, logprobs[row, : lengths[row]]])
                s.done = not cut[row]
            else:
                group = Group(entry, out.prompt_ids[row])
                for r in range(row, row + count):
                    group.samples.append(Sample(tokens[r, : lengths[r]].clone(), logprobs[r, : lengths[r]].clone(),
                                                step, not cut[r], budget))
                fresh_groups.append(group)
            row += count
        groups = self.carried + fresh_groups
        done = [g for g in groups if g.done]
        self.carried = [g for g in groups if not g.done]
        stats = {"continued": float(sum(isinstance(e, tuple) for e in call.entries)), "unfinished": float(sum(cut)),
                 "carried_groups": float(len(self.carried))}
        return done, stats

    def _budget(self, sample: Sample) -> int:
        """Its response budget: its own, or the run's max_new_tokens (today's: a resume may have changed it)."""
        return self.max_new_tokens if sample.budget is None else min(sample.budget, self.max_new_tokens)

    @staticmethod
    def output(groups: list[Group], pad: int) -> tuple[RolloutOutput, list[int], torch.Tensor]:
        """The groups' samples as one RolloutOutput (rows group by group), each row's prompt index, and each row's
        staleness base: the step whose rollout sampled its first token."""
        samples = [s for g in groups for s in g.samples]
        if not samples:
            empty = torch.zeros((0, 1), dtype=torch.long)
            return RolloutOutput([], empty, empty.clone(), empty.float()), [], torch.zeros(0, dtype=torch.long)
        ids = pad_sequence([s.tokens for s in samples], batch_first=True, padding_value=pad)
        logprobs = pad_sequence([s.logprobs for s in samples], batch_first=True)
        lengths = torch.tensor([len(s.tokens) for s in samples])
        mask = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
        prompts = [g.prompt for g in groups for _ in g.samples]
        index = [g.index for g in groups for _ in g.samples]
        return RolloutOutput(prompts, ids, mask, logprobs), index, torch.tensor([s.born for s in samples])

    def state_dict(self) -> dict:
        """The carried groups as plain lists (a checkpoint's per-rank state)."""
        return {"carried": [{"index": g.index, "prompt": g.prompt,
                             "samples": [{"tokens": s.tokens.tolist(), "logprobs": s.logprobs.tolist(),
                                          "born": s.born, "done": s.done, "budget": s.budget}
                                         for s in g.samples]}
                            for g in self.carried]}

    def load_state_dict(self, state: dict) -> None:
        self.carried = [Group(g["index"], list(g["prompt"]),
                              [Sample(torch.tensor(s["tokens"], dtype=torch.long),
                                      torch.tensor(s["logprobs"], dtype=torch.float32), s["born"], s["done"],
                                      s.get("budget"))
                               for s in g["samples"]]) for g in state["carried"]]
