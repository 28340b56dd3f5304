"""Golden PartitionSpecs of every ZAYA1-base parameter (and its ZeRO-1 optimizer-state spec).

An accidental sharding change shows up here, in review. After an intended change, regenerate:
  python tests/test_sharding_golden.py > tests/golden/zaya1_base_specs.json
"""

import json
import pathlib
import sys

from flax import nnx

from zaya_jax.config_files import load_config_file, model_config
from zaya_jax.model.build import abstract_model
from zaya_jax.parallel.rules import state_specs, with_zero1_axes

GOLDEN = pathlib.Path(__file__).parent / "golden" / "zaya1_base_specs.json"
MESH = {"data": 64, "fsdp": 8, "expert": 2, "tensor": 1, "context": 1}  # 1,024 devices


def spec_table() -> dict:
    model = abstract_model(model_config(load_config_file("configs/zaya1_base.py")))
    state = nnx.state(model)
    specs = state_specs(state, MESH)
    table = {}
    for (path, spec), (_, var) in zip(nnx.to_flat_state(specs), nnx.to_flat_state(state)):
        spec = spec.get_value()
        table["/".join(map(str, path))] = {"shape": list(var.shape), "spec": str(spec),
                                           "optimizer_spec": str(with_zero1_axes(spec, var.shape, MESH))}
    return {"mesh": MESH, "params": table}


def test_specs_match_golden():
    golden = json.loads(GOLDEN.read_text())
    current = spec_table()
    assert current["mesh"] == golden["mesh"]
    changed = {k: (golden["params"].get(k), v) for k, v in current["params"].items() if golden["params"].get(k) != v}
    removed = sorted(set(golden["params"]) - set(current["params"]))
    assert not changed and not removed, f"sharding changed: {changed or removed}"


if __name__ == "__main__":
    json.dump(spec_table(), sys.stdout, indent=1, sort_keys=True)
    print()
