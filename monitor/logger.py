"""Where a step's metrics go on the logging rank: metrics.jsonl, TensorBoard scalars and text, optionally Prometheus
gauges and Weights & Biases, the console line and the progress bar."""

from __future__ import annotations

import difflib
import json
import logging
import math
import os
import re
import sys
import time

from tqdm import tqdm

from monitor.summary import _json_lines


def console_defaults(metrics: dict[str, float]) -> list[str]:
    """The console line's metrics when run.console_keys is not set, by the step's estimator: with a critic (GAE) its
    value loss and explained variance beside the policy loss and KL; without (GRPO, RLOO, REINFORCE++, whose policy
    loss and one-step KL say little) each reward function's mean, the entropy, the gradient norm and the KL loss.
    Only the metrics the step has are shown."""
    head = ["reward/score/mean"]
    if "critic/vf_loss" in metrics:
        body = ["actor/pg_loss", "critic/vf_loss", "critic/vf_explained_var", "actor/ppo_kl", "actor/entropy",
                "actor/grad_norm"]
    else:  # reward/fn/<name>/mean: a function's mean (its verl extras are reward/fn/<name>/<key>/mean)
        head += sorted(k for k in metrics if k.startswith("reward/fn/") and k.endswith("/mean") and k.count("/") == 3)
        body = ["actor/entropy", "actor/grad_norm", "actor/kl_loss"]
    return [*head, "eval/score/mean", *body, "response_length/mean", "timing_s/step", "perf/throughput"]


class ProgressBar(tqdm):
    """tqdm's bar that, while shown, has the root logger's console handlers write their records through tqdm.write
    (tqdm.contrib.logging), so a log line never lands on the bar's line; closing it puts the handlers back."""

    def __init__(self, *args, **kwargs):
        self._redirect = None
        super().__init__(*args, **kwargs)
        if not self.disable:
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._redirect = logging_redirect_tqdm(tqdm_class=tqdm)
            self._redirect.__enter__()

    def close(self) -> None:
        redirect, self._redirect = getattr(self, "_redirect", None), None
        if redirect is not None:
            redirect.__exit__(None, None, None)
        super().close()


