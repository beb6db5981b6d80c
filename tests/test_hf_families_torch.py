"""Every config.json fixture (tests/fixtures/hf) against the model Hugging Face transformers
builds from it: ckplan's parameter count equals the parameters of `AutoModelForCausalLM
.from_config` (on the meta device, no memory) plus its persistent buffers, the tensors a
checkpoint holds (DeepSeek-V3's and GLM-4.5's e_score_correction_bias are buffers there).
Gemma 3's multimodal config is built from its text_config, the part ckplan counts."""

import json
import warnings
from pathlib import Path

import pytest
from needs_frameworks import framework_or_skip

from ckplan.inputs.presets import load_spec
from ckplan.model.memory import parameter_count

FIXTURES = Path(__file__).parent / "fixtures" / "hf"


def checkpoint_tensors(config: dict) -> int:
    torch = framework_or_skip("torch", "the parameter counts were not checked")
    transformers = framework_or_skip("transformers", "the parameter counts were not checked")
    if "text_config" in config:  # gemma3: the language model alone
        config = config["text_config"] | {"model_type": "gemma3_text"}
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**config)
        )
    saved = set(model.state_dict())
    parameters = sum(p.numel() for p in model.parameters())  # tied weights once
    return parameters + sum(b.numel() for name, b in model.named_buffers() if name in saved)


@pytest.mark.parametrize("name", sorted(p.parent.name for p in FIXTURES.glob("*/config.json")))
def test_parameters_equal_what_transformers_builds(name):
    path = FIXTURES / name / "config.json"
    expected = checkpoint_tensors(json.loads(path.read_text()))
    assert parameter_count(load_spec(str(path), {})).total == expected
