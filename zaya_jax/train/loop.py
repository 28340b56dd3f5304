"""The training loop: config -> mesh, data, model, optimizer, state -> steps, logs, checkpoints.

  Trainer(config, workdir, *, init_model=None, on_log=None)
                             validates every section, checks each phase's batch against the mesh,
                             checks what it starts from (start_checks: a resume is the run that
                             wrote the workdir, a checkpoint's tokenizer is this run's), opens the
                             data (missing files are named here) -- all before any compilation,
                             and what start-up opened is closed again if it fails -- then builds
                             or restores the state:
                               newest local step every process can restore (checkpoint.local_dir,
                               if newer than the persistent one)  >  latest checkpoint in workdir  >
                               init_model (a ZayaLM in memory, e.g. from a notebook)  >
                               train.init_from_checkpoint  >  train.init_from_hf  >  fresh init (a DPO run's frozen reference
                               model is a copy of the weights it starts from)
                             on_log(record) sees every record written to metrics.jsonl (train,
                             eval, rollback, warning), as it is written: a live plot's hook
  Trainer.run()              steps until train.steps (or the data ends), then saves, waits for
                             the checkpoint and draws the expert-load heatmap
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from typing import Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from zaya_jax.checkpoints import integrity
from zaya_jax.checkpoints.model_parts import ModelParts
from zaya_jax.checkpoints.orbax_checkpoint import config_json, read_config, restore_model
from zaya_jax.config import VISION_LORA_FIELDS, ConfigError
from zaya_jax.errors import UserError
from zaya_jax.model.vision.vl import build_model
from zaya_jax.model.zaya import ZayaLM
from zaya_jax.parallel import distributed
from zaya_jax.parallel.mesh import check_declared_platform, check_platform_support, make_mesh
from zaya_jax.parallel.rules import with_shardings
from zaya_jax.train import checkpoint, faults, local_tier
from zaya_jax.train.checkpoint import Checkpointer
from zaya_jax.train.data import curriculum_extension, eval_batches, open_training_data, phases_of
from zaya_jax.train.metrics import expert_load, flops_per_token, peak_flops, router_metrics
from zaya_jax.train.monitor import HEATMAP_FILE, METRICS_FILE, Monitor
from zaya_jax.train.objectives import TokenObjective, zero_sums
from zaya_jax.train.profiling import StepProfiler
from zaya_jax.train.settings import check_batch_layout, settings_from_config
from zaya_jax.train.start_checks import (RESUME_FIX, ResumePoint, check_data_state, check_resumable,
                                         check_same_architecture, check_start_rope_theta, checkpoint_to_start_from,
                                         load_hf_matching, run_tokenizer)
from zaya_jax.train.program import abstract_batch, build_program, check_mesh_divides_model, image_shape
from zaya_jax.train.state import TrainState, initial_state, merged, without_vision_lora
from zaya_jax.train.workdir_lock import WorkdirLock


class Trainer:
    def __init__(self, config, workdir: str, *, init_model: ZayaLM | None = None,
                 on_log: Callable[[dict], None] | None = None):
        self.config, self.workdir = config, os.path.abspath(workdir)
        s = self.settings = settings_from_config(config)
        if init_model is not None:
            check_same_architecture(init_model, s.model, "init_model")
        self._init_model, self.on_log = init_model, on_log
        self._last_loss: tuple[int, float] | None = None  # (step, loss) of the last logged train record
        self._compiled: set[tuple[int, int, float]] = set()  # (batch, seq_len, rope_theta): one step program each
        self._eval_compiled: set[float] = set()  # rope_theta of each evaluation program compiled (several processes)
        distributed.initialize()
        check_declared_platform(s.mesh.platform)
        self.phases = phases_of(config, s)
        self.mesh = make_mesh(s.mesh.sizes)
        mesh_shape = dict(self.mesh.shape)
        for p in self.phases:
            check_batch_layout(p.global_batch_size, p.seq_len, s.train.microbatches, mesh_shape,
                               f"phase {p.name!r}" if s.train.data == "pipeline" else "train.global_batch_size")
        check_platform_support(mesh_shape, s.model.expert_parallel)
        check_mesh_divides_model(s, mesh_shape)
        if s.train.init_from_hf and not os.path.isdir(s.train.init_from_hf):
            raise ConfigError(f"train.init_from_hf: {s.train.init_from_hf!r} is not a directory (an HF checkpoint "
                              "directory: config.json + safetensors)")
        checkpoints = os.path.join(self.workdir, "checkpoints")
        resuming = bool(integrity.steps_in(checkpoints))  # the source is not read
        resumed = ResumePoint.find(checkpoints) if resuming else None
        if resumed is not None:
            check_resumable(resumed, config, s)
        self._init_checkpoint = (checkpoint_to_start_from(s.train.init_from_checkpoint, s.model,
                                                          self.phases[0].rope_theta,
                                                          s.train.init_from_checkpoint_made_by,
                                                          VISION_LORA_FIELDS if s.vision else ())
                                 if s.train.init_from_checkpoint and not resuming else None)
        self.tokenizer, tokenizer_note = run_tokenizer(config, s, resumed, self._init_checkpoint)
        try:
            os.makedirs(self.workdir, exist_ok=True)
        except OSError as e:
            raise UserError(f"workdir {self.workdir} cannot be created: {e.strerror} ({e.filename}); "
                            "choose another --workdir") from None
        self.is_main = jax.process_index() == 0
        self.stopped_by: int | None = None  # the signal that stopped run(), if one did
        self._rollbacks = 0
        with contextlib.ExitStack() as opened:  # closed again if start-up fails: no thread outlives a refusal
            self._lock = WorkdirLock(self.workdir) if self.is_main else None
            if self._lock is not None:
                opened.callback(self._lock.release)
            self.data = open_training_data(config, s, self.tokenizer and self.tokenizer.path)
            opened.callback(self.data.close)
            if resumed is not None:
                check_data_state(resumed, self.data)
            self._start_up(config, init_model, resuming, tokenizer_note, opened)
            opened.pop_all()

    def _start_up(self, config, init_model: ZayaLM | None, resuming: bool, tokenizer_note: str | None,
                  opened: contextlib.ExitStack) -> None:
        """The rest of start-up, once the data is open (what it opens is closed by `opened` if it fails)."""
        s = self.settings
        self.eval_data = eval_batches(config, s) if s.eval.every_steps else {}
        self.harness = None
        if s.eval.harness_tasks:
            from zaya_jax.harness.in_training import TrainingHarness
            self.harness = TrainingHarness(config, s)
        self._init_origin = "the given init_model's weights"
        if init_model is None and s.train.init_from_hf and not resuming:  # after the cheap checks; outside any mesh
            self._init_model = load_hf_matching(s.train.init_from_hf, s.model, "train.init_from_hf")
            check_start_rope_theta(self._init_model.config.rope_theta, self.phases[0].rope_theta,
                                   f"train.init_from_hf: {s.train.init_from_hf}")
            self._init_origin = f"HF weights {s.train.init_from_hf}"

        program = build_program(s, self.mesh)
        self.tx, self.controller, self.lr_schedule = program.tx, program.controller, program.lr_schedule
        self.parts, self.abstract_state, self.shardings = program.parts, program.abstract_state, program.shardings
        self.objective = program.objective
        self.checkpointer = Checkpointer(os.path.join(self.workdir, "checkpoints"), s.checkpoint,
                                         reference=self.objective.needs_reference)
        opened.push(self._close_checkpointer_unless_stopped)
        self.local_tier = None  # checkpoint.local_dir: the node-local tier (local_tier.py)
        if s.checkpoint.local_dir:
            self.local_tier = local_tier.LocalTier(s.checkpoint.local_dir, s.checkpoint.local_max_to_keep, self.mesh,
                                                   local_tier.run_id(self.workdir))
            opened.callback(self.local_tier.close)
        self.monitor = Monitor(self.workdir, s.train.steps, progress_bar=s.monitor.progress_bar,
                               tensorboard=s.monitor.tensorboard, enabled=self.is_main)
        opened.callback(self.monitor.close)
        self.profiler = StepProfiler(os.path.join(self.workdir, "profile"), s.monitor.profile_start_step,
                                     s.monitor.profile_steps)
        self.monitor.log(f"topology: {distributed.topology()}; mesh {dict(self.mesh.shape)}")
        if tokenizer_note:
            self.monitor.log(f"note: {tokenizer_note}")
        self._announce_extension(curriculum_extension(config, s))
        self.state, origin = self._initial_state_unless_stopped()
        self.monitor.advance(int(self.state.step))
        self.monitor.log(f"start at step {int(self.state.step)}: {origin}")
        self._train_step, self._eval_step = program.train_step, program.eval_step
        if self.objective.name == "grpo":  # its batches are sampled from the weights of the step they train
            self.data.attach(lambda: self.current_model(self.data.phase.rope_theta),
                             functools.partial(self._token_logps, program.token_logps), self.mesh)
        self._generation_seconds = 0.0  # a GRPO run's sampling time at the last train record
        self._flops_per_token = {p.seq_len: flops_per_token(s.model, p.seq_len) for p in self.phases}
        topo = distributed.topology()
        self._peak = peak_flops(topo["device_kind"], topo["platform"], topo["global_devices"], topo["processes"],
                                s.train.peak_flops_per_device)

    # -- state ------------------------------------------------------------------------------
    def _fresh(self, params: dict | None, biases: jax.Array | None) -> TrainState:
        s = self.settings
        start = functools.partial(initial_state, tx=self.tx, controller=self.controller, seed=s.train.seed,
                                  with_reference=self.objective.needs_reference)
        if params is None:
            def init():
                return start(*ModelParts.arrays(build_model(s.model, s.vision, rngs=nnx.Rngs(s.train.seed))))
            return jax.jit(init, out_shardings=self.shardings)()
        return jax.jit(start, in_shardings=(self.shardings.params, self.shardings.biases),
                       out_shardings=self.shardings)(params, biases)

    def _initial_state(self) -> tuple[TrainState, str]:
        point = self.checkpointer.resume_point(self.monitor.log)  # its run was checked: start_checks
        step = point[0] if point else None
        local = self.local_tier and self.local_tier.agreed_step(-1 if step is None else step, self._log_named)
        if local:
            return self._restore_local(local)
        if point is not None and point[1] == "training":
            return self._restore(step), f"restored checkpoint {step}"
        if point is not None:
            return self._fresh(*self._restored_model(self.checkpointer.directory, step)), \
                f"weights of model-only checkpoint {step}"
        if self._init_model is None and self._init_checkpoint is not None:
            directory, step = self._init_checkpoint
            if self.settings.vision is not None and "vision" not in read_config(directory, step):
                return self._fresh_around_text(directory, step), \
                    (f"text weights of checkpoint {step} in {directory} (train.init_from_checkpoint), a fresh "
                     "vision tower, merger and vision LoRA, a fresh optimizer")
            return self._fresh(*self._restored_model(directory, step)), \
                f"weights of checkpoint {step} in {directory} (train.init_from_checkpoint), a fresh optimizer"
        if self._init_model is None:
            return self._fresh(None, None), "fresh initialisation"
        params, biases = ModelParts.arrays(self._init_model)
        self._init_model = None  # the state holds the weights now
        return self._fresh(jax.device_put(params, self.shardings.params),
                           jax.device_put(biases, self.shardings.biases)), self._init_origin

    def _fresh_around_text(self, directory: str, step: int) -> TrainState:
        """A vision-language run's step 0 around a text run's checkpoint: its text weights and biases
        (the vision LoRA, which the text run lacks, starts as initialised: B = 0, so the model computes
        exactly the text model at first), a fresh tower and merger."""
        s, params, shardings = self.settings, self.abstract_state.params, self.shardings.params
        text, text_shardings = without_vision_lora(params["text"]), without_vision_lora(shardings["text"])
        target = with_shardings({"params": text, "biases": self.abstract_state.biases},
                                {"params": text_shardings, "biases": self.shardings.biases})
        restored, _ = restore_model(directory, target, step)
        start = functools.partial(initial_state, tx=self.tx, controller=self.controller, seed=s.train.seed)

        def init(text_params, biases):
            fresh, _ = ModelParts.arrays(build_model(s.model, s.vision, rngs=nnx.Rngs(s.train.seed)))
            return start({**fresh, "text": merged(fresh["text"], text_params)}, biases)
        return jax.jit(init, in_shardings=(text_shardings, self.shardings.biases),
                       out_shardings=self.shardings)(restored["params"], restored["biases"])

    def _restored_model(self, directory: str, step: int) -> tuple[dict, jax.Array]:
        """(params, biases) of the `model` item of `step` in `directory`, on this run's shardings."""
        target = with_shardings({"params": self.abstract_state.params, "biases": self.abstract_state.biases},
                                {"params": self.shardings.params, "biases": self.shardings.biases})
        model, _ = restore_model(directory, target, step)
        return model["params"], model["biases"]

    def _restore_local(self, agreed: local_tier.Agreed) -> tuple[TrainState, str]:
        """The state and data position of the agreed local step (every process restores it together),
        checked as a persistent resume is: the config saved with it, then each process's data state
        (a ConfigError on every process when one process finds a problem); then, where some shards
        of it were held once, saved to the local tier again, so that every shard is held twice
        before the first step."""
        step, from_peer = agreed.step, agreed.from_peer
        elsewhere = f"local step {step}: process {{}} cannot resume it (see its message)"
        saved = self.local_tier.saved_config(step)
        local_tier.raise_on_every_process(saved and self._local_resume_problem(step, *saved), elsewhere)
        state, position = self.local_tier.restore(step, from_peer, with_shardings(self.abstract_state, self.shardings))
        problem = self.data.state_problem(position)
        local_tier.raise_on_every_process(
            problem and f"local step {step} of {self.local_tier.home}: its data iterator state {problem}: {RESUME_FIX}",
            elsewhere)
        self.data.set_state(position)
        if agreed.held_once:  # a second failure before the next local save would otherwise find
            # those shards nowhere newer than the persistent tier (every process saves: it is collective)
            self.local_tier.save(state, self.data.get_state(), self._config_record())
            self.local_tier.wait()
        peers = "".join(f"; process {p}'s shards from process {(p - 1) % jax.process_count()}'s peer copy"
                        for p in from_peer)
        return state, f"restored local step {step} ({self.settings.checkpoint.local_dir}{peers})"

    def _local_resume_problem(self, step: int, directory: str, config: dict) -> str | None:
        """Why this config cannot resume local step `step` (its config saved in `directory`), or None."""
        try:
            check_resumable(ResumePoint(directory, step, "training", ml_collections.ConfigDict(config)), self.config,
                            self.settings)
        except ConfigError as err:
            return str(err)
        return None

    def _restore(self, step: int) -> TrainState:
        return self.checkpointer.restore(step, with_shardings(self.abstract_state, self.shardings), self.data)

    def save(self) -> int:
        return self.checkpointer.save(self.state, self.data, self._config_record(),
                                      self.tokenizer and self.tokenizer.files())

    def _config_record(self) -> dict:
        """The run's config as a checkpoint keeps it (checkpoint.config_json, at the current phase)."""
        return config_json(self.config, self.data.phase.rope_theta, self.data.chat_template,
                           self.tokenizer and self.tokenizer.record())

    # -- loop -------------------------------------------------------------------------------
    def run(self) -> TrainState:
        s = self.settings
        step = start = int(jax.device_get(self.state.step))
        last_saved = step if self.checkpointer.latest_step() == step else None
        if start >= s.train.steps:
            self.monitor.log(f"already at step {start}, train.steps={s.train.steps}: nothing to train (raise "
                             "--config.train.steps to train on)")
        window_start, window_tokens = time.perf_counter(), 0
        phase = None
        with faults.catching_stops() as stop, jax.set_mesh(self.mesh):
            distributed.barrier("start-up")  # a stop from start-up is agreed next, before the step compiles
            while step < s.train.steps and not self._should_stop(stop):
                try:
                    local = next(self.data)
                except StopIteration:
                    self.monitor.log(f"data exhausted after {step} of train.steps={s.train.steps} steps; "
                                     "--config.train.steps beyond the curriculum extends its last phase")
                    break
                phase = self._announce_phase(step, phase, self.data.phase)
                self._log_grpo_warning(step + 1)
                self.state, metrics = self._train_step(self.state, distributed.global_batch(local, self.mesh),
                                                       phase.rope_theta)
                step += 1
                self._log_profile(self.profiler.after_step(step, metrics))
                window_tokens += phase.tokens_per_batch
                streak = int(jax.device_get(metrics["nonfinite_streak"]))
                if step == start + 1:
                    self.monitor.restart_clock(step)  # the bar's rate and ETA leave out the first compile
                if step % s.train.log_every_steps == 0 or step == s.train.steps:
                    elapsed = time.perf_counter() - window_start
                    self._log_train(step, jax.device_get(metrics), window_tokens / elapsed, phase, elapsed)
                    window_start, window_tokens = time.perf_counter(), 0
                    if s.monitor.heatmap_every_steps and step % s.monitor.heatmap_every_steps < s.train.log_every_steps:
                        self.monitor.draw_heatmap()
                self._after_step(step)
                if faults.should_roll_back(streak, s.train.max_nonfinite_streak):
                    step = self._roll_back(step, streak)
                    continue
                paused = time.perf_counter()  # evaluation and saving do not count against tokens/s
                if s.eval.every_steps and step % s.eval.every_steps == 0:
                    self.evaluate(step, phase.rope_theta)
                if self.harness and self.harness.due(step):
                    self.run_harness(step, phase.rope_theta)
                if s.checkpoint.every_steps and step % s.checkpoint.every_steps == 0:
                    last_saved = self._save_unless_nonfinite(streak, last_saved)
                if self.local_tier and step % s.checkpoint.local_every == 0 and not streak:
                    self.local_tier.save(self.state, self.data.get_state(), self._config_record())
                window_start += time.perf_counter() - paused
            self._log_profile(self.profiler.stop(self.state))  # a run that ended inside the traced steps
            if self.stopped_by:
                self._announce_stop(step, trained=step > start)
            elif s.eval.every_steps and step % s.eval.every_steps and step > start:
                self.evaluate(step, self.data.phase.rope_theta)  # the final model is always evaluated
            if self.harness and not self.stopped_by and step > start and not self.harness.due(step):
                self.run_harness(step, self.data.phase.rope_theta)  # and scored
            if last_saved != step and not (self.stopped_by and step == start):
                self._save_unless_nonfinite(int(jax.device_get(self.state.nonfinite_streak)), last_saved)
            self.checkpointer.wait()
            if self.local_tier:
                self.local_tier.wait()
        self.monitor.draw_heatmap()
        self._summarize(step)
        return self.state

    def compiled_step(self, phase=None) -> jax.stages.Compiled:
        """The train step compiled for `phase`'s batch shape and RoPE base (default: the first
        phase; benchmarks/planner/planner_flops_vs_xla.py compiles the same program from shapes alone for
        the planner's FLOP check). A later run of that phase reuses the compilation."""
        phase = phase or self.phases[0]
        batch = abstract_batch(phase.global_batch_size, phase.seq_len, image_shape(self.settings),
                               self.objective.extra_batch_keys)
        return self._train_step.lower(self.state, batch, phase.rope_theta).compile()

    # -- messages -------------------------------------------------------------------------------
    def _announce_extension(self, extra: int) -> None:
        if extra:
            self.monitor.log(f"train.steps={self.settings.train.steps} is {extra} batches past the curriculum: "
                             f"its last phase {self.phases[-1].name!r} continues for them")

    def _announce_phase(self, step: int, previous, phase):
        """Logs the start of each phase this session trains, and whether the step compiles for it
        (a new batch shape or RoPE base: rope_theta is a static argument of the step)."""
        if previous is None or phase.index != previous.index:
            key = (phase.global_batch_size, phase.seq_len, phase.rope_theta)
            fresh = key not in self._compiled
            self._compiled.add(key)
            self.monitor.log(f"step {step}: phase {phase.index + 1}/{len(self.phases)} {phase.name!r} "
                             f"(batch {key[0]} x seq_len {key[1]}, rope_theta {key[2]:g})"
                             + ("; compiling the step for it" if fresh else ""))
            if fresh and jax.process_count() > 1:
                self._compile_step_on_every_process(phase)
        return phase

    def _compile_step_on_every_process(self, phase) -> None:
        """Compiles the step for `phase` ahead of its first run (the run reuses it), then waits for
        every process: their compile times differ by minutes (distributed.barrier says why), more
        than the step's first cross-process collective would wait."""
        self.compiled_step(phase)
        distributed.barrier(f"train step compiled for phase {phase.name!r}")

    def _summarize(self, step: int) -> None:
        """The end-of-run lines: where every output is, and the last loss."""
        if not self.is_main:
            return
        latest = self.checkpointer.latest_step()
        ended = f"stopped by signal {self.stopped_by} at step {step}" if self.stopped_by else f"finished at step {step}"
        if self._last_loss is not None:
            loss_step, loss = self._last_loss
            ended += f", loss {loss:.4f}" if loss_step == step else f", last logged loss {loss:.4f} (step {loss_step})"
        lines = [ended,
                 f"  checkpoints     {self.checkpointer.directory} (latest: {latest})",
                 f"  metrics         {os.path.join(self.workdir, METRICS_FILE)}"]
        if self.settings.monitor.tensorboard:
            lines.append(f"  tensorboard     tensorboard --logdir {os.path.join(self.workdir, 'tensorboard')}")
        heatmap = os.path.join(self.workdir, HEATMAP_FILE)
        if os.path.exists(heatmap):
            lines.append(f"  expert load     {heatmap}")
        self.monitor.log("\n".join(lines))

    def compiled_step_text(self) -> str:
        """The compiled HLO of the train step for the first phase's batch shape: the op names a
        profile's events refer to (benchmarks/training/step_profile.py maps them to blocks)."""
        return self.compiled_step().as_text()

    def _log_profile(self, directory: str | None) -> None:
        if directory is not None:
            self.monitor.log(f"profiler trace (from step {self.profiler.start_step + 1}) written to {directory}")

    def _should_stop(self, stop: faults.StopSignal) -> bool:
        """At a step boundary, jointly with every process: raise a failed checkpoint write, or stop
        on a signal any process received (sets `stopped_by`)."""
        error = self.checkpointer.poll()
        if error is None and self.local_tier:
            failed = self.local_tier.poll()
            error = failed and checkpoint.CheckpointWriteError(
                f"a local checkpoint could not be written to {self.local_tier.home}: {checkpoint.root_cause(failed)}")
        decision = stop.agreed(failing=error is not None)
        if decision == faults.PEER_FAILED:
            raise error or checkpoint.CheckpointWriteError("another process failed to write its checkpoint")
        self.stopped_by = decision or None
        return bool(decision)

    def _announce_stop(self, step: int, trained: bool) -> None:
        """A stop before any step of this session saves nothing: the state is the checkpoint it was
        restored from, or an initialisation that the next start makes again."""
        self._log_on_every_process(
            f"signal {self.stopped_by}: saving step {step} and stopping" if trained else
            f"signal {self.stopped_by}: stopping at step {step} before training; nothing new to save")

    def _log_named(self, message: str) -> None:
        """A line that names its process already: logged by process 0, printed by the others."""
        if self.is_main:
            self.monitor.log(message)
        else:
            print(message, flush=True)

    def _log_on_every_process(self, message: str) -> None:
        self.monitor.log(message)
        if not self.is_main:
            print(f"process {jax.process_index()}: {message}", flush=True)

    def _initial_state_unless_stopped(self) -> tuple[TrainState, str]:
        """_initial_state, unless a stop comes while any process builds it (faults.build_unless_stopped):
        then the stop is logged and StoppedDuringStartup raised (start-up closes what it opened)."""
        def build():
            with jax.set_mesh(self.mesh):
                return self._initial_state()
        try:
            return faults.build_unless_stopped(build)
        except faults.StoppedDuringStartup as stop:
            self.stopped_by = stop.signum
            self._log_on_every_process(str(stop))
            raise

    def _close_checkpointer_unless_stopped(self, kind, error, traceback) -> None:
        """Start-up failed: the checkpointer's threads end, unless a stop came while the state was being
        built (the build may still be restoring in its thread; the process exits at once)."""
        del error, traceback
        if kind is not faults.StoppedDuringStartup:
            self.checkpointer.close()

    def _save_unless_nonfinite(self, streak: int, last_saved: int | None) -> int | None:
        """Saves the state unless its last step was non-finite (a rollback must never find such a state)."""
        if streak:
            self.monitor.log(f"step {int(jax.device_get(self.state.step))}: checkpoint not saved, "
                             f"{streak} non-finite step(s) in a row")
            return last_saved
        return self.save()

    def _after_step(self, step: int) -> None:
        """Called after every step (a seam for fault-injection tests)."""

    def _roll_back(self, step: int, streak: int) -> int:
        faults.check_rollback_budget(self._rollbacks, self.settings.train.max_rollbacks, step, streak)
        self.checkpointer.wait()
        latest = self.checkpointer.newest_whole_training_step()
        local = self.local_tier and self.local_tier.agreed_step(-1 if latest is None else latest, self._log_named)
        if latest is None and not local:
            raise faults.TrainingFailed(f"{streak} non-finite steps in a row at step {step} "
                                        "and no checkpoint to roll back to")
        self._rollbacks += 1
        position, skipped = self.data.get_state(), self.state.skipped_steps
        if local:  # newer than the persistent tier's (local saves skip non-finite steps too)
            restored, _ = self.local_tier.restore(local.step, local.from_peer,
                                                  with_shardings(self.abstract_state, self.shardings))
            latest, origin = local.step, f"local step {local.step}"
        else:
            restored, origin = self._restore(latest), f"checkpoint {latest}"
        self.state = restored.replace(skipped_steps=skipped)  # skipped_steps counts the whole run
        self.data.set_state(position)  # keep reading forward: do not replay the batches that failed
        self._write({"kind": "rollback", "step": step, "restored_step": latest, "nonfinite_streak": streak})
        self.monitor.log(f"{streak} non-finite steps in a row at step {step}: rolled back to {origin}")
        return latest

    def close(self) -> None:
        self.profiler.stop()  # a run that raised inside the traced steps: one trace per process at a time
        self.checkpointer.close()
        if self.local_tier:
            self.local_tier.close()
        self.monitor.close()
        self.data.close()
        if self._lock is not None:
            self._lock.release()

    # -- metrics ------------------------------------------------------------------------------
    def _write(self, record: dict) -> None:
        """One record to metrics.jsonl / TensorBoard, then to the on_log hook (process 0 only)."""
        self.monitor.write(record)
        if self.on_log is not None and self.is_main:
            self.on_log(record)

    def _grpo_record(self, elapsed: float) -> dict:
        """A GRPO run's generation statistics (grpo_batches.GRPOBatches.stats) and how the logging
        window's `elapsed` seconds split into sampling (generation_s) and the rest (update_s)."""
        if self.objective.name != "grpo":
            return {}
        generation = self.data.generation_seconds - self._generation_seconds
        self._generation_seconds = self.data.generation_seconds
        return {**self.data.stats, "generation_s": generation, "update_s": elapsed - generation}

    def _log_grpo_warning(self, step: int) -> None:
        """A GRPO generation's warning (grpo_batches.GRPOBatches.take_warning: its groups all had equal
        rewards), once, at the first step it trains: logged, and written to metrics.jsonl as
        {"kind": "warning", "step", "message"}."""
        message = self.data.take_warning() if self.objective.name == "grpo" else None
        if message:
            self.monitor.log(f"warning: step {step}: {message}")
            self._write({"kind": "warning", "step": step, "message": message})

    def _log_train(self, step: int, m: dict, tokens_per_sec: float, phase, elapsed: float) -> None:
        flops = self._flops_per_token[phase.seq_len] * tokens_per_sec
        mfu = flops / self._peak if self._peak else None
        record = {"kind": "train", "step": step, "loss": float(m["loss"]), "tokens_per_sec": tokens_per_sec,
                  "mfu": mfu, "lr": float(m["lr"]), "grad_norm": float(m["grad_norm"]),
                  "skipped_steps": int(m["skipped_steps"]), "phase": phase.name, "rope_theta": phase.rope_theta,
                  **{k: float(m[k]) for k in self.objective.metric_keys if k != "loss"},
                  **({"image_token_share": float(m["image_token_share"])} if "image_token_share" in m else {}),
                  **self._grpo_record(elapsed),
                  **router_metrics(m["expert_counts"], m["dropped"]),
                  "expert_load": np.round(expert_load(m["expert_counts"]), 5).tolist()}
        self._write(record)
        self._last_loss = (step, record["loss"])
        self.monitor.progress(step, record["loss"], tokens_per_sec, mfu)

    def evaluate(self, step: int, rope_theta: float) -> dict:
        """Held-out metrics per source, logged at `step`: loss and perplexity (lm, sft), or the DPO
        loss, reward_accuracy, reward_margin, chosen_reward and rejected_reward (dpo); for GRPO the
        rewards of greedy completions of grpo.eval_prompts (eval/prompts/reward and each function's)."""
        if self.objective.name == "grpo":
            scores = self.data.evaluate(self.current_model(rope_theta))
            record = {"kind": "eval", "step": step, **{f"eval/prompts/{k}": v for k, v in scores.items()}}
            self._write(record)
            self.monitor.log(" ".join(f"{k}={v:.4f}" for k, v in record.items() if k.startswith("eval/")))
            return record
        if rope_theta not in self._eval_compiled and jax.process_count() > 1:
            self._compile_eval_on_every_process(rope_theta)
        results = evaluate_params(self._eval_step, self.state.params, self.state.biases, self.eval_data, self.mesh,
                                  rope_theta, reference=self.state.reference, objective=self.objective)
        record: dict = {"kind": "eval", "step": step}
        for source, r in results.items():
            record.update({f"eval/{source}/{k}": v for k, v in r.items() if k not in ("tokens", "pairs")})
        self._write(record)
        self.monitor.log(" ".join(f"{k}={v:.4f}" for k, v in record.items() if k.startswith("eval/")))
        return record

    def current_model(self, rope_theta: float):
        """The model at the state's weights now, at RoPE base `rope_theta`, for generation (a
        capacity MoE backend becomes the dropless one, so padding changes no output)."""
        model = self.parts.merge(self.state.params, self.state.biases)
        model.config = model.config.replace(rope_theta=rope_theta)
        if model.config.moe_backend == "capacity":
            model.config = model.config.replace(moe_backend="auto")
        return model

    def _token_logps(self, token_logps, rows: dict) -> np.ndarray:
        """Per-token log-probs [N, S] of GRPO rows under the state's weights now (its old_logp)."""
        batch = distributed.global_batch({k: rows[k] for k in self.parts.batch_keys}, self.mesh)
        with jax.set_mesh(self.mesh):
            return np.asarray(token_logps(self.state.params, self.state.biases, batch, self.data.phase.rope_theta))

    def run_harness(self, step: int, rope_theta: float) -> dict:
        """The eval.harness_tasks scores of the model at `step` (at its phase's RoPE base), logged."""
        model = self.current_model(rope_theta)
        self.monitor.log(f"step {step}: lm-eval harness on {', '.join(self.harness.tasks)}")
        record = self.harness.run(step, model)
        self._write(record)
        self.monitor.log(" ".join(f"{k}={v:.4f}" for k, v in record.items() if k.startswith("harness/")))
        return record

    def _compile_eval_on_every_process(self, rope_theta: float) -> None:
        """As _compile_step_on_every_process, for the evaluation step of each RoPE base."""
        self._eval_compiled.add(rope_theta)
        shapes = {tuple((k, v.shape) for k, v in sorted(local.items())): local
                  for source_batches in self.eval_data.values() for local in source_batches}
        for local in shapes.values():  # one program per batch shape
            self._eval_step.lower(self.state.params, self.state.biases, self.state.reference,
                                  distributed.global_batch(local, self.mesh), rope_theta).compile()
        distributed.barrier(f"evaluation compiled for rope_theta {rope_theta:g}")


def evaluate_params(eval_step, params: dict, biases: jax.Array, batches: dict, mesh, rope_theta: float, *,
                    reference: dict | None = None, objective=TokenObjective()) -> dict[str, dict[str, float]]:
    """{source: objective.evaluation(totals)} on held-out `batches` ({loss, perplexity, tokens} for
    lm / sft); eval_step from step.jit_eval_step with the same objective; reference: a DPO run's."""
    out = {}
    with jax.set_mesh(mesh):
        for source, source_batches in batches.items():
            sums = zero_sums(objective)
            for local in source_batches:
                sums = jax.tree.map(jnp.add, sums, eval_step(params, biases, reference,
                                                             distributed.global_batch(local, mesh), rope_theta))
            out[source] = objective.evaluation(sums)
    return out
