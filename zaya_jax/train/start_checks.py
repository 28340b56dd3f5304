"""What a run starts from, checked against its config before anything compiles or opens a log.

  load_hf_matching(path, cfg, field)      train.init_from_hf (and evaluate --hf): an HF checkpoint
                                          of this architecture
  check_same_architecture(model, cfg, field, ignore)
  check_start_rope_theta(saved, rope_theta, field)
  checkpoint_to_start_from(path, cfg, rope_theta, made_by, ignore)
                                          train.init_from_checkpoint -> (directory, step)
  ResumePoint.find(directory)             the step a resume of WORKDIR/checkpoints starts from, with its
                                          saved config (None when no step's config is whole)
  check_resumable(point, config, settings)
                                          the run that wrote the checkpoints is this config's: the
                                          same kind of model (text or vision-language), objective,
                                          data (synthetic, the curriculum pipeline, GRPO's prompts),
                                          optimizer (its state's structure) and architecture
  check_data_state(point, iterator)       its saved data iterator state is one this config's
                                          iterator can continue from (state_problem)
  run_tokenizer(config, settings, point, init_checkpoint)
                                          the tokenizer file the run trains with (what its
                                          checkpoints carry), checked against the one the resumed
                                          or initial checkpoint carries (carried_tokenizer.py)

A resume with another config would otherwise fail deep inside Orbax's restore (a data iterator
state of another pipeline, a GRPO generation counter a supervised run never saved, the state of
another optimizer), after the model was restored. Each refusal is one ConfigError naming
the workdir, the run that wrote it and the fix.
"""

from __future__ import annotations

import dataclasses
import os

import ml_collections

from zaya_jax.config import RUNTIME_MODEL_FIELDS, ConfigError
from zaya_jax.config_files import model_config
from zaya_jax.errors import MissingInputError, UserError
from zaya_jax.model.zaya import ZayaLM
from zaya_jax.checkpoints import integrity
from zaya_jax.checkpoints.carried_tokenizer import RunTokenizer, carried, check_against
from zaya_jax.checkpoints.orbax_checkpoint import checkpoint_dir, read_config, saved_data_state, whole_step
from zaya_jax.train.objectives import DATA_KIND

RESUME_FIX = "resume it with the config it was trained with, or train this config in a new --workdir"


def load_hf_matching(path: str, cfg, field: str, mxfp4_block_axis: str | None = None) -> ZayaLM:
    """An HF checkpoint whose architecture must equal `cfg`'s (errors name the first difference);
    mxfp4_block_axis as load_hf's.

    Its rope_theta may differ: a RoPE base is the curriculum phase's, not architecture (an export
    carries the base of the phase it was saved in); the model keeps its own, callers decide."""
    import zaya_jax
    model = zaya_jax.load_hf(path, mxfp4_block_axis=mxfp4_block_axis,
                             **{f: getattr(cfg, f) for f in RUNTIME_MODEL_FIELDS})
    check_same_architecture(model, cfg, field=f"{field}: {path}", ignore=("rope_theta",))
    return model


def check_start_rope_theta(saved: float, rope_theta: float, field: str) -> None:
    """Training from weights trained at RoPE base `saved` must start at it (the first phase's base)."""
    if saved != rope_theta:
        raise ConfigError(f"{field} was trained with rope_theta={saved:g} but this run starts with {rope_theta:g}: "
                          f"set --config.model.rope_theta={saved:g} (or its first curriculum phase's rope_theta)")


def check_same_architecture(model: ZayaLM, cfg, field: str, ignore: tuple[str, ...] = ()) -> None:
    """`model`'s architecture must equal `cfg`'s (runtime fields and `ignore` may differ); names the
    first difference. `model` may also be a ModelConfig."""
    for name, value in vars(getattr(model, "config", model)).items():
        if name not in RUNTIME_MODEL_FIELDS + ignore and value != getattr(cfg, name):
            raise ConfigError(f"{field}: the model has model.{name}={value!r} "
                              f"but the config says {getattr(cfg, name)!r}")


def checkpoint_to_start_from(path: str, cfg, rope_theta: float, made_by: str = "",
                             ignore: tuple[str, ...] = ()) -> tuple[str, int]:
    """train.init_from_checkpoint -> (checkpoint directory, newest whole step), checked before any
    compilation: its architecture must equal `cfg`'s, and the RoPE base it was trained at (its
    saved model.rope_theta) the one this run starts with (errors name the field and the fix;
    a missing checkpoint also the command `made_by` that trains it, '{}' standing for `path`)."""
    field = "train.init_from_checkpoint"
    directory = checkpoint_dir(path)
    try:
        step = whole_step(directory, ("model", "config"))
    except UserError as err:
        if not made_by or os.path.isdir(directory):
            raise
        raise UserError(f"{field}: no checkpoint at {path}; train it first: {made_by.format(path)}") from err
    saved = model_config(read_config(directory, step))
    check_same_architecture(saved, cfg, f"{field}: {directory} step {step}", ignore=("rope_theta", *ignore))
    check_start_rope_theta(saved.rope_theta, rope_theta, f"{field}: {directory} step {step}")
    return directory, step


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """The newest step of a workdir's checkpoint directory whose saved config is whole: the run a
    resume continues (process 0's resume_point may still fall back to an older step of it)."""

    directory: str
    step: int
    kind: str  # integrity.ITEMS: 'training', or 'model' (a to_orbax output put there: fresh optimizer and data)
    config: ml_collections.ConfigDict

    @classmethod
    def find(cls, directory: str) -> ResumePoint | None:
        step, _ = integrity.newest_whole_step(directory, ("config",))
        if step is None:
            return None
        return cls(directory, step, integrity.kind_of(os.path.join(directory, str(step))), read_config(directory, step))

    @property
    def name(self) -> str:
        return f"resuming {self.directory} step {self.step}"


