"""Run monitoring on the logging rank: `metrics.jsonl` (one line per step), TensorBoard scalars and text, optionally
Prometheus gauges and Weights & Biases, and a console line per step. Other ranks send their metrics to rank 0 with
`gather_metrics`. The package: logger.py (MetricsLogger and where metrics go), gather.py (metrics across ranks, the
eval's), health.py (device readings, GPU sampling, health warnings), summary.py (the run summary from metrics.jsonl),
process.py (the run folder's lock, profiling, quiet libraries); the names below are the ones the code uses as
`monitor.X`.
"""

from monitor.gather import (  # noqa: F401
    MAXED,
    SUMMED,
    eval_metrics,
    eval_sums,
    gather_metrics,
)
from monitor.health import (  # noqa: F401
    HEALTH,
    GpuSampler,
    HealthWarnings,
    memory_gb,
    nvml_reader,
)
from monitor.logger import (  # noqa: F401
    MetricsLogger,
    ProgressBar,
    PrometheusGauges,
    WandbRun,
    console_defaults,
)
from monitor.process import (  # noqa: F401
    lock_run_dir,
    process_age_s,
    profiled,
    quiet_libraries,
)
from monitor.summary import (  # noqa: F401
    read_metrics_file,
    run_summary,
    summary_table,
)
