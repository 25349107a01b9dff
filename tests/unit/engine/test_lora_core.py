"""SGLang's LoRA rules as the CPU engine keeps them (services/engine/core/lora.py), pure."""

from __future__ import annotations

import pytest

from services.engine.core.lora import (
    AdapterConfig,
    AdapterRef,
    LoraError,
    LoraLimits,
    batch_fits,
    keys_repr,
    normalized_targets,
    validate_new_adapter,
)
from services.engine_api.sglang_launcher import EngineLoraSettings, LoraServing

LIMITS = LoraLimits(8, frozenset(normalized_targets(["q_proj", "v_proj", "o_proj"])), 3)


def config(
    r: int = 4, targets: tuple[str, ...] = ("q_proj", "v_proj"), **kw: object
) -> AdapterConfig:
    return AdapterConfig.from_json(
        {"r": r, "lora_alpha": 16, "target_modules": list(targets), **kw}
    )


def test_targets_normalize_as_sglangs_memory_pool_does() -> None:
    assert normalized_targets(["q_proj", "k_proj", "model.layers.0.mlp.up_proj"]) == {
        "qkv_proj", "gate_up_proj",
    }  # fmt: skip
    assert normalized_targets("all-linear") == {"all"}
    with pytest.raises(LoraError, match="Only 'all' or 'all-linear'"):
        normalized_targets("q_proj")
    # k_proj is served as qkv_proj: an engine started for q_proj takes it (SGLang does).
    assert LIMITS.can_support(config(targets=("k_proj",)))
    assert not LIMITS.can_support(config(targets=("down_proj",)))
    assert not LIMITS.can_support(config(r=16))


def test_scaling_is_alpha_over_rank_even_with_rslora() -> None:
    assert config(r=4).scaling == 4.0
    assert config(r=4, use_rslora=True).scaling == 4.0  # SGLang's LoRAAdapter ignores it


@pytest.mark.parametrize(
    ("cfg", "ref", "message"),
    [
        (config(use_dora=True), AdapterRef("d", "/d"), "doesn't support DoRA adapters"),
        (config(), AdapterRef("v1", "/x"), "Failed to load LoRA adapter v1 because it is already"),
        (config(r=9), AdapterRef("big", "/b"), "LoRA adapter big with rank 9 is incompatible"),
        (config(), AdapterRef("p", "/p", pinned=True), "as a pinned adapter"),
    ],
)
def test_new_adapters_are_refused_with_sglangs_words(
    cfg: AdapterConfig, ref: AdapterRef, message: str
) -> None:
    loaded = [AdapterRef("v1", "/v1", pinned=True), AdapterRef("v2", "/v2", pinned=True)]
    with pytest.raises(LoraError, match=message):
        validate_new_adapter(cfg, ref, loaded, LIMITS, pinned_count=2)
    validate_new_adapter(config(), AdapterRef("ok", "/ok"), loaded, LIMITS, pinned_count=2)


def test_a_batch_holds_max_loras_per_batch_kinds_the_base_counting() -> None:
    assert batch_fits({None, "a", "b"}, set(), 3)
    assert not batch_fits({None, "a", "b", "c"}, set(), 3)
    # One pinned adapter keeps a slot: two unpinned kinds (base included) fit beside it.
    assert batch_fits({None, "a", "p"}, {"p"}, 3)
    assert not batch_fits({None, "a", "b"}, {"p"}, 3)


def test_keys_print_as_python_does() -> None:
    assert keys_repr(["a", "b"]) == "odict_keys(['a', 'b'])"
    assert keys_repr([], "dict_keys") == "dict_keys([])"


def test_run_file_keys_become_sglangs_flags() -> None:
    doc = {"engine": {"enable_lora": True, "max_lora_rank": 16, "port": 1,
                      "lora_target_modules": ["q_proj", "v_proj"]}}  # fmt: skip
    lora = EngineLoraSettings.from_run_file(doc).lora
    assert lora == LoraServing(16, ("q_proj", "v_proj"), 8)
    assert lora.flags() == ["--enable-lora", "--max-lora-rank", "16", "--lora-target-modules",
                            "q_proj", "v_proj", "--max-loras-per-batch", "8"]  # fmt: skip
    assert EngineLoraSettings.from_run_file({}).lora is None
    with pytest.raises(ValueError, match="enable_lora needs max_lora_rank"):
        EngineLoraSettings.from_run_file({"engine": {"enable_lora": True}})


def test_the_cpu_engine_takes_sglangs_lora_flags() -> None:
    from services.engine.cli import parser, settings_from

    argv = ["--model", "/m", "--enable-lora", "--max-lora-rank", "8",
            "--lora-target-modules", "q_proj", "v_proj", "--max-loras-per-batch", "2"]  # fmt: skip
    assert settings_from(parser().parse_args(argv)).lora == LoraServing(8, ("q_proj", "v_proj"), 2)
    assert settings_from(parser().parse_args(["--model", "/m"])).lora is None
