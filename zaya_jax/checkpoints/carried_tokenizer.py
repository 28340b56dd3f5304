"""The tokenizer a checkpoint carries: a copy of the file its run was trained with, in every step.

A setting such as `data.tokenizer = "demo:tokenizer"` names a file per machine (the demo corpus
is built per Python, so 3.11 and 3.12 resolve it to different tokenizers), and a file at a fixed
path can change after training. So a run reads its tokenizer file once at start-up (RunTokenizer)
and every checkpoint it saves holds
  <step>/tokenizer/<file name>    the file's bytes, written into Orbax's temporary step directory
                                  just before the manifest (sealing.py): listed and checksummed
                                  there, committed by the same rename as the weights
  config "tokenizer"              {"file": "tokenizer/<file name>", "sha256", "source": the path it
                                  was read from, "setting": data.tokenizer}
Readers of a checkpoint (generate, evaluate_tasks, the harness, convert to_hf, preference_pairs)
take the carried copy (`checkpoint_tokenizer`); a --tokenizer that is another file is refused
naming both. evaluate, which reads prepared held-out data, refuses sources tokenized with another
file (`check_prepared_sources`). A resume and train.init_from_checkpoint compare the run's
data.tokenizer with what the checkpoint carries (`check_against`) and refuse another file.
A checkpoint saved before checkpoints carried their tokenizer (or written by `convert to_orbax`)
resolves its saved data.tokenizer as it names it, and the line that says so says it cannot be
verified.

  RunTokenizer.of_config(config)          the run's tokenizer file read now, or None (no data.tokenizer)
  carried(directory, step=None)           (step, Carried or None) of a checkpoint directory
  checkpoint_tokenizer(checkpoint, step=None, given=None)
                                          (the file to use, the line naming it) for a reader
  check_prepared_sources(checkpoint, step, data_config)
                                          evaluate's held-out data was tokenized with the carried file
  check_against(run, found, what, fix)    ConfigError when `run` is not the file `found` carries
"""

from __future__ import annotations

import dataclasses
import hashlib
import os

from zaya_jax.checkpoints.orbax_checkpoint import checkpoint_dir, read_config, whole_step
from zaya_jax.config import ConfigError
from zaya_jax.data.sources import open_sources, tokenizer_path
from zaya_jax.data.tokenizer import file_sha256
from zaya_jax.errors import UserError


ITEM = "tokenizer"  # the step's directory holding the copy (integrity.OPTIONAL_ITEMS)
UNVERIFIED = ("carries no copy of its tokenizer (saved before checkpoints carried one, or by convert to_orbax), so "
              "the tokenizer cannot be verified to be the one it was trained with")


def short(sha256: str) -> str:
    return sha256[:12]


@dataclasses.dataclass(frozen=True)
class RunTokenizer:
    """The tokenizer file a run trains with, as read at start-up: what its checkpoints carry."""

    path: str       # where it was read from (data.tokenizer resolved)
    setting: str    # data.tokenizer as configured ('demo:tokenizer', a path)
    contents: bytes

    @classmethod
    def of_config(cls, config) -> RunTokenizer | None:
        """The file the config's data.tokenizer names, read now; None when it names none."""
        if "data" not in config or not config.data.get("tokenizer"):
            return None
        path = os.path.abspath(tokenizer_path(config.data))
        with open(path, "rb") as f:
            return cls(path, str(config.data.tokenizer), f.read())

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.contents).hexdigest()

    @property
    def file(self) -> str:
        """Its path inside a step directory."""
        return f"{ITEM}/{os.path.basename(self.path)}"

    def record(self) -> dict:
        """What the saved config says of it (the top-level "tokenizer")."""
        return {"file": self.file, "sha256": self.sha256, "source": self.path, "setting": self.setting}

    def files(self) -> dict[str, bytes]:
        """What a step carries of it (Sealer.starting's files)."""
        return {self.file: self.contents}

    def describe(self) -> str:
        return f"data.tokenizer {self.setting!r} = {self.path} (sha256 {short(self.sha256)})"


@dataclasses.dataclass(frozen=True)
class Carried:
    """The tokenizer copy a checkpoint step carries."""

    path: str      # the copy, inside the step directory
    sha256: str
    source: str    # the file it was read from when the run started
    setting: str   # the run's data.tokenizer
    step: int

    def describe(self) -> str:
        return f"{self.path} (sha256 {short(self.sha256)}, copied from {self.source})"