def run_kind(config) -> tuple[bool, str, str]:
    """(vision-language, train.objective, data: 'synthetic', 'pipeline' or 'grpo') of a config, new or saved."""
    train = config.get("train") or {}
    objective = train.get("objective", "lm")
    return "vision" in config, objective, "grpo" if objective == "grpo" else train.get("data", "synthetic")


def describe_run(config) -> str:
    """What a config trains, as a refused resume names it (its objective and data)."""
    vision, objective, data = run_kind(config)
    if data == "grpo":
        data = f"the prompts {config.grpo.prompts} (grpo.prompts)"
    elif data == "synthetic":
        data = "synthetic data"
    else:
        data = (f"{'image_chat' if vision else DATA_KIND.get(objective, objective)} data (data.sources "
                f"{', '.join(sorted(config.data.sources))})")
    return f"a{' vision-language' if vision else ''} train.objective={objective!r} run on {data}"


def check_resumable(point: ResumePoint, config, settings) -> None:
    """The checkpoints at `point` were written by this config's kind of run and architecture (its
    RoPE base is its curriculum phase's, not architecture): else a ConfigError naming the workdir,
    the run that wrote it (as its saved config says) and the fix."""
    other_kind = (run_kind(point.config) != run_kind(config) if point.kind == "training"
                  else ("vision" in point.config) != ("vision" in config))  # a model-only one: no objective, data
    if other_kind:
        starts_from = settings.train.init_from_checkpoint
        hint = (f" (it starts from {starts_from} through train.init_from_checkpoint)" if starts_from else
                " (a post-training config starts from its source run through train.init_from_checkpoint)")
        raise ConfigError(f"{point.name}: its checkpoints were written by {describe_run(point.config)}, and this "
                          f"config is {describe_run(config)}: {RESUME_FIX}{hint}")
    saved_optimizer = (point.config.get("optimizer") or {}).get("name")
    if point.kind == "training" and saved_optimizer != settings.optimizer.name:
        raise ConfigError(f"{point.name}: its optimizer state was saved with optimizer.name={saved_optimizer!r}, and "
                          f"this config says {settings.optimizer.name!r}: {RESUME_FIX}")
    try:
        check_same_architecture(model_config(point.config), settings.model, point.name, ignore=("rope_theta",))
    except ConfigError as err:
        raise ConfigError(f"{str(err).replace('the model has', 'the checkpoint has')}\nresume with the config "
                          "that run was trained with (its checkpoints are intact), or train this config in a new "
                          "--workdir") from None


def check_data_state(point: ResumePoint, iterator) -> None:
    """The data iterator state saved at `point` (this process's) is one `iterator` (this config's:
    it has `state_problem(state)`) can continue from; ConfigError naming the difference otherwise."""
    if point.kind != "training":
        return
    state = saved_data_state(point.directory, point.step)
    problem = iterator.state_problem(state) if state is not None else None
    if problem:
        raise ConfigError(f"{point.name}: its data iterator state {problem}: {RESUME_FIX}")


def reads_tokens(settings) -> bool:
    """Whether a run's batches come through a tokenizer (prepared sources, or GRPO's prompts)."""
    return settings.train.objective == "grpo" or settings.train.data != "synthetic"


def run_tokenizer(config, settings, point: ResumePoint | None,
                  init_checkpoint: tuple[str, int] | None) -> tuple[RunTokenizer | None, str | None]:
    """(the tokenizer file this run trains with, read now: None for synthetic data or without
    data.tokenizer; a line to log when there is none to carry (data.tokenizer names no file: a run
    whose data was prepared elsewhere) or the checkpoint it starts from carries none to compare with).

    A resume's data.tokenizer must be the file its checkpoints carry, and an initial checkpoint's
    carried file this run's (ConfigError naming both files and the fix otherwise)."""
    try:
        run = RunTokenizer.of_config(config) if reads_tokens(settings) else None
    except MissingInputError as err:
        if settings.train.objective == "grpo":  # it encodes its prompts with it
            raise
        return None, f"{err}: its checkpoints carry no tokenizer (their readers will need --tokenizer FILE)"
    if point is not None:
        _, found = carried(point.directory, point.step)
        return run, check_against(run, found, f"{point.name}: the checkpoint", (
            "resume where data.tokenizer is the file that run was trained with (and data.sources were prepared "
            "with it), or train this config in a new --workdir"))
    if init_checkpoint is not None:
        directory, step = init_checkpoint
        _, found = carried(directory, step)
        return run, check_against(run, found, f"train.init_from_checkpoint: {directory} step {step}", (
            "set --config.data.tokenizer to a copy of the carried file (and prepare data.sources with it), or start "
            "from a checkpoint trained with this run's tokenizer"))
    return run, None
