"""Procedurally generated arithmetic and algebra problems with worked answers.

The math source of the bundled demo corpus. Every problem is drawn from a `random.Random`
seeded by (seed, index), so `generate_problems(n, seed)` is deterministic, and problem i is
the same whatever n is. Each generator returns a `Problem` whose `answer` the tests can check.

    >>> p = generate_problems(1, seed=0)[0]
    >>> print(p.text())      # "Problem: ...\nSolution: ...\nAnswer: ..."
"""

from __future__ import annotations

import dataclasses
import math
import random
from fractions import Fraction


@dataclasses.dataclass(frozen=True)
class Problem:
    """One problem: its kind, question, worked solution (steps) and final answer."""

    kind: str
    question: str
    solution: str
    answer: str

    def text(self) -> str:
        return f"Problem: {self.question}\nSolution: {self.solution}\nAnswer: {self.answer}\n"


def _signed(v: int) -> str:
    """Formats `v` as a term to add: '+ 3' or '- 3'."""
    return f"+ {v}" if v >= 0 else f"- {-v}"


def _addition(rng: random.Random) -> Problem:
    a, b = rng.randint(100, 99999), rng.randint(100, 99999)
    da, db = str(a)[::-1], str(b)[::-1]
    steps, carry, places = [], 0, ["ones", "tens", "hundreds", "thousands", "ten-thousands"]
    for i in range(max(len(da), len(db))):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        s = x + y + carry
        with_carry = f" + {carry}" if carry else ""
        steps.append(f"{places[i]}: {x} + {y}{with_carry} = {s}, write {s % 10}"
                     + (", carry 1" if s >= 10 else ""))
        carry = s // 10
    if carry:
        steps.append("write the final carry 1")
    return Problem("addition", f"Compute {a} + {b}.", "; ".join(steps) + f". So {a} + {b} = {a + b}.",
                   str(a + b))


def _subtraction(rng: random.Random) -> Problem:
    a, b = sorted((rng.randint(100, 99999), rng.randint(100, 99999)), reverse=True)
    r = a - b
    return Problem("subtraction", f"Compute {a} - {b}.",
                   f"{a} - {b} = {a} - {b // 100 * 100} - {b % 100} = {a - b // 100 * 100} - {b % 100}"
                   f" = {r}. Check: {r} + {b} = {a}.", str(r))


def _multiplication(rng: random.Random) -> Problem:
    a, b = rng.randint(12, 99), rng.randint(102, 999)
    parts = [int(d) * 10 ** i for i, d in enumerate(str(b)[::-1]) if d != "0"][::-1]
    split = " + ".join(f"{a} * {p}" for p in parts)
    values = " + ".join(str(a * p) for p in parts)
    return Problem("multiplication", f"Compute {a} * {b}.",
                   f"Split {b} = {' + '.join(map(str, parts))}. {a} * {b} = {split} = {values} = {a * b}.",
                   str(a * b))


def _division(rng: random.Random) -> Problem:
    d, q = rng.randint(3, 47), rng.randint(20, 999)
    r = rng.randint(0, d - 1)
    n = d * q + r
    return Problem("division", f"Divide {n} by {d}, giving the quotient and remainder.",
                   f"{d} * {q} = {d * q} and {n} - {d * q} = {r}, which is less than {d}. "
                   f"So {n} = {d} * {q} + {r}.", f"quotient {q}, remainder {r}")


def _gcd(rng: random.Random) -> Problem:
    g = rng.randint(2, 30)
    a, b = g * rng.randint(2, 60), g * rng.randint(2, 60)
    a, b = max(a, b), min(a, b)
    steps, x, y = [], a, b
    while y:
        steps.append(f"{x} = {y} * {x // y} + {x % y}")
        x, y = y, x % y
    return Problem("gcd", f"Find the greatest common divisor of {a} and {b}.",
                   "Euclid's algorithm: " + "; ".join(steps) + f". The last nonzero remainder is {x}.",
                   str(x))


def _fractions(rng: random.Random) -> Problem:
    a, b = rng.randint(1, 11), rng.randint(2, 12)
    c, d = rng.randint(1, 11), rng.randint(2, 12)
    lcm = b * d // math.gcd(b, d)
    na, nc = a * lcm // b, c * lcm // d
    total = Fraction(a, b) + Fraction(c, d)
    simplified = (f" = {total.numerator}/{total.denominator}" if total.denominator != lcm else "")
    return Problem("fractions", f"Add {a}/{b} + {c}/{d}.",
                   f"The common denominator is lcm({b}, {d}) = {lcm}: {a}/{b} = {na}/{lcm} and "
                   f"{c}/{d} = {nc}/{lcm}. Sum: {na + nc}/{lcm}{simplified}.",
                   f"{total.numerator}/{total.denominator}")


def _percent(rng: random.Random) -> Problem:
    p, base = rng.choice([5, 10, 12, 15, 20, 25, 30, 35, 40, 45, 50, 60, 75, 80]), rng.randint(2, 80) * 20
    value = Fraction(p * base, 100)
    answer = str(value.numerator) if value.denominator == 1 else f"{float(value):g}"
    return Problem("percent", f"What is {p}% of {base}?",
                   f"{p}% of {base} = {base} * {p} / 100 = {p * base} / 100 = {answer}.", answer)