class MetricsLogger:
    def __init__(self, run_dir: str, tensorboard: bool = True, prometheus_port: int | None = None,
                 console_keys: list[str] | None = None):
        os.makedirs(run_dir, exist_ok=True)
        self.prometheus = PrometheusGauges(prometheus_port) if prometheus_port is not None else None
        self.wandb: WandbRun | None = None  # open_wandb, once the run knows whether it resumes
        self.run_dir = run_dir
        self.jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a")
        # the TensorBoard writer is made at the first write (or truncate_after): a start refused before it (a resume
        # check) leaves no event file behind
        self.tensorboard, self.tb = tensorboard, None
        self.start = time.time()
        self.console_keys = list(console_keys or [])  # run.console_keys; empty: the estimator's own (console_defaults)
        self.seen: set[str] = set()  # every metric name logged so far, for the check of console_keys
        self.keys_checked = False

    def _board(self, purge_step: int | None = None):
        """The TensorBoard writer (None without TensorBoard), made on first use."""
        if self.tb is None and self.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=self.run_dir, purge_step=purge_step)
        return self.tb

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}
        self.jsonl.write(json.dumps({"step": step, **clean}) + "\n")
        self.jsonl.flush()
        if self._board() is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.prometheus is not None:
            self.prometheus.set({"step": step, **metrics})
        if self.wandb is not None:
            self.wandb.log(step, clean)

    def open_wandb(self, fresh: bool, **kwargs) -> None:
        """Log to W&B too from here on (kwargs: WandbRun's project, entity, name, config)."""
        self.wandb = WandbRun(self.run_dir, fresh=fresh, **kwargs)

    def truncate_after(self, step: int) -> None:
        """On resume from checkpoint `step`: forget what was logged after it (metrics.jsonl, eval_samples.jsonl),
        so every step appears once. A line a kill cut in half is dropped with a warning."""
        self.jsonl.close()
        for name in ("metrics.jsonl", "eval_samples.jsonl"):
            path = os.path.join(self.run_dir, name)
            if not os.path.exists(path):
                continue
            kept = [line if line.endswith("\n") else line + "\n"
                    for line, record in _json_lines(path) if record["step"] <= step]
            with open(path, "w") as f:
                f.writelines(kept)
        self.jsonl = open(os.path.join(self.run_dir, "metrics.jsonl"), "a")
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        self._board(purge_step=step + 1)

    def samples(self, step: int, rows: list[dict]) -> None:
        """Every eval prompt's response and score, one JSON line per eval step (eval_samples.jsonl)."""
        with open(os.path.join(self.run_dir, "eval_samples.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, "samples": rows}) + "\n")
        if self.wandb is not None:
            self.wandb.samples(step, rows)

    def text(self, tag: str, text: str, step: int) -> None:
        if self._board() is not None:
            self.tb.add_text(tag, text, step)

    def console(self, step: int, total: int, metrics: dict[str, float], eta_s: float | None = None,
                keys: tuple[str, ...] | list[str] | None = None) -> None:
        """One line per log_every steps (also in Slurm logs, where the progress bar is off), with the time left.
        Its metrics: `keys`, else run.console_keys (this logger's console_keys), else the estimator's own
        (console_defaults); a configured key no step has logged by the first train step is named once in a
        warning, with the close names."""
        self.seen.update(metrics)
        if self.console_keys and step > 0 and not self.keys_checked:
            self.keys_checked = True
            unknown = [k for k in self.console_keys if k not in self.seen]
            if unknown:
                close = {k: difflib.get_close_matches(k, sorted(self.seen), n=3, cutoff=0.8) for k in unknown}
                logging.getLogger("meshrl").warning(
                    "run.console_keys: %s logged by no step so far; %s (every metric is in metrics.jsonl)",
                    ", ".join(unknown), "; ".join(f"{k}: did you mean {', '.join(c)}?" if c else f"{k}: no close name"
                                                  for k, c in close.items()))
        keys = keys or self.console_keys or console_defaults(metrics)
        parts = [f"{k}={metrics[k]:.4g}" for k in keys if k in metrics]
        if eta_s is not None:
            minutes, seconds = divmod(int(round(eta_s)), 60)
            parts.append(f"eta={minutes // 60}:{minutes % 60:02d}:{seconds:02d}")
        tqdm.write(f"step {step}/{total} " + " ".join(parts))

    def progress(self, start: int, total: int) -> tqdm:
        """A progress bar over the steps (stderr, only on a terminal: logs stay clean). While it is shown, the log
        records of the console handlers are written through it (above the bar, which is drawn again below them)."""
        return ProgressBar(total=total, initial=start, desc="steps", unit="step", dynamic_ncols=True,
                           disable=not sys.stderr.isatty())

    def close(self) -> None:
        if self.prometheus is not None:
            self.prometheus.close()
        self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.close()


class WandbRun:
    """run.wandb: the step metrics, the resolved config and the eval samples (a table per eval) in Weights & Biases.
    WANDB_MODE=offline writes them under runs/NAME/wandb for a later `wandb sync`. One W&B run per meshrl run: its
    id is kept in runs/NAME/wandb_id and a resume goes on in it (W&B keeps the first value it got for a step, so the
    steps between a checkpoint and a crash show the lost attempt's values there; metrics.jsonl has the resumed ones).
    A fresh start (no checkpoint to resume) begins a new W&B run."""

    def __init__(self, run_dir: str, project: str, name: str, config: dict, entity: str | None = None,
                 fresh: bool = True):
        import uuid

        import wandb  # optional: config.check_ppo refuses run.wandb=true without it

        id_file = os.path.join(run_dir, "wandb_id")
        if os.path.exists(id_file) and not fresh:
            with open(id_file) as f:
                run_id = f.read().strip()
        else:
            run_id = uuid.uuid4().hex[:16]
            with open(id_file, "w") as f:
                f.write(run_id + "\n")
        self.wandb = wandb
        self.run = wandb.init(project=project, entity=entity, name=name, id=run_id, resume="allow", dir=run_dir,
                              config=config)
        self.last_step = self.run.step - 1 if self.run.resumed else -1

    def log(self, step: int, metrics: dict) -> None:
        # the start-up eval and step 1 share nothing but their step numbers; W&B refuses a step below its last one
        if step < self.last_step:
            return
        self.run.log({k: v for k, v in metrics.items() if v is not None}, step=step)
        self.last_step = step

    def samples(self, step: int, rows: list[dict]) -> None:
        if rows and step >= self.last_step:
            table = self.wandb.Table(columns=list(rows[0]), data=[list(r.values()) for r in rows])
            self.run.log({"eval/samples": table}, step=step)
            self.last_step = step

    def close(self) -> None:
        self.run.finish()


class PrometheusGauges:
    """The latest value of every step metric as a Prometheus gauge, served over HTTP by prometheus_client:
    `reward/score/mean` becomes `meshrl_reward_score_mean`; `meshrl_step` is the step they belong to."""

    def __init__(self, port: int):
        from prometheus_client import CollectorRegistry, start_http_server  # optional: only when a port is set

        self.registry = CollectorRegistry()
        try:
            self.server, _ = start_http_server(port, registry=self.registry)
        except OSError as e:  # a user's choice (the port is taken, or reserved): a config error, not a crash
            raise ValueError(f"run.prometheus_port={port}: cannot serve metrics on it ({e.strerror or e}); pick a "
                             "free port, or null for no endpoint") from e
        self.gauges: dict = {}

    def set(self, metrics: dict[str, float]) -> None:
        from prometheus_client import Gauge

        for key, value in metrics.items():
            name = "meshrl_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)
            if name not in self.gauges:
                self.gauges[name] = Gauge(name, f"meshrl metric {key}", registry=self.registry)
            self.gauges[name].set(float(value) if value is not None else math.nan)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
