"""The rules of LoRA versions that need no model: settings, names, what travels how."""

import json

import pytest
from pydantic import ValidationError

from proto.messages import WeightsPublished
from proto.weight_version import adapter_name, parse_adapter_name
from services.engine_api.engine_client import GenerateResult
from services.rollout.core import adapter_made, sample_versions
from services.trainer.settings import ModelConfig, TrainConfig, TrainerSettings
from services.weights.adapter import AdapterError, LoraSettings, module_of, parse_config
from services.weights.adapter_load import adapter_versions

TASK = {"source": {"type": "arithmetic"}}


def test_adapter_names_are_version_directory_names():
    assert adapter_name(12) == "v000012" and parse_adapter_name("v000012") == 12
    assert parse_adapter_name("v12") is None and parse_adapter_name("mine") is None


@pytest.mark.parametrize("transport", ["nats-delta", "disk-delta", "distributed"])
def test_adapters_refuse_deltas_and_the_distributed_transport(transport):
    with pytest.raises(ValidationError, match=r"with \[trainer.lora\]"):
        TrainerSettings(task=TASK, weights_transport=transport, lora=LoraSettings())
    TrainerSettings(task=TASK, weights_transport=transport)  # full fine-tuning: fine


def test_settings_refuse_what_would_train_silently_wrong():
    with pytest.raises(ValidationError, match="heads"):
        LoraSettings(target_modules=("q_proj", "lm_head"))
    with pytest.raises(ValidationError, match="logprobs = 'full'"):
        TrainConfig(
            model=ModelConfig(logprobs="chunked"),
            lora=LoraSettings(dropout=0.1, heads=("lm_head",)),
        )
    TrainConfig(model=ModelConfig(logprobs="full"), lora=LoraSettings(dropout=0.1))


def test_peft_config_documents_parse_and_bad_ones_name_the_problem(tmp_path):
    doc = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["v_proj", "q_proj"],
           "base_model_name_or_path": "/m"}  # fmt: skip
    cfg = parse_config(doc, tmp_path)
    assert (cfg.rank, cfg.scaling, cfg.target_modules) == (8, 2.0, ("q_proj", "v_proj"))
    with pytest.raises(AdapterError, match="not LORA"):
        parse_config({**doc, "peft_type": "IA3"}, tmp_path)
    with pytest.raises(AdapterError, match="'r'"):
        parse_config({k: v for k, v in doc.items() if k != "r"}, tmp_path)
    assert json.dumps(doc)  # a plain document
    assert module_of("base_model.model.model.layers.0.mlp.up_proj.lora_B.weight") == (
        "model.layers.0.mlp.up_proj",
        "B",
    )
    assert module_of("base_model.model.model.norm.weight") is None


def test_a_sample_made_with_an_adapter_records_the_adapter_version():
    r = GenerateResult(rid="r", text="3", output_ids=[6], logprobs=[-0.1], finish_type="stop",
                       finish_reason={}, prompt_tokens=1, completion_tokens=1, weight_version=0,
                       e2e_latency=0.0)  # fmt: skip
    assert sample_versions(adapter_made(r, 7), 7)[:2] == (7, 7)
    cards = [("m", None), ("v000007", "m"), ("v000006", "m"), ("other", "m")]
    models = {"data": [{"id": i, "parent": p} for i, p in cards]}
    assert adapter_versions(models) == {6, 7} and adapter_versions({}) == set()


def test_the_wire_says_a_version_is_an_adapter():
    msg = WeightsPublished(run="r", version=1, step=1, uri="nats://x/1", format="peft-lora",
                           sha256="0" * 64, size_bytes=1)  # fmt: skip
    assert msg.format == "peft-lora"
    with pytest.raises(ValidationError):
        WeightsPublished(run="r", version=1, step=1, uri="u", format="gguf", sha256="0" * 64,
                         size_bytes=1)  # fmt: skip
