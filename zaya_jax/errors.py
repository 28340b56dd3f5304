"""What a user can get wrong, and the exit codes the entry points end with.

`UserError` is a mistake in an input the user gave (config file or override, CLI flag, path,
data file, checkpoint, tokenizer): its message names the input and the fix in one or two lines,
and the command-line entry points print that message alone and exit with `EXIT_USER_ERROR`.
Anything else that escapes is a bug and keeps its traceback.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_USER_ERROR = 2


class UserError(Exception):
    """A bad input, reported as its message alone (one or two lines), exit code 2."""
