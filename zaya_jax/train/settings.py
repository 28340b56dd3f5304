"""The training sections of a config, validated before anything is built or compiled.

Sections (ml_collections ConfigDicts; every field has the default shown by the dataclasses
below, and every error names the offending `section.field`):

  train       steps, seed, data ('synthetic' | 'pipeline'), seq_len and global_batch_size (the
              synthetic batch shape; with 'pipeline' the curriculum phases set them),
              microbatches (gradient accumulation), loss_chunk_size, log_every_steps,
              peak_flops_per_device (0: from the device-kind table), init_from_hf (an HF
              checkpoint dir to start from), init_from_checkpoint (a run's workdir or checkpoint
              dir: its newest whole step's model starts the run; not with init_from_hf),
              init_from_checkpoint_made_by (the command that trains that checkpoint, '{}' standing
              for its path: a missing one is reported with it),
              max_nonfinite_streak (roll back after that many non-finite steps in a row; 0:
              never), max_rollbacks (a run needing one rollback more than this stops with an
              error, exit 1), objective ('lm' | 'sft' | 'dpo' | 'grpo': zaya_jax.train.objectives);
              with a vision section: patch_capacity (image patches per packed row, a multiple of
              the tower's merge unit), freeze_text (train the tower, its merger and the vision
              LoRA only: the text model's weights and balancing biases stay as they started) and
              the training images' augmentation (zaya_jax.data.vision.augment, 0 = off): augment_shift
              (the largest move, a fraction of the side, < 0.5), augment_scale (the largest
              relative change of size, < 1), augment_contrast (of contrast, < 1)
  vision      a ZAYA1-VL model's tower and image token ids (config_files.vision_section): the run
              trains zaya_jax.model.vision.vl.ZayaVL on image_chat data (train.objective='sft';
              docs/vision.md)
  dpo         beta (the KL strength), label_smoothing (in [0, 0.5): the assumed fraction of flipped
              preference labels, TRL's robust/cDPO loss), rpo_alpha (>= 0: adds alpha times the chosen
              completion's token-mean nll to each pair's loss, TRL's rpo_alpha); read when
              train.objective == 'dpo'
  grpo        read when train.objective == 'grpo' (docs/posttraining.md; TRL's GRPOConfig names):
              prompts ('demo:tasks' | 'demo:tasks_heldout' | a JSONL file of {prompt, columns...}),
              eval_prompts (scored by greedy generation at each evaluation; '' none), chat_template
              (a .jinja file; '': the starting checkpoint's, else plain.jinja), num_generations (G >= 2
              completions per prompt), prompts_per_step (the global batch is prompts_per_step * G
              rows), oversample_prompts (k >= 1: each generation samples k * prompts_per_step prompts
              and trains on prompts_per_step of their groups, those whose rewards differ first: DAPO's
              dynamic sampling at a fixed batch), max_prompt_length, max_completion_length (T),
              temperature (> 0: at 0 the G completions of a prompt would be equal), top_k (0: off), top_p,
              num_iterations (optimizer steps per generation batch), loss_type ('grpo' | 'dapo' |
              'dr_grpo'), epsilon, epsilon_high (0: epsilon), beta (KL to the starting weights; 0: none,
              no reference model), scale_rewards ('group' | 'batch' | 'none'),
              reward_funcs (comma-separated: built-in names of zaya_jax.train.grpo_rewards or
              'module:function'), reward_weights (comma-separated floats; '': 1 each), rollout_slots (the
              decode rows of the serving engine that samples the completions, at most a generation's
              k * prompts_per_step * G; on a mesh a multiple of data * fsdp * expert)
  optimizer   name ('muon' | 'adamw'), learning_rate, adam_learning_rate (0: learning_rate),
              schedule ('cosine' | 'wsd' | 'constant'), warmup_steps, decay_fraction (WSD),
              min_lr_ratio, b1, b2, eps, weight_decay, decay_embedding, grad_clip_norm (0: off),
              muon_momentum, muon_ns_steps, muon_nesterov, muon_rms_scale, muon_distributed
  balancing   enabled, rate, b1, b2, include_skip (whether the skip slot is balanced too)
  checkpoint  every_steps (0: only at the end and on a signal), max_to_keep, async_save; local_dir,
              local_every, local_max_to_keep (the node-local tier, local_tier.py; off when local_dir='')
  eval        every_steps (0: never), max_batches (0: data.eval.max_batches); harness_tasks (lm-eval
              tasks scored in the trainer's process, '' : none), harness_every_steps (0: at each
              checkpoint save), harness_limit (documents per task, 0: all), harness_include_path,
              harness_batch_size (zaya_jax.harness.in_training)
  mesh        data, fsdp, expert, tensor, context (one may be -1), shard_optimizer_over_data,
              gradient_reduce_dtype ('float32': the partitioner reduces; 'bfloat16': summed over
              data by hand, zaya_jax.parallel.gradient_reduce), platform ('any' | 'cpu' | 'gpu' |
              'cuda' | 'rocm' | 'tpu': the trainer refuses to start on another, naming the install
              command)
  monitor     progress_bar, tensorboard, heatmap_every_steps (0: only at the end),
              profile_start_step (0: off; else trace the profile_steps steps after it to
              WORKDIR/profile, zaya_jax.train.profiling), profile_steps
  data        the curriculum (zaya_jax.data.curriculum), read when train.data == 'pipeline'
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import ml_collections

from zaya_jax.config import ConfigError, ModelConfig
from zaya_jax.config_files import model_config, vision_config
from zaya_jax.data.vision.augment import LIMITS as AUGMENT_LIMITS
from zaya_jax.parallel.gradient_reduce import GRADIENT_REDUCE_DTYPES
from zaya_jax.parallel.mesh import MESH_AXES, PLATFORMS
from zaya_jax.train.grpo_loss import LOSS_TYPES, SCALE_REWARDS
from zaya_jax.train.objectives import OBJECTIVES


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    steps: int = 100
    seed: int = 0
    data: str = "synthetic"
    seq_len: int = 0
    global_batch_size: int = 0
    microbatches: int = 1
    loss_chunk_size: int = 1024
    log_every_steps: int = 10
    peak_flops_per_device: float = 0.0
    init_from_hf: str = ""
    init_from_checkpoint: str = ""
    init_from_checkpoint_made_by: str = ""
    max_nonfinite_streak: int = 3
    max_rollbacks: int = 3
    objective: str = "lm"
    patch_capacity: int = 0
    freeze_text: bool = False
    augment_shift: float = 0.0
    augment_scale: float = 0.0
    augment_contrast: float = 0.0


@dataclasses.dataclass(frozen=True)
class DPOSettings:
    beta: float = 0.1
    label_smoothing: float = 0.0
    rpo_alpha: float = 0.0


@dataclasses.dataclass(frozen=True)
class GRPOSettings:
    prompts: str = "demo:tasks"
    eval_prompts: str = ""
    chat_template: str = ""
    num_generations: int = 8
    prompts_per_step: int = 8
    oversample_prompts: int = 1
    max_prompt_length: int = 64
    max_completion_length: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    num_iterations: int = 1
    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float = 0.0
    beta: float = 0.0
    scale_rewards: str = "group"
    reward_funcs: str = "exact_answer"
    reward_weights: str = ""
    rollout_slots: int = 64


@dataclasses.dataclass(frozen=True)
class OptimizerSettings:
    name: str = "muon"
    learning_rate: float = 3e-3
    adam_learning_rate: float = 0.0
    schedule: str = "cosine"
    warmup_steps: int = 100
    decay_fraction: float = 0.2
    min_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    decay_embedding: bool = True
    grad_clip_norm: float = 1.0
    muon_momentum: float = 0.95
    muon_ns_steps: int = 5
    muon_nesterov: bool = True
    muon_rms_scale: float = 0.2
    muon_distributed: bool = False  # Newton-Schulz spread over data x context (zaya_jax.train.optimizer)


@dataclasses.dataclass(frozen=True)
class BalancingSettings:
    enabled: bool = True
    rate: float = 1e-3
    b1: float = 0.9
    b2: float = 0.999
    include_skip: bool = False


@dataclasses.dataclass(frozen=True)
class CheckpointSettings:
    every_steps: int = 1000
    max_to_keep: int = 3
    async_save: bool = True
    local_dir: str = ""     # node-local tier (local_tier.py): '' = none
    local_every: int = 0    # steps between local saves (divides every_steps)
    local_max_to_keep: int = 2


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    every_steps: int = 0
    max_batches: int = 0
    harness_tasks: str = ""
    harness_every_steps: int = 0
    harness_limit: float = 0.0
    harness_include_path: str = ""
    harness_batch_size: int = 8


@dataclasses.dataclass(frozen=True)
class MeshSettings:
    data: int = -1
    fsdp: int = 1
    expert: int = 1
    tensor: int = 1
    context: int = 1
    shard_optimizer_over_data: bool = False
    gradient_reduce_dtype: str = "float32"
    platform: str = "any"

    @property
    def sizes(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in MESH_AXES}


@dataclasses.dataclass(frozen=True)
class MonitorSettings:
    progress_bar: bool = True
    tensorboard: bool = True
    heatmap_every_steps: int = 100
    profile_start_step: int = 0
    profile_steps: int = 3


@dataclasses.dataclass(frozen=True)
class Settings:
    model: ModelConfig
    train: TrainSettings
    optimizer: OptimizerSettings
    balancing: BalancingSettings
    checkpoint: CheckpointSettings
    eval: EvalSettings
    mesh: MeshSettings
    monitor: MonitorSettings
    dpo: DPOSettings
    grpo: GRPOSettings
    vision: Any = None   # (VisionConfig, ImageTokenIds) of the vision section, or None: a text model


SECTIONS = {"train": TrainSettings, "optimizer": OptimizerSettings, "balancing": BalancingSettings,
            "checkpoint": CheckpointSettings, "eval": EvalSettings, "mesh": MeshSettings,
            "monitor": MonitorSettings, "dpo": DPOSettings, "grpo": GRPOSettings}
CHOICES = {("train", "data"): ("synthetic", "pipeline"), ("train", "objective"): OBJECTIVES,
           ("optimizer", "name"): ("muon", "adamw"),
           ("optimizer", "schedule"): ("cosine", "wsd", "constant"), ("mesh", "platform"): PLATFORMS,
           ("mesh", "gradient_reduce_dtype"): GRADIENT_REDUCE_DTYPES, ("grpo", "loss_type"): LOSS_TYPES,
           ("grpo", "scale_rewards"): SCALE_REWARDS}
POSITIVE = {("train", "steps"), ("train", "microbatches"), ("train", "loss_chunk_size"),
            ("train", "log_every_steps"), ("optimizer", "learning_rate"), ("optimizer", "eps"),
            ("optimizer", "muon_ns_steps"), ("optimizer", "muon_rms_scale"), ("balancing", "rate"),
            ("checkpoint", "max_to_keep"), ("monitor", "profile_steps"), ("dpo", "beta"),
            ("eval", "harness_batch_size"), ("grpo", "prompts_per_step"), ("grpo", "oversample_prompts"),
            ("grpo", "max_prompt_length"),
            ("grpo", "max_completion_length"), ("grpo", "num_iterations"), ("grpo", "epsilon"),
            ("grpo", "rollout_slots")}
FRACTIONS = {("optimizer", "b1"), ("optimizer", "b2"), ("optimizer", "muon_momentum"), ("balancing", "b1"),
             ("balancing", "b2"), ("optimizer", "decay_fraction"), ("optimizer", "min_lr_ratio")}


def _check_type(section: str, field: dataclasses.Field, value: Any) -> Any:
    name = f"{section}.{field.name}"
    kind = type(field.default)
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be true or false, got {value!r}")
    elif kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name} must be an integer, got {value!r}")
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{name} must be a finite number, got {value!r}")
        value = float(value)
    elif not isinstance(value, str):
        raise ConfigError(f"{name} must be a string, got {value!r}")
    if (section, field.name) in CHOICES and value not in CHOICES[section, field.name]:
        raise ConfigError(f"{name}={value!r} does not exist; choose one of {CHOICES[section, field.name]}")
    if (section, field.name) in POSITIVE and not value > 0:
        raise ConfigError(f"{name} must be > 0, got {value!r}")
    if (section, field.name) in FRACTIONS and not 0 <= value < 1:
        raise ConfigError(f"{name} must lie in [0, 1), got {value!r}")
    if kind in (int, float) and (section, field.name) not in POSITIVE and section != "mesh" and value < 0:
        raise ConfigError(f"{name} must be >= 0, got {value!r}")
    return value


def _section(config, section: str):
    cls = SECTIONS[section]
    values = dict(config[section].items()) if section in config else {}
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(f"{section}.{unknown[0]}: unknown field (known fields: {', '.join(sorted(fields))})")
    return cls(**{k: _check_type(section, fields[k], v) for k, v in values.items()})


def checkpoint_section(**values) -> ml_collections.ConfigDict:
    """A config's `checkpoint` section: every CheckpointSettings field, its default unless given in
    `values` (so --config.checkpoint.local_dir=... overrides any config)."""
    return ml_collections.ConfigDict({**dataclasses.asdict(CheckpointSettings()), **values})


def check_local_tier(c: CheckpointSettings) -> None:
    """checkpoint.local_dir / local_every: both or neither; the persistent interval a multiple of the local one."""
    if bool(c.local_dir) != bool(c.local_every):
        raise ConfigError("checkpoint.local_dir and checkpoint.local_every go together: set both (e.g. "
                          "--config.checkpoint.local_dir=/dev/shm/zaya --config.checkpoint.local_every=50) or neither")
    if c.local_every and c.every_steps % c.local_every:
        raise ConfigError(f"checkpoint.local_every={c.local_every} must divide checkpoint.every_steps="
                          f"{c.every_steps} (the persistent tier saves at a multiple of the local interval): "
                          f"choose a divisor of {c.every_steps}")


def eval_section(**values) -> ml_collections.ConfigDict:
    """A config's `eval` section: every EvalSettings field, its default unless given in `values` (so any
    field can be overridden from the command line, e.g. --config.eval.harness_tasks=zaya_demo)."""
    return ml_collections.ConfigDict({**dataclasses.asdict(EvalSettings()), **values})


def settings_from_config(config) -> Settings:
    """Validates every training section of `config`; raises ConfigError (a ValueError) naming the field."""
    s = Settings(model=model_config(config), **{name: _section(config, name) for name in SECTIONS},
                 vision=vision_config(config))
    check_vision_run(s)
    check_local_tier(s.checkpoint)
    if s.train.objective == "grpo":  # train.data is not read: the batches are sampled (grpo.prompts)
        check_grpo_run(s)
    elif s.train.data == "synthetic":
        for field in ("seq_len", "global_batch_size"):
            if getattr(s.train, field) <= 0:
                raise ConfigError(f"train.{field} must be > 0 with train.data='synthetic', "
                                  f"got {getattr(s.train, field)}")
    elif "data" not in config:
        raise ConfigError("train.data='pipeline' needs a data section (zaya_jax.data.curriculum)")
    if s.train.init_from_hf and s.train.init_from_checkpoint:
        raise ConfigError("train.init_from_hf and train.init_from_checkpoint are both set: give one starting point")
    if not 0 <= s.dpo.label_smoothing < 0.5:
        raise ConfigError(f"dpo.label_smoothing must lie in [0, 0.5), got {s.dpo.label_smoothing!r}")
    if s.dpo.rpo_alpha < 0:
        raise ConfigError(f"dpo.rpo_alpha must be >= 0, got {s.dpo.rpo_alpha!r}")
    if s.train.steps <= s.optimizer.warmup_steps and s.optimizer.schedule != "constant":
        raise ConfigError(f"optimizer.warmup_steps ({s.optimizer.warmup_steps}) must be below "
                          f"train.steps ({s.train.steps}): lower --config.optimizer.warmup_steps or raise "
                          "--config.train.steps")
    return s


def check_vision_run(s: Settings) -> None:
    """What a vision section needs of the other sections, and the train fields only it reads."""
    t = s.train
    only_vision = ("patch_capacity", "freeze_text", *(f"augment_{name}" for name in AUGMENT_LIMITS))
    if s.vision is None:
        for name in only_vision:
            if getattr(t, name):
                raise ConfigError(f"train.{name} is set but the config has no vision section: it applies to a "
                                  "vision-language run only (configs/demo_vl.py)")
        return
    tower, _ = s.vision
    wrong = [(t.data != "pipeline", "train.data must be 'pipeline' (image_chat sources)"),
             (t.objective != "sft", f"train.objective must be 'sft', got {t.objective!r}"),
             (t.patch_capacity <= 0 or t.patch_capacity % tower.merge_unit,
              f"train.patch_capacity must be a positive multiple of {tower.merge_unit} (patches merged into one "
              f"image token), got {t.patch_capacity}"),
             (bool(t.init_from_hf), "train.init_from_hf is not read (start from a text run's checkpoint: "
                                    "train.init_from_checkpoint)"),
             (bool(s.eval.harness_tasks), "eval.harness_tasks scores a text model: leave it empty"),
             (s.mesh.context != 1, f"mesh.context must be 1 (image tokens attend across the sequence), "
                                   f"got {s.mesh.context}")]
    wrong += [(not 0 <= getattr(t, f"augment_{name}") < limit,
               f"train.augment_{name} must lie in [0, {limit:g}), got {getattr(t, f'augment_{name}')!r}")
              for name, limit in AUGMENT_LIMITS.items()]
    for bad, message in wrong:
        if bad:
            raise ConfigError(f"a vision-language run (the config has a vision section): {message}")


def check_grpo_run(s: Settings) -> None:
    """What a GRPO run needs of its grpo section (the prompts and rewards are opened later, by the trainer)."""
    g = s.grpo
    wrong = [(g.num_generations < 2, f"grpo.num_generations must be >= 2 (a group's rewards are compared), "
                                     f"got {g.num_generations}"),
             (not g.temperature > 0, f"grpo.temperature must be > 0, got {g.temperature!r}: at 0 a prompt's "
                                     "G completions are all its greedy one, so every group's rewards are equal and "
                                     "the advantages, loss and gradient 0 (TRL's default and the demo's: 1.0)"),
             (not 0 < g.top_p <= 1, f"grpo.top_p must lie in (0, 1], got {g.top_p!r}"),
             (not g.prompts, "grpo.prompts is empty: name the prompts to sample ('demo:tasks' or a JSONL file)"),
             (s.eval.every_steps > 0 and not g.eval_prompts,
              "eval.every_steps > 0 scores grpo.eval_prompts, which is empty: name them (e.g. 'demo:tasks_heldout') "
              "or set --config.eval.every_steps=0"),
             (s.model.position_limit is not None
              and g.max_prompt_length + g.max_completion_length - 1 > s.model.position_limit,
              f"grpo.max_prompt_length + grpo.max_completion_length - 1 = "
              f"{g.max_prompt_length + g.max_completion_length - 1} exceeds model.max_position_embeddings="
              f"{s.model.max_position_embeddings}")]
    for bad, message in wrong:
        if bad:
            raise ConfigError(message)


def check_batch_layout(batch: int, seq_len: int, microbatches: int, mesh_shape: dict[str, int], where: str) -> None:
    """A global batch [batch, seq_len] must split into micro-batches that shard over the mesh."""
    if batch % microbatches:
        raise ConfigError(f"train.microbatches={microbatches} must divide the global batch {batch} ({where})")
    shards = math.prod(mesh_shape.get(a, 1) for a in ("data", "fsdp", "expert"))
    if (batch // microbatches) % shards:
        raise ConfigError(f"{where}: micro-batch of {batch // microbatches} rows (global batch {batch} / "
                          f"train.microbatches {microbatches}) does not split over mesh data*fsdp*expert = {shards}")
    if seq_len % mesh_shape.get("context", 1):
        raise ConfigError(f"{where}: seq_len {seq_len} is not divisible by mesh.context={mesh_shape['context']}")
