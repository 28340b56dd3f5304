"""Generated instruction tasks with checked answers: the post-training demo's SFT and DPO data.

Short questions in the demo corpus's two technical domains (small-number arithmetic, as in its
math worksheets, and one-line Python, as in its standard-library code), each with one exact
answer a small model can learn to produce (one number), and a plausible wrong answer of the same
form (a rejected completion for DPO: demo:preference's, and zaya_jax.preference_pairs' for the
questions the model answers right): a near miss, the answer off by one or two (by one for a length).

  add       What is 17 + 25?                                        42
  max       What does `print(max(17, 42))` print?                   42
  index     What does `print([8, 31, 5][1])` print?                 31
  variable  What does `a = 7; b = 3; print(b)` print?               3
  length    What does `print(len([4, 9, 2]))` print?                3

(Wrong answers that are the question's other numbers, e.g. the minimum for a max, make DPO push
down copying from the prompt as a whole: the demo model's exact-match accuracy fell with them.)

Task i of a kind is drawn from a `random.Random` seeded by (seed, kind, i), so every list here is
deterministic. A question is held out iff the sha256 of its text falls in the held-out bucket
(1 in HELDOUT_BUCKETS), so the train and held-out splits never share a question, however many
tasks are drawn. Held-out lists hold distinct questions; train lists may repeat one.

    tasks = instruction_tasks.tasks("heldout", per_kind=100)    # 500 distinct held-out tasks
    tasks[0].chat_record()          # {"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}
    tasks[0].preference_record()    # {"prompt": [...], "chosen": [...], "rejected": [...]}
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import string

HELDOUT_BUCKETS = 10  # 1 in 10 questions is held out
SPLITS = ("train", "heldout")
MAX_DRAWS_PER_TASK = 200  # a split that needs more draws than this per task has run out of questions


@dataclasses.dataclass(frozen=True)
class Task:
    """One question: its kind, the user's question, the exact answer and a wrong one."""

    kind: str
    question: str
    answer: str
    wrong: str

    def prompt_messages(self) -> list[dict]:
        return [{"role": "user", "content": self.question}]

    def chat_record(self) -> dict:
        """The SFT record: a `messages` conversation answered correctly."""
        return {"messages": [*self.prompt_messages(), {"role": "assistant", "content": self.answer}]}

    def preference_record(self) -> dict:
        """The DPO record (TRL's conversational format): chosen = the answer, rejected = the wrong one."""
        return {"prompt": self.prompt_messages(), "chosen": [{"role": "assistant", "content": self.answer}],
                "rejected": [{"role": "assistant", "content": self.wrong}]}


def _code_question(code: str) -> str:
    return f"What does `{code}` print?"


def _near_miss(rng: random.Random, answer: int, offsets: tuple[int, ...] = (-2, -1, 1, 2)) -> str:
    """A wrong answer close to `answer`: answer + one of `offsets`, never negative."""
    wrong = answer + rng.choice(offsets)
    return str(wrong if wrong >= 0 else answer + max(offsets))


def _add(rng: random.Random) -> Task:
    a, b = rng.randint(0, 30), rng.randint(0, 30)
    return Task("add", f"What is {a} + {b}?", str(a + b), _near_miss(rng, a + b))


def _max(rng: random.Random) -> Task:
    a, b = rng.sample(range(100), 2)
    return Task("max", _code_question(f"print(max({a}, {b}))"), str(max(a, b)), _near_miss(rng, max(a, b)))


def _index(rng: random.Random) -> Task:
    values = rng.sample(range(100), rng.randint(3, 5))
    i = rng.randrange(len(values))
    return Task("index", _code_question(f"print({values}[{i}])"), str(values[i]), _near_miss(rng, values[i]))


def _variable(rng: random.Random) -> Task:
    names = rng.sample(string.ascii_lowercase, rng.randint(2, 3))
    values = rng.sample(range(100), len(names))
    i = rng.randrange(len(names))
    code = "; ".join(f"{n} = {v}" for n, v in zip(names, values)) + f"; print({names[i]})"
    return Task("variable", _code_question(code), str(values[i]), _near_miss(rng, values[i]))


def _length(rng: random.Random) -> Task:
    values = [rng.randint(0, 99) for _ in range(rng.randint(1, 8))]
    return Task("length", _code_question(f"print(len({values}))"), str(len(values)),
                _near_miss(rng, len(values), (-1, 1)))


GENERATORS = {"add": _add, "max": _max, "index": _index, "variable": _variable, "length": _length}
KINDS = tuple(GENERATORS)


def is_heldout(question: str) -> bool:
    """Whether a question belongs to the held-out split (a fixed function of its text)."""
    return int.from_bytes(hashlib.sha256(question.encode()).digest()[:8], "little") % HELDOUT_BUCKETS == 0


def draw(kind: str, index: int, seed: int = 0) -> Task:
    """Task number `index` of `kind`'s stream for `seed` (either split)."""
    return GENERATORS[kind](random.Random(f"{seed}-{kind}-{index}"))


def kind_tasks(kind: str, split: str, num: int, seed: int = 0) -> list[Task]:
    """The first `num` tasks of `kind` in `split` (held-out: distinct questions) in stream order."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    found, seen = [], set()
    for index in range(num * MAX_DRAWS_PER_TASK):
        if len(found) == num:
            break
        task = draw(kind, index, seed)
        if is_heldout(task.question) == (split == "heldout") and not (split == "heldout" and task.question in seen):
            seen.add(task.question)
            found.append(task)
    if len(found) < num:
        raise ValueError(f"{kind}: only {len(found)} {split} questions in {num * MAX_DRAWS_PER_TASK} draws, "
                         f"fewer than the {num} asked for")
    return found


def tasks(split: str, per_kind: int, seed: int = 0) -> list[Task]:
    """`per_kind` tasks of every kind in `split`, interleaved (kind by kind, in KINDS order)."""
    by_kind = [kind_tasks(kind, split, per_kind, seed) for kind in KINDS]
    return [task for group in zip(*by_kind) for task in group]


def extract_answer(completion: str) -> str:
    """The answer in a generated completion (text decoded up to end of turn): its first line,
    stripped of surrounding whitespace and a trailing period."""
    lines = completion.strip().splitlines()
    return lines[0].strip().rstrip(".").strip() if lines else ""


def is_correct(task: Task, completion: str) -> bool:
    """Exact match of the completion's extracted answer against the task's answer."""
    return extract_answer(completion) == task.answer
