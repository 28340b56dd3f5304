"""Every field of transformers' ZAYA config classes is read as transformers computes it, or refused by name.

The reference's fields come from the classes themselves (transformers 5.25's `ZayaConfig`, its
`RopeParameters` keys; zaya1_vl's classes where the installed transformers has them, else the
fields of the main branch at b53060f, where they were read): a field transformers adds later
fails here until zaya_jax.checkpoints.hf_config.ZAYA_FIELDS (or hf_vl's tables) says how it is taken.
Then, without torch: every field a table fixes, given another value, and every RoPE setting
transformers would compute differently, ends in one error line naming it, before anything is built.
"""

import dataclasses
import importlib.util

import pytest

from zaya_jax.config import ROPE_TYPE_KEYS, RopeScaling
from zaya_jax.checkpoints.hf_config import PRETRAINED_FIELDS, ZAYA_FIELDS, model_config_from_hf
from zaya_jax.checkpoints.hf_vl import ZAYA1_VL_FIELDS, ZAYA1_VL_TEXT_FIELDS, ZAYA1_VL_VISION_FIELDS, vl_configs_from_hf
from zaya_jax.errors import UserError

# huggingface/transformers main at b53060f, models/zaya1_vl/configuration_zaya1_vl.py (5.25 has no zaya1_vl):
# each class's own fields, beside PreTrainedConfig's (ZAYA's text fields plus the vision LoRA's)
ZAYA1_VL_AT_B53060F = {
    "Zaya1VLConfig": {"text_config", "vision_config", "image_token_id", "vision_start_token_id",
                      "vision_end_token_id", "tie_word_embeddings", "output_router_logits"},
    "Zaya1VLTextConfig": "ZayaConfig + vision_lora, vision_lora_rank_attn, vision_lora_rank_mlp",
    "Zaya1VLVisionConfig": {"depth", "hidden_size", "hidden_act", "intermediate_size", "num_heads", "in_channels",
                            "patch_size", "spatial_merge_size", "temporal_patch_size", "tokens_per_second",
                            "window_size", "out_hidden_size", "fullatt_block_indexes", "initializer_range"},
}
ROPE_ENTRY_KEYS = {"rope_type", "rope_theta", "partial_rotary_factor"}  # read for every type


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _zaya1_vl_fields() -> dict[str, set[str]]:
    from transformers import PreTrainedConfig, ZayaConfig

    if importlib.util.find_spec("transformers.models.zaya1_vl") is not None:
        from transformers.models.zaya1_vl import configuration_zaya1_vl as reference
        return {name: _fields(getattr(reference, name)) for name in ZAYA1_VL_AT_B53060F}
    base = _fields(PreTrainedConfig)
    return {"Zaya1VLConfig": base | ZAYA1_VL_AT_B53060F["Zaya1VLConfig"],
            "Zaya1VLTextConfig": _fields(ZayaConfig) | {"vision_lora", "vision_lora_rank_attn", "vision_lora_rank_mlp"},
            "Zaya1VLVisionConfig": base | ZAYA1_VL_AT_B53060F["Zaya1VLVisionConfig"]}


@pytest.mark.torch_reference
def test_every_reference_field_has_a_rule():
    from transformers import PreTrainedConfig, ZayaConfig

    assert set(PRETRAINED_FIELDS) == _fields(PreTrainedConfig)
    assert set(ZAYA_FIELDS) == _fields(ZayaConfig)
    vl = _zaya1_vl_fields()
    for name, table in (("Zaya1VLConfig", ZAYA1_VL_FIELDS), ("Zaya1VLTextConfig", ZAYA1_VL_TEXT_FIELDS),
                        ("Zaya1VLVisionConfig", ZAYA1_VL_VISION_FIELDS)):
        assert set(table) == vl[name], name
    for table in (ZAYA_FIELDS, ZAYA1_VL_FIELDS, ZAYA1_VL_TEXT_FIELDS, ZAYA1_VL_VISION_FIELDS):
        assert {rule.kind for rule in table.values()} <= {"read", "fixed", "inert"}