def _linear_equation(rng: random.Random) -> Problem:
    x = rng.randint(-12, 12)
    a, c = rng.sample([k for k in range(-9, 10) if k != 0], 2)
    b = rng.randint(-20, 20)
    d = a * x + b - c * x
    move = f"Subtract {c}x from" if c > 0 else f"Add {-c}x to"
    steps = [f"{move} both sides: {a - c}x {_signed(b)} = {d}",
             f"{'Subtract' if b >= 0 else 'Add'} {abs(b)}: {a - c}x = {d - b}",
             f"Divide by {a - c}: x = {x}"]
    return Problem("linear_equation", f"Solve {a}x {_signed(b)} = {c}x {_signed(d)}.",
                   ". ".join(steps) + f". Check: {a}*({x}) {_signed(b)} = {a * x + b} and "
                   f"{c}*({x}) {_signed(d)} = {c * x + d}.", f"x = {x}")


def _linear_system(rng: random.Random) -> Problem:
    x, y = rng.randint(-9, 9), rng.randint(-9, 9)
    while True:
        a, b, c, d = (rng.randint(1, 7) for _ in range(4))
        if a * d - b * c != 0:
            break
    e, f = a * x + b * y, c * x + d * y
    det = a * d - b * c
    return Problem(
        "linear_system", f"Solve the system {a}x + {b}y = {e} and {c}x + {d}y = {f}.",
        f"Multiply the first equation by {d} and the second by {b}: {a * d}x + {b * d}y = {e * d} and "
        f"{b * c}x + {b * d}y = {f * b}. Subtract: {det}x = {e * d - f * b}, so x = {x}. "
        f"Substitute into the first equation: {b}y = {e} - {a}*({x}) = {e - a * x}, so y = {y}.",
        f"x = {x}, y = {y}")


def _quadratic(rng: random.Random) -> Problem:
    r1, r2 = sorted((rng.randint(-12, 12), rng.randint(-12, 12)))
    s, p = r1 + r2, r1 * r2
    factors = " ".join(f"(x {_signed(-r)})" for r in (r1, r2))
    roots = f"x = {r1}" if r1 == r2 else f"x = {r1} or x = {r2}"
    return Problem("quadratic", f"Solve x^2 {_signed(-s)}x {_signed(p)} = 0.",
                   f"Look for two numbers whose product is {p} and whose sum is {s}: {r1} and {r2}. "
                   f"So the equation factors as {factors} = 0.", roots)


def _polynomial(rng: random.Random) -> Problem:
    coeffs = [rng.randint(-5, 5) for _ in range(4)]
    coeffs[0] = coeffs[0] or 1
    x = rng.randint(-4, 4)
    terms = [(c, 3 - i) for i, c in enumerate(coeffs) if c]
    poly = " ".join((f"{c}" if j == 0 else _signed(c)) + ("x^%d" % k if k > 1 else "x" if k else "")
                    for j, (c, k) in enumerate(terms))
    values = [c * x ** k for c, k in terms]
    steps = ", ".join(f"{c}*({x})^{k} = {v}" for (c, k), v in zip(terms, values))
    return Problem("polynomial", f"Evaluate p(x) = {poly} at x = {x}.",
                   f"{steps}. Sum: {' + '.join(f'({v})' for v in values)} = {sum(values)}.",
                   str(sum(values)))


def _expression(rng: random.Random) -> Problem:
    a, b, c, d = (rng.randint(2, 20) for _ in range(4))
    first, second = b * c, (a + d) * 2
    value = a + first - second
    return Problem("order_of_operations", f"Evaluate {a} + {b} * {c} - ({a} + {d}) * 2.",
                   f"Parentheses first: {a} + {d} = {a + d}. Then the products: {b} * {c} = {first} and "
                   f"{a + d} * 2 = {second}. Finally left to right: {a} + {first} - {second} = {value}.",
                   str(value))


GENERATORS = (_addition, _subtraction, _multiplication, _division, _gcd, _fractions, _percent,
              _linear_equation, _linear_system, _quadratic, _polynomial, _expression)


def generate_problem(index: int, seed: int = 0) -> Problem:
    """Problem number `index` of the stream for `seed` (its kind cycles through GENERATORS)."""
    rng = random.Random(seed * 1_000_003 + index)
    return GENERATORS[index % len(GENERATORS)](rng)


def generate_problems(num: int, seed: int = 0) -> list[Problem]:
    """The first `num` problems of the stream for `seed`."""
    return [generate_problem(i, seed) for i in range(num)]


def generate_documents(num_docs: int, seed: int = 0, problems_per_doc: int = 3) -> list[str]:
    """`num_docs` documents of `problems_per_doc` consecutive problems each (a small worksheet)."""
    return ["\n".join(generate_problem(d * problems_per_doc + k, seed).text()
                      for k in range(problems_per_doc)) for d in range(num_docs)]