def carried(directory: str, step: int | None = None) -> tuple[int, Carried | None]:
    """(the step: `step`, or the newest whose config and tokenizer are whole; the tokenizer it
    carries, or None) of the checkpoint directory `directory`."""
    step = whole_step(directory, ("config", ITEM), step)
    record = read_config(directory, step).get("tokenizer")
    if record is None:
        return step, None
    path = os.path.join(directory, str(step), record["file"])
    if not os.path.isfile(path):
        raise UserError(f"checkpoint {step} in {directory}: its config records the tokenizer {record['file']}, "
                        "which the step does not hold (not written by zaya_jax's trainer); pass --tokenizer FILE")
    return step, Carried(path, record["sha256"], record["source"], record["setting"], step)


class NoTokenizer(UserError):
    """A checkpoint that neither carries a tokenizer nor names one that exists (synthetic data, a
    to_orbax output, a data.tokenizer file that is gone), and no --tokenizer was given."""


def checkpoint_tokenizer(checkpoint: str | os.PathLike, step: int | None = None, given: str | None = None,
                         flag: str = "--tokenizer") -> tuple[str, str]:
    """(the tokenizer file to use with a training checkpoint, one line saying which it is).

    The copy the step carries; `given` (the reader's `flag`) only when it is that same file
    (UserError naming both otherwise). A step without a copy: `given`, else the saved data.tokenizer
    resolved as it names it (NoTokenizer when it names none), each said to be unverifiable."""
    directory = checkpoint_dir(os.fspath(checkpoint))
    step, found = carried(directory, step)
    if found is not None and given is None:
        return found.path, (f"[tokenizer: {found.path}, carried by checkpoint {step} (sha256 {short(found.sha256)}, "
                            f"the run's data.tokenizer {found.setting!r})]")
    if found is not None:
        if not os.path.isfile(given):
            raise UserError(f"{flag} {given}: no such file; drop {flag} to use the tokenizer checkpoint {step} "
                            f"carries ({found.path})")
        given_sha256 = file_sha256(given)
        if given_sha256 != found.sha256:
            raise UserError(f"{flag} {given} (sha256 {short(given_sha256)}) is not the tokenizer {checkpoint} was "
                            f"trained with: checkpoint {step} carries {found.describe()}; drop {flag} to use it")
        return given, f"[tokenizer: {given}, the file checkpoint {step} carries (sha256 {short(found.sha256)})]"
    if given is not None:
        return given, f"[tokenizer: {given}; checkpoint {step} {UNVERIFIED}]"
    config = read_config(directory, step)
    if "data" not in config or not config.data.get("tokenizer"):
        raise NoTokenizer(f"--checkpoint {checkpoint}: its config names no tokenizer (synthetic data, or a to_orbax "
                          f"output); pass {flag} FILE")
    try:
        path = tokenizer_path(config.data)
    except FileNotFoundError as err:
        raise NoTokenizer(f"--checkpoint {checkpoint}: {err}; pass {flag} FILE") from err
    return path, f"[tokenizer: {path}, the run's data.tokenizer {config.data.tokenizer!r}; checkpoint {step} {UNVERIFIED}]"


def check_prepared_sources(checkpoint: str | os.PathLike, step: int | None, data_config) -> str | None:
    """The prepared data.sources of `data_config` (an evaluation's) were tokenized with the file
    checkpoint `step` carries: UserError naming both otherwise; the line to print when it carries none."""
    step, found = carried(checkpoint_dir(os.fspath(checkpoint)), step)
    if found is None:
        return f"note: checkpoint {step} {UNVERIFIED}"
    prepared = next(iter(open_sources(data_config).values())).manifest["tokenizer"]  # one for all: open_sources
    if prepared["sha256"] != found.sha256:
        raise UserError(f"data.sources were prepared with the tokenizer {prepared['path']} (sha256 "
                        f"{short(prepared['sha256'])}), but {checkpoint} was trained with another: checkpoint {step} "
                        f"carries {found.describe()}; evaluate it on sources prepared with that file "
                        "(python -m zaya_jax.data.prepare --tokenizer FILE), given with --config")
    return None


def check_against(run: RunTokenizer | None, found: Carried | None, what: str, fix: str) -> str | None:
    """`run` (this run's tokenizer) against what checkpoint `found` carries, for `what` (the
    checkpoint as the message names it): ConfigError naming both files and `fix` when they differ;
    the line to log when the checkpoint carries none (it cannot be verified); else None."""
    if run is None:
        return None
    if found is None:
        return f"{what} {UNVERIFIED}; this run's is {run.describe()}"
    if run.sha256 != found.sha256:
        raise ConfigError(f"{what} was trained with another tokenizer: it carries {found.describe()}, but this "
                          f"run's {run.describe()}; {fix}")
    return None
