"""GRPO (Shao et al. 2024, DeepSeekMath; as TRL's GRPOTrainer): online RL from verifiable rewards
on the loop every objective shares.

A cycle (one optimizer step) receives the rows of its prompts, each prompt ``group_size`` times
(data/prompts.GroupOrder); ``begin_cycle`` samples one completion per row with the policy
(rollout.py), scores them (rewards.py), turns the rewards into group-relative advantages
(grpo_loss.py) and returns the training micro-batches, of the feed's micro-batch size. With
grpo.num_iterations > 1 the same rollouts, and their log-probs at sampling time, serve that many
steps (the feed repeats the step's prompts). The loss is grpo_loss's, through the output head's
per-token log-probs (fused: no tokens x vocab logits), normalised by the step's count.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass

import torch

from onegpu.data.prompts import PROMPT_IDS, ROW, completion_records
from onegpu.objectives import grpo_loss, multiturn, rollout
from onegpu.objectives.base import Objective
from onegpu.objectives.rewards import Reward, score
from onegpu.objectives.tokens import IGNORE, TARGETS, TokenLoss

ADV, OLD, REF = "advantages", "old_logps", "ref_logps"  # batch keys of the training rows
SAMPLED = "sampler_logps"  # the sampler's own log-prob of each target token (the engine's)


@dataclass
class Cycle:
    """A step's rollouts, kept while grpo.num_iterations steps use them."""

    key: tuple
    rows: dict  # the whole step as one batch (rollout.training_rows) plus ADV
    per_row: dict  # OLD / REF: per row, its target tokens' log-probs
    uses: int = 0


