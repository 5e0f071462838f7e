"""Writes verl's SFT trainer tree as verl's own Hydra configs compose it (test data for
burn-rlhf's SFT loader). Set-up: a venv with `pip install --no-deps verl==0.9.1` and
`pip install hydra-core omegaconf`; run: python compose.py > sft_trainer_engine.yaml"""
import importlib.util
import os

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

# The package's folder without importing it (verl's __init__ imports Ray).
verl_dir = importlib.util.find_spec("verl").submodule_search_locations[0]
config_dir = os.path.join(verl_dir, "trainer", "config")
with initialize_config_dir(config_dir=config_dir, version_base=None):
    cfg = compose(config_name="sft_trainer_engine")
print("# verl 0.9.1's SFT trainer config (verl/trainer/config/sft_trainer_engine.yaml) with its Hydra defaults")
print("# composed by verl's own config files (compose.py beside this file), printed with")
print("# OmegaConf.to_yaml(cfg, resolve=False). Test data: do not edit.")
print()
print(OmegaConf.to_yaml(cfg, resolve=False))
