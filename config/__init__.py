"""Run configuration: a typed schema with defaults, YAML files and dotted command-line overrides.

    python train_ppo.py --config configs/quickstart.yaml actor.optim.lr=1e-6 placement.mode=split

Every field has a default. `load_config` checks keys and types; `check_world` checks what depends on the world
size and the model files (pool sizes, tensor-parallel degrees). A mistake raises `ConfigError`, which the entry points
turn into one message and exit code 2 on every rank before any work starts. The package: schema.py (the sections),
loading.py (YAML and overrides to a Config), derived.py (what a config implies), checks.py, help.py (`--help`),
cli.py (the entry points' parse_or_exit); the names below are the ones the code uses as `config.X`.
"""

from config.checks import (  # noqa: F401
    PPO_RANGES,
    RANGE_HINTS,
    RM_RANGES,
    SFT_RANGES,
    check_episodes,
    check_lora,
    check_objective,
    check_ppo,
    check_ranges,
    check_rm,
    check_run_dir,
    check_sft,
    check_triton_kernels,
    check_vllm,
    check_world,
)
from config.cli import (  # noqa: F401
    CONFIG_ERROR_GRACE_S,
    parse_or_exit,
)
from config.derived import (  # noqa: F401
    compile_cache_folder,
    episodes,
    old_logprobs_pass,
    path_list,
    pools_of,
    required_roles,
    response_budget,
    world_rollout,
)
from config.help import (  # noqa: F401
    describe_schema,
)
from config.loading import (  # noqa: F401
    FOREIGN_NAMES,
    RENAMED,
    build,
    check_given_once,
    config_changes,
    load_config,
    to_dict,
)
from config.schema import (  # noqa: F401
    DTYPES,
    FIXED_MICRO_BATCH_TOKENS,
    KL_KIND,
    RESUME_PROTECTED,
    ROLES,
    ActorConfig,
    AlgorithmConfig,
    CheckpointConfig,
    CommConfig,
    Config,
    ConfigError,
    CriticConfig,
    DataConfig,
    DistillConfig,
    DistributedConfig,
    FilterConfig,
    FSDPConfig,
    GuardConfig,
    HealthConfig,
    KLConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    PlacementConfig,
    PoolConfig,
    QuickstartConfig,
    ReferenceConfig,
    ReplayConfig,
    RewardConfig,
    RewardFunctionConfig,
    RMConfig,
    RolloutConfig,
    RolloutCorrectionConfig,
    RunConfig,
    SFTConfig,
    TeacherConfig,
    fixed_budget,
)
