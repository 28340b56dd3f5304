"""Train ZAYA1.

  python -m zaya_jax.train --config configs/demo.py --workdir runs/demo [--config.train.steps=200 ...]

Resumes from the newest whole checkpoint in WORKDIR/checkpoints when there is one. Writes
WORKDIR/metrics.jsonl, WORKDIR/tensorboard/, WORKDIR/expert_load.png. SIGTERM / SIGINT (caught
from the first line of main on) save a checkpoint and stop; one that comes while the state is
being built stops every process at once, saving nothing (nothing was trained). Exit codes
(zaya_jax.errors): 0 done, 75 stopped by a signal (requeue), 2 a bad input (one line), 1 failed.
Compiled programs are cached in $JAX_COMPILATION_CACHE_DIR (default ~/.cache/zaya_jax/jit), so a
restart compiles nothing it has compiled before.
"""

from __future__ import annotations

from zaya_jax import launch_defaults
from zaya_jax.train import faults

launch_defaults.apply()  # the heap settings, before jax allocates anything
faults.install()  # before anything slow: a signal during start-up (imports, distributed init, compilation) is kept

import os  # noqa: E402
import sys  # noqa: E402

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from zaya_jax import cli, errors  # noqa: E402
from zaya_jax.errors import UserError  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file (configs/*.py).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: checkpoints, metrics, plots.")


def enable_compilation_cache() -> None:
    root = cli.cache_root()  # checked where the cache is set otherwise too: the demo corpus goes there
    import jax
    if not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", str(root / "jit"))


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if _CONFIG.value is None:
        raise app.UsageError("--config is required, e.g. --config configs/demo.py")
    if not _WORKDIR.value:
        raise app.UsageError("--workdir is required, e.g. --workdir runs/demo")
    if os.path.exists(_WORKDIR.value) and not os.path.isdir(_WORKDIR.value):
        raise UserError(f"--workdir {_WORKDIR.value}: is a file, not a directory; choose another --workdir")
    from zaya_jax.parallel import distributed
    distributed.initialize()
    enable_compilation_cache()
    from zaya_jax.train.checkpoint import CheckpointWriteError
    from zaya_jax.train.loop import Trainer
    try:
        trainer = Trainer(_CONFIG.value, _WORKDIR.value)  # a UserError here: cli.run prints it, exit 2
    except faults.StoppedDuringStartup:  # logged; the state's build may still be compiling in its thread
        faults.exit_at_once(errors.EXIT_PREEMPTED)
    failure = None
    try:
        trainer.run()
    except (faults.TrainingFailed, CheckpointWriteError) as e:
        failure = f"{type(e).__name__}: {e}"
    except BaseException as e:
        if isinstance(e, Exception) and not isinstance(e, UserError) and cli.in_multi_process_job():
            # close() could wait for the other processes' part of a save, which never comes: exit now
            cli.exit_failed_now()
        trainer.close()
        raise
    trainer.close()
    if failure:
        print(failure, file=sys.stderr, flush=True)
        # Skip the interpreter's teardown: TensorStore's writes that were cut short would print a
        # traceback each against Orbax's closed event loops, burying the line above.
        os._exit(errors.EXIT_FAILED)
    if trainer.stopped_by:
        sys.exit(errors.EXIT_PREEMPTED)


if __name__ == "__main__":
    cli.run(main)
