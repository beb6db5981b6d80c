"""Inputs: the only modules that read files (and check the files ckplan writes).

files      one reader of user text files, with one set of refusals
safe_yaml  PyYAML's safe loader with its remaining hazards closed
presets    model descriptions: shipped presets, the user's YAML, a config.json
           (load_spec, spec_from_values: a profile named by a model is read here)
hf_config  a Hugging Face config.json mapped to ckplan's keys, family by family
gpus       GPU descriptions: shipped presets or the user's YAML
profiles   kernel profiles: shipped or the user's YAML
paths      output files (--plot, calibrate --out), checked first and written atomically
"""

__all__ = ["files", "gpus", "hf_config", "paths", "presets", "profiles", "runs", "safe_yaml"]
