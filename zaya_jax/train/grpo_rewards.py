"""Rewards for GRPO, as TRL's GRPOTrainer calls them: plain Python callables

    reward(prompts: list, completions: list[str], **columns) -> list[float]   (one per completion)

where `columns` are the dataset's other fields, one value per completion (e.g. `answer`), and, as
TRL passes them, a completion is its text, or for a conversational prompt (a list of messages)
the assistant's message [{"role": "assistant", "content": text}] (`completion_text` reads either). Several
are combined with weights (`combine_rewards`); a reward that raises, returns the wrong number of
values or a value that is not a finite number is named in one RewardError (a UserError) line.

A run names its rewards in grpo.reward_funcs (resolve_rewards): built-in names, or
'package.module:function' for a user's function (imported from sys.path, as any import: the
current directory, PYTHONPATH, the installed packages), with grpo.reward_weights. The columns a
reward takes by name (`answer` for exact_answer: required_columns) must be columns of the prompts
(check_reward_columns, before anything samples or compiles).

Built in, for the post-training demo's questions (zaya_jax.data.instruction_tasks):
  exact_answer   1.0 when the completion's answer (its first line, instruction_tasks.extract_answer)
                 is exactly the `answer` column, else 0.0
  answer_format  1.0 when the completion is one integer and nothing else (around it only
                 whitespace), the form the demo's answers take, else 0.0
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import re
import traceback
from typing import Callable, Mapping, Sequence

import numpy as np

from zaya_jax.config import ConfigError
from zaya_jax.data.instruction_tasks import extract_answer
from zaya_jax.errors import UserError

Reward = Callable[..., Sequence[float]]
_INTEGER = re.compile(r"-?\d+")


class RewardError(UserError):
    pass


def completion_text(completion) -> str:
    """A completion as TRL passes it (text, or a conversational prompt's [{role, content}] messages) -> its text."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def exact_answer(prompts: Sequence, completions: Sequence, answer: Sequence[str], **columns) -> list[float]:
    del prompts, columns
    return [float(extract_answer(completion_text(c)) == str(a)) for c, a in zip(completions, answer, strict=True)]


def answer_format(prompts: Sequence, completions: Sequence, **columns) -> list[float]:
    del prompts, columns
    return [float(bool(_INTEGER.fullmatch(completion_text(c).strip()))) for c in completions]


BUILT_IN = {"exact_answer": exact_answer, "answer_format": answer_format}


def resolve_rewards(funcs: str, weights: str) -> tuple[list[Reward], list[float] | None]:
    """grpo.reward_funcs ('exact_answer,answer_format,my.module:fn') and grpo.reward_weights ('1,0.5';
    '': 1 each) -> (the callables, the weights or None); ConfigError naming the field otherwise."""
    rewards = []
    for name in (n.strip() for n in funcs.split(",")):
        if name in BUILT_IN:
            rewards.append(BUILT_IN[name])
            continue
        module, _, attr = name.partition(":")
        if not module or not attr:
            raise ConfigError(f"grpo.reward_funcs: {name!r} is neither a built-in reward ({', '.join(BUILT_IN)}) "
                              "nor 'package.module:function'")
        rewards.append(import_reward(name, module, attr))
    if not weights.strip():
        return rewards, None
    try:
        values = [float(w) for w in weights.split(",")]
    except ValueError:
        raise ConfigError(f"grpo.reward_weights: {weights!r} is not a comma-separated list of numbers") from None
    if len(values) != len(rewards):
        raise ConfigError(f"grpo.reward_weights: {len(values)} weights for {len(rewards)} reward functions "
                          f"(grpo.reward_funcs={funcs!r})")
    return rewards, values


def import_reward(name: str, module: str, attr: str) -> Reward:
    """grpo.reward_funcs' 'module:function' -> the function; ConfigError saying how the module is found
    (from sys.path, as any import) and what failed."""
    try:
        found = importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is not None and (module == err.name or module.startswith(err.name + ".")):
            path = os.environ.get("PYTHONPATH", "")
            raise ConfigError(f"grpo.reward_funcs: {name!r}: no module named {err.name!r}. A 'module:function' "
                              f"reward is imported from sys.path, as any Python import: the current directory "
                              f"({os.getcwd()}), PYTHONPATH ({path or 'not set'}), the installed packages; run from "
                              f"the directory that holds {module.replace('.', '/')}.py, or add that directory to "
                              "PYTHONPATH") from None
        raise ConfigError(f"grpo.reward_funcs: {name!r}: importing module {module!r} raised ModuleNotFoundError: "
                          f"{err} (a module it imports is missing: install it)") from None
    except Exception as err:  # the user's module failed while it ran: what it raised, and where
        frame = traceback.extract_tb(err.__traceback__)[-1]
        raise ConfigError(f"grpo.reward_funcs: {name!r}: importing module {module!r} raised {type(err).__name__}: "
                          f"{err} ({frame.filename}, line {frame.lineno})") from None
    reward = getattr(found, attr, None)
    if reward is None:
        functions = sorted(n for n, v in vars(found).items() if callable(v) and not n.startswith("_"))
        raise ConfigError(f"grpo.reward_funcs: {name!r}: module {module!r} ({found.__file__}) has no {attr!r}; "
                          f"it defines {', '.join(functions) or 'no function'}")
    if not callable(reward):
        raise ConfigError(f"grpo.reward_funcs: {name!r} is not callable")
    return reward


def required_columns(reward: Reward) -> list[str]:
    """The keyword arguments `reward` needs beyond (prompts, completions): the prompt columns it must
    be given (TRL passes every other field of the dataset by name); [] where its signature cannot be read."""
    try:
        parameters = list(inspect.signature(reward).parameters.values())
    except (TypeError, ValueError):
        return []
    named = [p for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    positional = sum(p.kind is p.POSITIONAL_OR_KEYWORD for p in named[:2])
    return [p.name for p in named[positional:] if p.default is p.empty]


def check_reward_columns(rewards: Sequence[Reward], columns: Sequence[str], source: str, field: str) -> None:
    """Each reward's required_columns must be columns of the prompts `source` (named by `field`), before
    anything samples or compiles; ConfigError naming the file, the column and the reward otherwise."""
    for reward in rewards:
        missing = [c for c in required_columns(reward) if c not in columns]
        if missing:
            raise ConfigError(f"{field}: {source} has no column {missing[0]!r}, which reward function "
                              f"{reward_name(reward)} (grpo.reward_funcs) takes; its records have "
                              f"{', '.join(['prompt', *columns])}: add {missing[0]!r} to every record, or choose "
                              "reward functions that read only those")


def reward_name(reward: Reward) -> str:
    return getattr(reward, "__name__", type(reward).__name__)


def combine_rewards(rewards: Sequence[Reward], weights: Sequence[float] | None, prompts: Sequence,
                    completions: Sequence[str], columns: Mapping[str, Sequence]) -> tuple[np.ndarray, np.ndarray]:
    """-> (the weighted sum [N] float32, each reward's values [R, N]); weights default to 1 each."""
    weights = [1.0] * len(rewards) if weights is None else list(weights)
    if len(weights) != len(rewards):
        raise RewardError(f"{len(weights)} reward weights for {len(rewards)} reward functions")
    values = []
    for reward in rewards:
        name = reward_name(reward)
        try:
            got = list(reward(list(prompts), list(completions), **columns))
        except Exception as err:  # a user's function: any failure is reported by its name
            raise RewardError(f"reward function {name} raised {type(err).__name__}: {err}") from err
        if len(got) != len(completions):
            raise RewardError(f"reward function {name} returned {len(got)} values for {len(completions)} "
                              "completions (one float per completion)")
        bad = next((v for v in got if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)),
                   None)
        if bad is not None:
            raise RewardError(f"reward function {name} returned {bad!r}: each value must be a finite number")
        values.append(got)
    per_reward = np.asarray(values, np.float32).reshape(len(rewards), len(completions))
    return (np.asarray(weights, np.float32)[:, None] * per_reward).sum(axis=0), per_reward
