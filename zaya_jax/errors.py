"""What a user can get wrong, and the exit codes the entry points end with.

`UserError` is a mistake in an input the user gave (config file or override, CLI flag, path,
data file, checkpoint, tokenizer): its message names the input and the fix in one or two lines,
and the command-line entry points print that message alone and exit with `EXIT_USER_ERROR`.
Anything else that escapes is a bug and keeps its traceback.

Training (`python -m zaya_jax.train`) ends in one of:
  EXIT_OK         0   done: train.steps reached (or the data ran out); the final checkpoint is written
  EXIT_FAILED     1   failed: the run cannot go on by itself (rollback budget spent, a checkpoint
                      write failed, a bug); requeueing repeats the failure until someone acts
  EXIT_USER_ERROR 2   a bad input (config, flag, data, checkpoint), named on stderr
  EXIT_PREEMPTED  75  stopped by SIGTERM / SIGINT after saving its step (EX_TEMPFAIL of
                      sysexits.h): requeue it and it resumes from that step (launch/README.md)
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USER_ERROR = 2
EXIT_PREEMPTED = 75


class UserError(Exception):
    """A bad input, reported as its message alone (one or two lines), exit code 2."""


class MissingInputError(UserError, FileNotFoundError):
    """A file or directory the user named (data source, tokenizer, shard) does not exist."""