@pytest.mark.torch_reference
def test_every_rope_parameters_key_is_read_or_refused():
    """transformers' RopeParameters keys: each type reads those ROPE_TYPE_KEYS lists (and computes them:
    test_rope_scaling, test_hf_rope_parity); any other, in an entry of that type, is refused naming it."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, RopeParameters

    read = ROPE_ENTRY_KEYS | {key for keys in ROPE_TYPE_KEYS.values() for key in keys}
    assert read <= set(RopeParameters.__annotations__)
    assert set(ROPE_TYPE_KEYS) <= set(ROPE_INIT_FUNCTIONS) | {"default"}
    assert_unread_keys_refused(set(RopeParameters.__annotations__))


TEXT = dict(model_type="zaya", vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_experts=4, moe_intermediate_size=16, router_hidden_size=8,
            max_position_embeddings=16, eos_token_id=1,
            rope_parameters={"hybrid": {"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.5}})
VISION = dict(model_type="zaya1_vl_vision", depth=2, hidden_size=32, intermediate_size=40, num_heads=4,
              in_channels=3, patch_size=4, temporal_patch_size=1, spatial_merge_size=2, window_size=16,
              out_hidden_size=32, fullatt_block_indexes=[1])


def _vl(text=None, vision=None, **top) -> dict:
    return {"model_type": "zaya1_vl", "text_config": {**TEXT, "model_type": "zaya1_vl_text", **(text or {})},
            "vision_config": {**VISION, **(vision or {})}, **top}


def _other_value(allowed: tuple):
    return {bool: lambda: not allowed[0], int: lambda: allowed[0] + 1, str: lambda: "gelu"}.get(
        type(allowed[0]), lambda: 0.1)()


def _fixed(table):
    return [(key, rule.detail) for key, rule in table.items() if rule.kind == "fixed"]


def _refused(load, config: dict, named: str) -> str:
    with pytest.raises(UserError) as err:
        load(config)
    message = str(err.value)
    assert "\n" not in message and named in message, message
    return message


@pytest.mark.parametrize("key,allowed", _fixed(ZAYA_FIELDS), ids=[k for k, _ in _fixed(ZAYA_FIELDS)])
def test_a_fixed_zaya_field_with_another_value_is_refused(key, allowed):
    assert model_config_from_hf({**TEXT, key: allowed[0]})[0] == model_config_from_hf(TEXT)[0]
    _refused(model_config_from_hf, {**TEXT, key: _other_value(allowed)}, f"config.json: {key}=")


VL_FIXED = ([("", k, a) for k, a in _fixed(ZAYA1_VL_FIELDS)] + [("text_config.", k, a) for k, a in
                                                                 _fixed(ZAYA1_VL_TEXT_FIELDS)]
            + [("vision_config.", k, a) for k, a in _fixed(ZAYA1_VL_VISION_FIELDS)])


@pytest.mark.parametrize("where,key,allowed", VL_FIXED, ids=[w + k for w, k, _ in VL_FIXED])
def test_a_fixed_zaya1_vl_field_with_another_value_is_refused(where, key, allowed):
    place = {"": "top", "text_config.": "text", "vision_config.": "vision"}[where]
    config = lambda value: _vl(**({place: {key: value}} if place != "top" else {key: value}))  # noqa: E731
    vl_configs_from_hf(config(allowed[0]))
    _refused(vl_configs_from_hf, config(_other_value(allowed)), f"config.json: {where}{key}=")


def _with_rope(hybrid: dict | None = None, **top) -> dict:
    entry = {"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.5, **(hybrid or {})}
    return {**TEXT, "rope_parameters": {"hybrid": entry, **top}}


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
# the keys each type needs (transformers' required ones), valid for a 16-wide head of 8 rotary dims
NEEDED = {"default": {}, "linear": {"factor": 2.0}, "dynamic": {"factor": 2.0}, "yarn": YARN,
          "longrope": {"short_factor": [1.0] * 4, "long_factor": [2.0] * 4, "original_max_position_embeddings": 8},
          "llama3": {"factor": 2.0, "original_max_position_embeddings": 8, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0}}


ROPE_REFUSALS = {
    "proportional": (_with_rope({"rope_type": "proportional"}), "rope_parameters.hybrid.rope_type='proportional'"),
    "an unknown type": (_with_rope({"rope_type": "ntk"}), "rope_parameters.hybrid.rope_type='ntk'"),
    "a factor with the default type": (_with_rope({"factor": 4.0}), "rope_parameters.hybrid.factor=4.0"),
    "mrope_section": (_with_rope({"mrope_section": [2, 2]}), "rope_parameters.hybrid.mrope_section"),
    "yarn without its original context": (_with_rope({"rope_type": "yarn", "factor": 4.0}),
                                          "rope_parameters.hybrid.original_max_position_embeddings is missing"),
    "linear with a null factor": (_with_rope({"rope_type": "linear", "factor": None}), "hybrid.factor is null"),
    "a zero factor": (_with_rope({"rope_type": "linear", "factor": 0}), "rope_parameters.hybrid.factor=0"),
    "no rope_theta": ({**TEXT, "rope_parameters": {"hybrid": {"rope_type": "default"}}},
                      "hybrid.rope_theta is missing"),
    "an entry's own truncate": (_with_rope({**YARN, "truncate": False}), "rope_parameters.hybrid.truncate=False"),
    "a scaled top-level rope_type": (_with_rope(rope_type="yarn"), "rope_parameters.rope_type='yarn'"),
    "a top-level factor": (_with_rope(factor=2.0), "rope_parameters.factor"),
    "the old name rope_scaling": ({**_with_rope(), "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
                                  "config.json: rope_scaling"),
    "no entry for sliding layers": ({**_with_rope(), "layer_types": ["hybrid_sliding", "hybrid"], "sliding_window": 4},
                                    "rope_parameters.hybrid_sliding is missing"),
    "longrope factors of another length": (_with_rope({**NEEDED["longrope"], "rope_type": "longrope",
                                                       "short_factor": [1.0]}),
                                           "rope_parameters.hybrid.short_factor must list 4"),
    "gelu experts": ({**_with_rope(), "hidden_act": "gelu_pytorch_tanh"},
                     "config.json: hidden_act='gelu_pytorch_tanh'"),
    "several eos ids": ({**_with_rope(), "eos_token_id": [1, 5]}, "config.json: eos_token_id=[1, 5]"),
    "a null pad id": ({**_with_rope(), "pad_token_id": None}, "config.json: pad_token_id=None"),
}


@pytest.mark.parametrize("case", ROPE_REFUSALS)
def test_a_setting_transformers_computes_otherwise_is_refused(case):
    config, named = ROPE_REFUSALS[case]
    _refused(model_config_from_hf, config, named)


def assert_unread_keys_refused(keys: set[str]) -> None:
    """Each type, given each key of `keys` it does not read (transformers ignores it there): refused."""
    for kind, reads in ROPE_TYPE_KEYS.items():
        model_config_from_hf(_with_rope({**NEEDED[kind], "rope_type": kind}))
        for key in sorted(keys - ROPE_ENTRY_KEYS - set(reads)):
            _refused(model_config_from_hf, _with_rope({**NEEDED[kind], "rope_type": kind, key: 3}),
                     f"rope_parameters.hybrid.{key}=3 is not read with rope_type {kind!r}")


def test_an_unread_rope_key_is_refused():
    assert_unread_keys_refused(set(RopeScaling.defaults()) | {"mrope_section"})


def test_the_vl_config_refuses_in_its_own_places():
    _refused(vl_configs_from_hf, _vl(tie_word_embeddings=False), "config.json: tie_word_embeddings=False")
    _refused(vl_configs_from_hf, _vl(text={"rope_parameters": {"hybrid": {"rope_type": "yarn", "factor": 4.0,
                                                                          "rope_theta": 1e4}}}),
             "config.json: text_config.rope_parameters.hybrid.original_max_position_embeddings")
    _refused(vl_configs_from_hf, _vl(vision={"rope_parameters": {"rope_theta": 500.0}}),
             "config.json: vision_config.rope_parameters.rope_theta=500.0")
    text, _, _ = vl_configs_from_hf(_vl(text={"rope_parameters": {"hybrid": {**YARN, "rope_theta": 1e4}}}))
    assert text.rope_scaling == RopeScaling(**YARN)


def test_what_transformers_derives_is_derived():
    """rope_parameters absent: ZayaConfig's defaults; partial_rotary_factor absent from an entry: the whole
    head (transformers' default 1.0); null factor / attention factor: derived; null or 0 betas: 32 and 1."""
    absent = {k: v for k, v in TEXT.items() if k != "rope_parameters"}
    cfg, _ = model_config_from_hf(absent)
    assert (cfg.rope_theta, cfg.sliding_rope_theta, cfg.partial_rotary_factor) == (5e6, 1e4, 0.5)
    cfg, _ = model_config_from_hf({**TEXT, "rope_parameters": {"hybrid": {"rope_type": "default", "rope_theta": 1e4}}})
    assert cfg.rotary_dim == cfg.head_dim
    cfg, _ = model_config_from_hf(_with_rope({**YARN, "factor": None, "attention_factor": None, "beta_fast": 0,
                                              "beta_slow": None}, truncate=False))
    assert cfg.rope_scaling == RopeScaling(rope_type="yarn", factor=0.0, original_max_position_embeddings=8,
                                           truncate=False)


def test_what_a_schema_cannot_carry_is_refused_on_export(tmp_path):
    """Zyphra's original schema has no RoPE scaling (its reader refuses a set one, the export check a
    scaled model); transformers reads one yarn truncate for both layer types."""
    from tests.model_fixtures import tiny_model
    from zaya_jax.config import ConfigError
    from zaya_jax.checkpoints.export_check import ExportMismatch
    from zaya_jax.checkpoints.hf_config import hf_config_from_model
    from zaya_jax.checkpoints.hf_rope import rope_parameters_to_hf
    from zaya_jax.checkpoints.hf_save import save_hf

    model = tiny_model(rope_scaling=RopeScaling(rope_type="linear", factor=2.0))
    original = hf_config_from_model(model.config, "original")
    _refused(model_config_from_hf, {**original, "rope_scaling": {"type": "linear", "factor": 2.0}},
             "config.json: rope_scaling=")
    with pytest.raises(ExportMismatch, match="model.rope_scaling=RopeScaling"):
        save_hf(model, tmp_path / "original", schema="original")
    assert not (tmp_path / "original").exists()
    yarn = RopeScaling(**YARN)
    both = model.config.replace(rope_scaling=yarn, sliding_rope_scaling=dataclasses.replace(yarn, truncate=False))
    with pytest.raises(ConfigError, match="truncate differ"):
        rope_parameters_to_hf(both)
