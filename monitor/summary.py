"""The run summary: metrics.jsonl read back (a line a kill cut short dropped), the report over its steps, and its
console table."""

from __future__ import annotations

import json
import logging
import os

from monitor.health import HEALTH


def _json_lines(path: str) -> list[tuple[str, dict]]:
    """(line, record) for every complete JSON line of `path`; a line a kill cut short is dropped with a warning."""
    out = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append((line, json.loads(line)))
            except json.JSONDecodeError:
                logging.getLogger("meshrl").warning("%s line %d is not complete JSON (a write cut short); dropped",
                                                    path, number)
    return out


def read_metrics_file(run_dir: str) -> list[dict]:
    """metrics.jsonl's complete lines (a non-finite value is null there)."""
    return [record for _, record in _json_lines(os.path.join(run_dir, "metrics.jsonl"))]


def run_summary(rows: list[dict]) -> dict:
    """The run report from metrics.jsonl's rows (so a resumed run's covers every step): steps, the seconds of each
    phase summed over the steps with their share of the step time, mean tokens/s, peak memory, the eval score at
    the start and at the last eval, skipped optimizer steps, reward-function errors and timeouts, and per health
    threshold the steps at which it was crossed (a warning each)."""
    steps = [r for r in rows if r["step"] > 0]

    def values(key: str) -> list[float]:  # the finite values the steps logged under `key`
        return [r[key] for r in steps if r.get(key) is not None]

    def total(key: str) -> float:
        return sum(values(key))

    step_s = total("timing_s/step")
    phases = sorted({k for r in steps for k in r if k.startswith("timing_s/")} - {"timing_s/step", "timing_s/startup"})
    evals = [r for r in rows if r.get("eval/score/mean") is not None]
    warnings_at: dict[str, list[int]] = {}
    for name in HEALTH:
        before = 0.0
        for r in steps:
            now = r.get(f"health/{name}") or 0.0
            if now and not before:
                warnings_at.setdefault(name, []).append(r["step"])
            before = now
    peaks = {k: max(values(k), default=None) for k in ("perf/max_memory_allocated_gb", "perf/gpu_memory_used_gb")}
    throughput = values("perf/throughput")
    return {
        "steps": len(steps),
        "last_step": steps[-1]["step"] if steps else 0,
        "step_s": step_s,
        "startup_s": total("timing_s/startup"),
        "phases_s": {k.removeprefix("timing_s/"): total(k) for k in phases},
        "phase_share": {k.removeprefix("timing_s/"): (total(k) / step_s if step_s else None) for k in phases},
        "tokens_per_s_per_rank": sum(throughput) / len(throughput) if throughput else None,
        "peak_memory_gb": peaks["perf/max_memory_allocated_gb"],
        "peak_gpu_memory_used_gb": peaks["perf/gpu_memory_used_gb"],
        "eval_before": evals[0]["eval/score/mean"] if evals and evals[0]["step"] == 0 else None,
        "eval_after": evals[-1]["eval/score/mean"] if evals and evals[-1]["step"] > 0 else None,
        "skipped_steps": total("actor/skipped_steps"),
        "reward_fn_errors": total("reward_fn/errors"),
        "reward_fn_timeouts": total("reward_fn/timeouts"),
        "warnings": warnings_at,
    }


def summary_table(summary: dict) -> str:
    """The console form of run_summary."""
    def number(v, fmt="{:.4g}"):
        return "-" if v is None else fmt.format(v)

    lines = [f"run summary: {summary['steps']} steps (to step {summary['last_step']}), "
             f"{summary['step_s']:.1f} s in steps + {summary['startup_s']:.1f} s start-up",
             f"  {'phase':<16} {'seconds':>10} {'share':>7}"]
    for phase, seconds in sorted(summary["phases_s"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  {phase:<16} {seconds:>10.2f} {number(summary['phase_share'][phase], '{:.1%}'):>7}")
    # a CPU run has no GPU reading, a run without an eval set no eval score: said so, not printed as "-" or nan
    gpu = summary["peak_gpu_memory_used_gb"]
    gpu_text = f" (GPU in use {number(gpu)} GB)" if gpu is not None else ""
    before, after = (v if v is not None and v == v else None for v in (summary["eval_before"], summary["eval_after"]))
    evaluated = "no eval" if before is None and after is None else \
        f"eval/score/mean {number(before)} -> {number(after)}"
    lines += [f"  tokens/s per rank {number(summary['tokens_per_s_per_rank'])}; peak memory "
              f"{number(summary['peak_memory_gb'])} GB{gpu_text}",
              f"  {evaluated}; skipped steps {summary['skipped_steps']:g}; reward-function errors "
              f"{summary['reward_fn_errors']:g}, timeouts {summary['reward_fn_timeouts']:g}",
              "  health warnings: " + (", ".join(f"{name} at steps {steps}" for name, steps in
                                                 summary["warnings"].items()) or "none")]
    return "\n".join(lines)
