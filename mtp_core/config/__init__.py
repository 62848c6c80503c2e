"""Configuration: the checkpoint's (ModelConfig) and the engine's (LLMConfig and its sections), one schema.

schema.py says how a field is declared and checked, engine.py declares the engine's fields (their YAML keys
and CLI flags with them), compat.py lists the settings kept only for compatibility, flags.py turns CLI flag
values into an LLMConfig, runtime.py resolves the `runtime` section (the one reader of the project's environment
overrides); the YAML loader is mtp_core/yaml_config.py.
"""
from .engine import (DRAFT_LEN_POLICIES, MTP_MODES, CudaGraphConfig, KvCacheConfig, LLMConfig, MoeConfig,
                     RuntimeConfig, SpeculativeConfig)
from .model import ModelConfig, yarn_get_mscale
from .schema import ConfigError

__all__ = ["ConfigError", "CudaGraphConfig", "DRAFT_LEN_POLICIES", "KvCacheConfig", "LLMConfig", "MTP_MODES",
           "ModelConfig", "MoeConfig", "RuntimeConfig", "SpeculativeConfig", "yarn_get_mscale"]
