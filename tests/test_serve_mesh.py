"""`python -m zaya_jax.serve --mesh data=4,tensor=2` on 8 fake devices, through OpenAI's client:
the same tokens and log-probs as `zaya_jax.generate` on one device (tests/test_serve.py's tiny
checkpoint and reference), the devices said on stderr; a mesh the model cannot split is one error
line naming the --mesh that would."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

from tests import test_serve
from tests.test_serve import CHUNK, KEY, completion, prompt_ids
from tests.train_helpers import REPO, cli_env

pytestmark = pytest.mark.xdist_group("serve")

openai = pytest.importorskip("openai")

LAYOUT, SLOTS = "data=4,tensor=2", 4
# test_serve's fixtures: its tiny checkpoint, generate's answer on one device, the tokenizer
checkpoint, reference, tokenizer = test_serve.checkpoint, test_serve.reference, test_serve.tokenizer


def serve(checkpoint, *flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "zaya_jax.serve", "--checkpoint", str(checkpoint), "--port", "0",
                             "--api_key", KEY, "--chunk", str(CHUNK), "--max_top_logprobs", "1", *flags],
                            cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_sharded_server_answers_what_generate_answers(checkpoint, reference, tokenizer):
    proc = serve(checkpoint, "--mesh", LAYOUT, "--slots", str(SLOTS))
    try:
        line = proc.stdout.readline()
        found = re.match(r"serving (http://127\.0\.0\.1:\d+/v1) \(model tiny, 4 slots", line)
        assert found, f"no serving line: {line!r}\n{proc.stderr.read()[-3000:] if proc.poll() is not None else ''}"
        client = openai.OpenAI(base_url=found.group(1), api_key=KEY, max_retries=0, timeout=120)
        for ids, max_tokens, stream in [(prompt_ids(20, 4), 12, False), (prompt_ids(5, 6), 8, True)]:
            tokens, logprobs, _ = completion(client, ids, max_tokens, stream=stream)
            expected, expected_logprobs = reference(ids, max_tokens)
            assert tokens == [tokenizer.decode([t], skip_special=False) for t in expected]
            np.testing.assert_allclose(logprobs, expected_logprobs, atol=2e-4)
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=60)
    assert f"serving on 8 devices (cpu cpu), mesh {LAYOUT}" in stderr


def test_a_mesh_the_model_cannot_split_is_one_error_line(checkpoint):
    proc = serve(checkpoint, "--mesh", "data=2,tensor=4")
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "Traceback" not in stderr
    assert "--mesh data=2,tensor=4: tensor=4 does not divide" in stderr and "fix: --mesh data=2,tensor=2" in stderr


def test_a_mesh_of_the_wrong_size_is_advised_in_serves_own_flag(checkpoint):
    """tensor=3 on 8 devices: the advice is serve's `--mesh data=-1`, not the trainer's --config.mesh."""
    proc = serve(checkpoint, "--mesh", "tensor=3")
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "Traceback" not in stderr
    assert "!= 8 devices" in stderr and "(e.g. --mesh data=-1)" in stderr and "--config.mesh" not in stderr
