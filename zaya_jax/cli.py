"""How every entry point runs: absl flags (+ ml_collections config files), one error style.

    if __name__ == "__main__":
        cli.run(main)        # main(argv) as for absl.app.run

What `run` adds to absl.app.run, the same for train, plan, generate, evaluate, convert and
data.prepare:
  - `--flag-name` is accepted for every flag `--flag_name` (both spellings work);
  - `--help` (or -h) prints the module's usage text and its flags and exits 0;
  - a user error ends in `error: ...` lines (one or two: the input and the fix) and exit code 2:
    a `zaya_jax.errors.UserError` raised anywhere, an unknown or malformed flag or config
    override, a missing config file, `app.UsageError`; `--debug` shows the traceback instead;
  - library logs (Orbax INFO lines) are quiet unless `--verbosity` asks for them;
  - in one process of a multi-process job, any other error prints its traceback and exits 1 at
    once (`exit_failed_now`): the job's launcher sees the failure and can stop and restart the job.
"""

from __future__ import annotations

import os
import pathlib
import re
import sys
import traceback
from typing import Callable, Sequence

from absl import app, flags, logging

from zaya_jax.errors import EXIT_FAILED, EXIT_USER_ERROR, UserError

_DEBUG = flags.DEFINE_bool("debug", False, "Show the traceback of an error (otherwise a user error is one "
                                           "`error:` line and exit code 2).")
HELP_FLAGS = ("--help", "-h", "--helpshort", "--helpfull", "-?")


def normalize_flag_names(argv: Sequence[str]) -> list[str]:
    """`--flag-name[=v]` -> `--flag_name[=v]` for every defined flag spelled with dashes."""
    out = []
    for arg in argv:
        if arg.startswith("--") and not arg.startswith("--config."):
            name, sep, value = arg[2:].partition("=")
            underscored = name.replace("-", "_")
            if underscored != name and (underscored in flags.FLAGS or underscored.removeprefix("no") in flags.FLAGS):
                arg = f"--{underscored}{sep}{value}"
        out.append(arg)
    return out