class GRPO(Objective):
    """training.objective grpo. ``rewards``: the resolved reward functions (rewards.resolve);
    ``tokenizer`` decodes completions for them; ``reference``: reference.AdapterReference or
    CopyReference with beta > 0, else None; ``pad_multiple``: data.pad_to_multiple; ``max_prompt``:
    data.seq_len, the longest prompt a rollout can hold; ``tools``: multiturn.ToolUse with
    grpo.tools (each rollout a conversation with tool calls; the rewards see it whole).

    Statistics follow Preference's pattern: a cycle's are pending until ``end_cycle`` commits
    them to the window (a cycle redone after an out-of-memory error counts once); an evaluation
    keeps its own. Rewards and lengths are host numbers (known at sampling); the loss's clip,
    KL and entropy sums stay on the device until the log reads them (one sync)."""

    def __init__(
        self,
        gcfg,
        tokens: TokenLoss,
        rewards: list[Reward],
        tokenizer,
        prompt_field,
        reference=None,
        pad_multiple: int = 1,
        compiled: bool = False,
        max_prompt: int = 0,
        tools=None,
    ):
        from onegpu.infer.policy import parse_off

        self.g, self.tokens, self.rewards = gcfg, tokens, rewards
        parse_off(gcfg.policy_off, "--grpo.policy_off")  # a typo fails now, not at the rollout
        self.tools = tools  # multiturn.ToolUse with grpo.tools: conversations, not completions
        self.tokenizer, self.prompt_field, self.reference = tokenizer, prompt_field, reference
        self.eps_low = gcfg.epsilon
        self.eps_high = gcfg.epsilon if gcfg.epsilon_high is None else gcfg.epsilon_high
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.pad_multiple = pad_multiple
        self.compiled = compiled  # the run compiles: so does the rollouts' decode step
        self.max_prompt = max_prompt  # data.seq_len: sizes that step's cache once
        self.kept = rollout.KeptEngine()  # the compiled rollouts' engine, for this run only
        self.cycle: Cycle | None = None
        self.pending, self.window, self.eval = _Stats(), _Stats(), None
        self._trained_from = 0.0
        self._first_size = 0  # the micro-batch of the first step (before any out-of-memory retry)

    # ---------------------------------------------------------------------------- the protocol
    def count(self, batch: dict) -> int:
        rows = batch["labels"].size(0)
        return grpo_loss.count(
            self.g.loss_type, batch[TARGETS].numel(), rows, self.g.max_completion_length
        )

    def loss(self, model, batch: dict) -> torch.Tensor:
        _, logps, entropy = self.tokens.policy_logps(model, batch, self.g.temperature)
        rows = batch[TARGETS] // batch["labels"].size(1)
        adv = batch[ADV].to(logps.dtype).index_select(0, rows)
        sequence = self.g.importance_sampling_level == "sequence"
        stats = self.eval if self.eval is not None else self.pending
        n_rows = batch["labels"].size(0)
        per_tok, kl, clipped = grpo_loss.per_token_loss(
            logps,
            batch.get(OLD),
            batch.get(REF),
            adv,
            self.eps_low,
            self.eps_high,
            self.g.beta,
            self.g.kl_ratio,
            rows=rows if sequence else None,  # GSPO: one ratio per completion
            n_rows=n_rows,
            sampler_ratio=self._sampler(logps, batch, rows, n_rows, stats),
        )
        zero = logps.new_zeros(())
        stats.loss.append(
            torch.stack(
                [
                    logps.new_tensor(float(logps.numel())),
                    clipped.sum().float(),
                    kl.detach().sum() if kl is not None else zero,
                    entropy.sum() if entropy is not None else zero,
                ]
            )
        )
        return grpo_loss.aggregate(per_tok, rows, batch["labels"].size(0), self.g.loss_type)

    def _sampler(self, logps, batch: dict, rows, n_rows: int, stats: _Stats):
        """The sampler-trainer mismatch, logged (the policy at sampling against the engine's own
        log-probs, at temperature 1 where both are the model's distribution), and the correction's
        weight per token (grpo.sampler_correction; None when off)."""
        sampled = batch.get(SAMPLED)
        if sampled is None:
            return None
        at_sampling = logps.detach() if batch.get(OLD) is None else batch[OLD]
        if self.g.temperature == 1:
            sums, big = grpo_loss.sampler_mismatch(at_sampling, sampled)
            stats.mismatch.append(sums)
            stats.mismatch_max.append(big)
        if self.g.sampler_correction == "off":
            return None
        g = self.g
        return grpo_loss.sampler_ratio(
            at_sampling,
            sampled,
            rows,
            n_rows,
            g.sampler_correction,
            g.sampler_correction_level,
            g.sampler_correction_max,
        )

    def begin_cycle(self, model, micro: list[dict]) -> list[dict]:
        self.pending = _Stats()
        size = len(micro[0][PROMPT_IDS])
        # the step's completions are sampled in one call; after an out-of-memory retry shrank the
        # micro-batch, in as many calls as it was shrunk by
        self._first_size = self._first_size or size
        key = tuple(i for mb in micro for i in mb[ROW])
        cycle = self.cycle
        if cycle is None or cycle.key != key or cycle.uses >= self.g.num_iterations:
            rows = _joined(micro)
            per_call = len(rows[PROMPT_IDS]) * size // self._first_size
            cycle = self._rollouts(model, rows, size, self.pending, per_call)
            self.cycle = cycle if self.g.num_iterations > 1 else None
        self.pending.train_tokens = int(cycle.rows["attention_mask"].sum())
        self._trained_from = time.perf_counter()
        return _split(cycle, size, self.pad_multiple)

    def end_cycle(self) -> None:
        if self.cycle is not None:
            self.cycle.uses += 1
        self.pending.train_seconds += time.perf_counter() - self._trained_from
        self.window.add(self.pending)
        self.pending = _Stats()

    def window_metrics(self) -> dict:
        window, self.window = self.window, _Stats()
        return window.metrics(self.rewards, self.g.beta)

    def begin_eval(self) -> None:
        self.eval = _Stats()

    def eval_batch_size(self, micro_batch_size: int) -> int:
        return max(1, micro_batch_size // self.g.group_size)

    def eval_micro(self, model, batch: dict) -> list[dict]:
        """An evaluation batch of prompts: each sampled group_size times, scored, as batches of at
        most one micro-batch of completions (group_size x the prompts)."""
        rows = {k: [v for v in vals for _ in range(self.g.group_size)] for k, vals in batch.items()}
        cycle = self._rollouts(model, rows, len(rows[PROMPT_IDS]), self.eval)
        return _split(cycle, len(rows[PROMPT_IDS]), self.pad_multiple)

    def eval_metrics(self) -> dict:
        stats, self.eval = self.eval, None
        return stats.metrics(self.rewards, self.g.beta) if stats is not None else {}

    @property
    def needs_reference(self) -> str | None:
        return self.reference.kind if self.reference is not None else None

    @property
    def reference_name(self) -> str | None:
        return type(self.reference).__name__ if self.reference is not None else None

    # ------------------------------------------------------------------------------ rollouts
    def _rollouts(
        self, model, rows: dict, micro_size: int, stats: _Stats, per_call: int = 0
    ) -> Cycle:
        prompt_ids = rows[PROMPT_IDS]
        device = next(model.parameters()).device
        if self.tools is not None:  # conversations with tool calls (multiturn.py)
            samples = multiturn.sample(
                model, prompt_ids, rows[self.prompt_field], self.g, self.tokenizer, device,
                per_call or len(prompt_ids), self.tools,
            )  # fmt: skip
        else:
            samples = rollout.sample(
                model,
                prompt_ids,
                self.g,
                self.tokenizer,
                device,
                rows=per_call or len(prompt_ids),
                compiled=self.compiled,
                max_prompt=self.max_prompt,
                kept=self.kept,
            )
        prompts = rows[self.prompt_field]
        completions = samples.conversations
        if completions is None:
            texts = self.tokenizer.batch_decode(samples.completion_ids, skip_special_tokens=True)
            completions = [completion_records(p, t) for p, t in zip(prompts, texts, strict=True)]
        columns = {k: v for k, v in rows.items() if k not in (PROMPT_IDS, ROW, self.prompt_field)}
        where = rows[ROW]
        per_func = torch.tensor(
            score(
                self.rewards,
                prompts,
                completions,
                samples.completion_ids,
                columns,
                lambda i: f"prompt {where[i]} (record {where[i]} of the prompts)",
            ),
            dtype=torch.float32,
        )  # (functions, rows), NaN = not scored
        weights = torch.tensor([r.weight for r in self.rewards]).unsqueeze(1)
        total = (per_func * weights).nansum(0)
        total[torch.isnan(per_func).all(0)] = math.nan
        adv = grpo_loss.advantages(total, self.g.group_size, self.g.scale_rewards)
        batch = rollout.training_rows(
            prompt_ids, samples, self.pad, self.g.mask_truncated_completions, self.pad_multiple
        )
        batch[ADV] = adv
        stats.record_rollouts(per_func, total, samples, self.g.group_size)
        per_row = self._logps_at_sampling(model, batch, micro_size, device)
        if samples.logps is not None:  # per row, those of its target tokens (none if masked)
            trained = (batch["labels"] != IGNORE).any(1).tolist()
            per_row[SAMPLED] = [
                torch.tensor(lp if t else [], dtype=torch.float32)
                for lp, t in zip(samples.logps, trained, strict=True)
            ]
        return Cycle(tuple(where), batch, per_row)

    @torch.no_grad()
    def _logps_at_sampling(self, model, batch: dict, micro_size: int, device) -> dict:
        """OLD (num_iterations > 1: the policy's log-probs as it sampled) and REF (beta > 0), per
        row, computed one micro-batch at a time before any training forward."""
        from onegpu.objectives.tokens import with_target_positions

        wanted = {}
        if self.g.num_iterations > 1:
            wanted[OLD] = lambda m, b: self.tokens.policy_logps(m, b, self.g.temperature)[1]
        if self.reference is not None and self.g.beta:
            wanted[REF] = lambda m, b: self.reference.token_logps(m, b, self.g.temperature)
        out = {k: [] for k in wanted}
        if not wanted:
            return out
        with torch.compiler.set_stance("force_eager"):
            for part in _split(Cycle((), batch, {}), micro_size, self.pad_multiple):
                part = {k: v.to(device) for k, v in with_target_positions(part).items()}
                counts = (part["labels"][:, 1:] != IGNORE).sum(1).tolist()
                for key, fn in wanted.items():
                    out[key] += list(fn(model, part).float().cpu().split(counts))
        return out


def _joined(micro: list[dict]) -> dict:
    return {k: [v for mb in micro for v in mb[k]] for k in micro[0]}


def _split(cycle: Cycle, size: int, multiple: int = 1) -> list[dict]:
    """The step's rows as micro-batches of ``size`` rows, trimmed to their longest row rounded up
    to ``multiple`` (data.pad_to_multiple: fewer shapes, fewer recompiles)."""
    out = []
    b = cycle.rows
    for s in range(0, b["labels"].size(0), size):
        part = {k: v[s : s + size] for k, v in b.items()}
        longest = int(part["attention_mask"].sum(1).max())
        width = min(-(-longest // multiple) * multiple, b["labels"].size(1))
        for k in ("input_ids", "attention_mask", "labels"):
            part[k] = part[k][:, :width].contiguous()
        for key, rows in cycle.per_row.items():
            part[key] = torch.cat(rows[s : s + size])
        out.append(part)
    return out


class _Stats:
    """Sums for the log: rewards and lengths on the host (known at sampling), loss statistics on
    the device (read at the log's one sync)."""

    def __init__(self):
        self.loss: list[torch.Tensor] = []
        self.mismatch: list[torch.Tensor] = []  # sampler_mismatch's sums, per micro-batch
        self.mismatch_max: list[torch.Tensor] = []
        self.rewards: list[torch.Tensor] = []  # (functions, rows) per rollout
        self.totals: list[torch.Tensor] = []
        self.lengths: list[int] = []
        self.truncated = self.groups = self.flat_groups = 0
        self.gen_seconds = self.train_seconds = 0.0
        self.train_tokens = 0
        self.tools: Counter = Counter()  # multi-turn rollouts: tool calls, errors, turns

    def record_rollouts(self, per_func, total, samples: rollout.Samples, group: int) -> None:
        self.rewards.append(per_func)
        self.totals.append(total)
        self.lengths += samples.lengths()  # the policy's own tokens
        self.tools.update(samples.counts or {})
        self.truncated += sum(samples.truncated)
        grouped = total.view(-1, group)
        self.groups += grouped.size(0)
        self.flat_groups += int((grouped.nan_to_num(0).std(1) == 0).sum())
        self.gen_seconds += samples.seconds

    def add(self, other: _Stats) -> None:
        self.loss += other.loss
        self.mismatch += other.mismatch
        self.mismatch_max += other.mismatch_max
        self.rewards += other.rewards
        self.totals += other.totals
        self.lengths += other.lengths
        self.truncated += other.truncated
        self.groups += other.groups
        self.flat_groups += other.flat_groups
        self.gen_seconds += other.gen_seconds
        self.train_seconds += other.train_seconds
        self.train_tokens += other.train_tokens
        self.tools.update(other.tools)

    def metrics(self, rewards: list[Reward], beta: float) -> dict:
        if not self.totals:
            return {}
        out = {}
        total = torch.cat(self.totals)
        out["reward"], out["reward_std"] = _mean_std(total)
        per_func = torch.cat(self.rewards, dim=1)
        for r, values in zip(rewards, per_func, strict=True):
            out[f"rewards/{r.name}/mean"], out[f"rewards/{r.name}/std"] = _mean_std(values)
        n = len(self.lengths)
        out["completion_length"] = sum(self.lengths) / n
        out["completion_length_max"] = float(max(self.lengths))
        out["truncated_ratio"] = self.truncated / n
        out["frac_reward_zero_std"] = self.flat_groups / max(self.groups, 1)
        if self.loss:
            tokens, clipped, kl, entropy = torch.stack(self.loss).sum(0).tolist()
            out["clip_ratio"] = clipped / max(tokens, 1.0)
            out["entropy"] = entropy / max(tokens, 1.0)
            if beta:
                out["kl"] = kl / max(tokens, 1.0)
        if self.mismatch:
            n, diff, k3 = torch.stack(self.mismatch).sum(0).tolist()
            out["sampler_logp_diff_mean"] = diff / max(n, 1.0)
            out["sampler_logp_diff_max"] = float(torch.stack(self.mismatch_max).max())
            out["sampler_kl"] = k3 / max(n, 1.0)
        if self.tools:  # tool calls and errors counted; turns per rollout; the prefix cache
            tools = dict(self.tools)  # hits over the prompt tokens looked up
            out["turns"] = tools.pop("turns", 0) / len(self.lengths)
            queries, hits = tools.pop("prefix_queries", 0), tools.pop("prefix_hits", 0)
            out["prefix_hit_ratio"] = hits / max(queries, 1)
            out.update({k: float(v) for k, v in tools.items()})
        out["gen_tokens_per_s"] = sum(self.lengths) / max(self.gen_seconds, 1e-9)
        if self.train_seconds:  # training steps (evaluation has no training half)
            out["train_tokens_per_s"] = self.train_tokens / self.train_seconds
        return out


def _mean_std(x: torch.Tensor) -> tuple[float, float]:
    x = x[~torch.isnan(x)]
    if x.numel() == 0:
        return math.nan, math.nan
    return float(x.mean()), float(x.std()) if x.numel() > 1 else 0.0
