import pytest

from ckplan.inputs.presets import load_spec


@pytest.fixture
def spec_of():
    """Load a preset with overrides: spec_of("gpt2", seq=512)."""

    def load(name, **overrides):
        return load_spec(name, overrides)

    return load
