"""The decoder layer is written once (DecoderLayer.step): no module of zaya_jax outside model/ drives a
layer's attention, MoE, norms or residuals itself. Read from the sources' syntax trees."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "zaya_jax"
# attributes only a layer's own step touches
LAYER_PARTS = {"input_norm", "post_attention_norm", "attention_residual", "moe_residual"}
ATTENTION_HALVES = {"qkv", "output"}  # CCA's, on `<layer>.attention`


def layer_part_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """-> (line, what) for each `.input_norm`-like attribute, `.attention.qkv` / `.attention.output`,
    and each call of `.moe(...)` or a method of `.moe.` (`.moe.gathered(...)`)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if node.attr in LAYER_PARTS:
                found.append((node.lineno, f".{node.attr}"))
            elif (node.attr in ATTENTION_HALVES and isinstance(node.value, ast.Attribute)
                  and node.value.attr == "attention"):
                found.append((node.lineno, f".attention.{node.attr}"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            func = node.func
            if func.attr == "moe" or (isinstance(func.value, ast.Attribute) and func.value.attr == "moe"):
                found.append((node.lineno, f"{ast.unparse(func)}(...)"))
    return found


def test_the_scan_finds_each_kind_of_reach_in():
    source = """
def body(layer, x, s, m, d):
    x = layer.input_norm(x, d)
    q, k, v, c = layer.attention.qkv(x, 0, 0, m)
    x = layer.attention_residual(layer.attention.output(q), x, d)
    y, s, _ = layer.moe(layer.post_attention_norm(x, d), s, m, d)
    y, s, _ = layer.moe.gathered(x, s, m, d)
    return layer.moe_residual(y, x, d)
"""
    assert sorted(what for _, what in layer_part_uses(ast.parse(source))) == sorted([
        ".input_norm", ".attention.qkv", ".attention_residual", ".attention.output", "layer.moe(...)",
        ".post_attention_norm", "layer.moe.gathered(...)", ".moe_residual"])
    # reading a layer's weights (quantization, export) is not driving it
    assert layer_part_uses(ast.parse("w = model.layers.moe.router.balancing_biases[...]\n"
                                     "g = model.layers.moe.gate.get_value()\nlayer.step(groups)\n")) == []


def test_no_module_outside_model_drives_a_layer_body():
    model = PACKAGE / "model"
    uses = [f"{path.relative_to(PACKAGE.parent)}:{line}: {what}"
            for path in sorted(PACKAGE.rglob("*.py")) if model not in path.parents
            for line, what in layer_part_uses(ast.parse(path.read_text()))]
    assert not uses, uses
