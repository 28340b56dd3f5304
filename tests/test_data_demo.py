"""The bundled demo corpus (built small, in a temp cache) and its generated math problems."""

import re
from fractions import Fraction

import pytest

from zaya_jax.data import build_eval_batches, build_pipeline, demo_corpus, demo_data_config, math_problems
from zaya_jax.data.sources import tokenizer_path
from zaya_jax.data.tokenizer import Tokenizer


def test_demo_corpus_builds_and_feeds_the_pipeline(tmp_path, monkeypatch):
    monkeypatch.setenv("ZAYA_JAX_CACHE", str(tmp_path))
    config = demo_data_config()
    config.demo.max_docs = 40
    pipeline = build_pipeline(config)
    batch = next(pipeline)
    assert pipeline.phase.name == "prose_heavy" and pipeline.phase.rope_theta == 1e4
    assert batch["inputs"].shape == (16, 128) and batch["loss_mask"].mean() > 0.8
    assert 0 <= batch["inputs"].min() and batch["inputs"].max() < pipeline.vocab_size == 4096

    root = tmp_path / "demo_corpus"
    built = [p for p in root.iterdir() if not p.name.startswith(".")]
    assert len(built) == 1 and "docs40-vocab4096-seed0" in built[0].name
    tok = Tokenizer(tokenizer_path(config), bos_id=2, eos_id=1, pad_id=0)
    assert tok.vocab_size == 4096
    text = tok.decode(batch["inputs"][0][batch["segment_ids"][0] == 1])
    assert len(text) > 20

    evals = build_eval_batches(config, max_batches=1)
    assert sorted(evals) == ["code", "math", "prose"]
    assert all(len(b) == 1 and b[0]["inputs"].shape == (8, 256) for b in evals.values())
    # a second build is a cache hit
    assert demo_corpus.build_demo_corpus(max_docs=40, progress=False).root == built[0]


def test_demo_curriculum_changes_mixture_and_length():
    phases = demo_data_config().phases
    assert [p.seq_len for p in phases] == [128, 128, 256]
    assert phases[2].rope_theta > phases[1].rope_theta
    assert max(phases[0].weights, key=phases[0].weights.get) == "prose"
    assert phases[1].weights["prose"] < min(phases[1].weights["code"], phases[1].weights["math"])


def test_prose_is_markdown_free():
    docs = demo_corpus.prose_documents()
    assert len(docs) > 700
    assert not any(re.search(r"\*\*|^#|\\\[", d, re.M) for d in docs)


def test_math_problems_are_deterministic_and_correct():
    first = math_problems.generate_problems(240, seed=7)
    assert first == math_problems.generate_problems(240, seed=7)
    assert first != math_problems.generate_problems(240, seed=8)
    assert len({p.kind for p in first}) == len(math_problems.GENERATORS)
    for p in first:
        numbers = [int(n) for n in re.findall(r"-?\d+", p.question)]
        if p.kind in ("addition", "subtraction", "multiplication"):
            a, b = numbers
            assert int(p.answer) == {"addition": a + b, "subtraction": a - b, "multiplication": a * b}[p.kind]
        elif p.kind == "division":
            n, d = numbers
            assert p.answer == f"quotient {n // d}, remainder {n % d}"
        elif p.kind == "fractions":
            a, b, c, d = numbers
            assert Fraction(p.answer) == Fraction(a, b) + Fraction(c, d)
        elif p.kind == "linear_equation":
            a, b, c, d = [int(x.replace(" ", "")) for x in re.findall(r"-?\d+|[+-] \d+", p.question)]
            x = int(p.answer.split("=")[1])
            assert a * x + b == c * x + d
        elif p.kind == "quadratic":
            s, q = [int(x.replace(" ", "")) for x in re.findall(r"[+-] \d+", p.question)]
            roots = [int(r) for r in re.findall(r"-?\d+", p.answer)]
            assert all(r * r + s * r + q == 0 for r in roots)
    assert math_problems.generate_documents(2, seed=7)[1].count("Problem:") == 3


def test_unknown_demo_source_fails_before_building(tmp_path):
    config = demo_data_config()
    config.demo.cache_dir = str(tmp_path)
    config.sources.prose = "demo:poetry"
    with pytest.raises(ValueError, match="data.sources.prose: unknown demo source 'demo:poetry'"):
        build_pipeline(config)
    assert not list(tmp_path.iterdir())