def _config_file_argument(argv: Sequence[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            return arg[len("--config="):]
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _unknown_field_message(err: AttributeError, argv: Sequence[str]) -> str:
    """ml_collections' garbled "'\\'stepz\\'\\nDid you mean..." -> which override and the fix."""
    text = str(err).replace("\\'", "'").replace("\\n", "\n")
    field = re.search(r"'([^'\n]+)'", text)
    name = field.group(1) if field else "?"
    override = next((a.split("=")[0] for a in argv if a.startswith("--config.") and name in a), "--config...")
    hint = re.search(r'Did you mean "([^"]+)"', text)
    return (f"{override}: the config has no field {name!r}"
            + (f"; did you mean {hint.group(1)!r}?" if hint else "") + "\n(the config file lists every field)")


_OVERRIDE_TYPES = (("invalid literal for int()", "an integer"), ("could not convert string to float", "a number"),
                   ("Non-boolean argument to boolean flag", "true or false"))


def _override_type_message(text: str) -> str | None:
    """absl's "flag --config.train.steps=abc: invalid literal for int() ..." -> the field, its type and the fix."""
    found = re.match(r"flag --config\.([\w.]+)=(.*?): (.*)", text, re.S)
    kind = next((k for python, k in _OVERRIDE_TYPES if found and python in found.group(3)), None)
    if kind is None:
        return None
    field, value = found.group(1), found.group(2)
    return f"--config.{field}={value}: {field} takes {kind}, not {value!r}; give e.g. --config.{field}=" + {
        "an integer": "100", "a number": "0.5", "true or false": "false"}[kind]


def parse_flags(argv: Sequence[str]) -> list[str]:
    """absl's flag parsing, with user errors raised as UserError."""
    config = _config_file_argument(argv[1:])
    if config is not None and "config" in flags.FLAGS and not os.path.isfile(config.split(":")[0]):
        raise UserError(f"--config {config}: no such config file (the shipped configs are in configs/)")
    override = next((a for a in argv[1:] if a.startswith("--config.")), None)
    if override is not None and config is None and "config" in flags.FLAGS:
        raise UserError(f"{override}: overrides a field of a config file, but no --config was given\n"
                        "add --config FILE, e.g. --config configs/demo.py (the shipped configs are in configs/)")
    try:
        return flags.FLAGS(list(argv))
    except flags.Error as err:
        raise UserError(_override_type_message(str(err)) or f"{err} (--help lists the flags)") from err
    except AttributeError as err:  # ml_collections: an override of a field the config does not have
        raise UserError(_unknown_field_message(err, argv)) from err
    except SyntaxError as err:  # ml_collections imports the config file while the flags are parsed
        if config is None or not _same_file(err.filename, config.split(":")[0]):
            raise
        raise UserError(f"--config {config}: Python syntax error at line {err.lineno}, column {err.offset}: "
                        f"{err.msg}") from err


def _same_file(a: str | None, b: str) -> bool:
    return a is not None and os.path.exists(a) and os.path.samefile(a, b)


def cache_root() -> pathlib.Path:
    """$ZAYA_JAX_CACHE, else ~/.cache/zaya_jax: where the compilation cache (jit/) and the demo
    corpus (demo_corpus/) go; a UserError when it names a file."""
    root = os.environ.get("ZAYA_JAX_CACHE")
    if root and os.path.exists(root) and not os.path.isdir(root):
        raise UserError(f"ZAYA_JAX_CACHE={root}: is a file, not a directory; point it at a directory or unset it")
    return pathlib.Path(root or "~/.cache/zaya_jax").expanduser()


def usage() -> str:
    """The running module's docstring (its examples) and its flags."""
    doc = (getattr(sys.modules.get("__main__"), "__doc__", None) or "").strip()
    listed = flags.FLAGS.main_module_help() or flags.FLAGS.module_help(sys.argv[0])
    return (f"{doc}\n\nflags:\n{listed}\n  --[no]debug: {flags.FLAGS['debug'].help}\n"
            "  --verbosity: log level (default: WARNING; 0 shows the libraries' INFO logs)\n")


def report(err: BaseException) -> int:
    """Prints a user error as `error:` lines on stderr; returns the exit code."""
    lines = str(err).strip().splitlines() or [type(err).__name__]
    print("error: " + "\n       ".join(lines), file=sys.stderr)
    return EXIT_USER_ERROR


def run(main: Callable[[list[str]], object], argv: Sequence[str] | None = None) -> None:
    """Parses flags, runs `main(argv)` and exits: 0, 2 for a user error, a traceback for a bug."""
    argv = normalize_flag_names(sys.argv if argv is None else argv)
    if any(a in HELP_FLAGS for a in argv[1:]):
        print(usage())
        sys.exit(0)
    debug = "--debug" in argv

    def parse(args):
        try:
            return parse_flags(args)
        except UserError as err:
            if debug:
                raise
            sys.exit(report(err))

    def guarded(args):
        if not flags.FLAGS["verbosity"].present:
            logging.set_verbosity(logging.WARNING)  # Orbax logs every save and restore at INFO
        try:
            return main(args)
        except (UserError, app.UsageError) as err:
            if _DEBUG.value:
                raise
            sys.exit(report(err))
        except Exception:
            if in_multi_process_job():
                exit_failed_now()
            raise

    app.run(guarded, argv=argv, flags_parser=parse)


def in_multi_process_job() -> bool:
    """Whether this process is one of a jax.distributed job's (zaya_jax.parallel.distributed started it)."""
    started = sys.modules.get("zaya_jax.parallel.distributed")
    return started is not None and started.multi_process()


def exit_failed_now() -> None:
    """Prints the error being handled (its traceback) and exits EXIT_FAILED at once, skipping the
    interpreter's teardown, for an error in one process of a multi-process job.

    A normal exit runs jax.distributed's shutdown, which waits up to 300 s for every process at a
    barrier the others never reach while they wait for this one in a collective: the failed process
    hung instead of exiting (a gloo connection that timed out after 30 s did), and no launcher could
    see the failure to stop and restart the job. Exiting at once also ends the others: process 0's
    exit takes the coordination service with it and every other process aborts; another process's
    exit is seen by the launcher (launch/local.sh, srun --kill-on-bad-exit), which stops the job.
    """
    traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_FAILED)
