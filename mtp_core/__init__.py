"""mtp_core: a DeepSeek-V3/R1 inference engine with MTP speculative decoding."""
from mtp_core.config import LLMConfig, SpeculativeConfig, KvCacheConfig, ModelConfig
from mtp_core.sampling import SamplingParams


def __getattr__(name: str):
    if name == "LLM":   # lazy: importing the package should not pull the engine in
        from mtp_core.llm import LLM
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "LLMConfig", "SpeculativeConfig", "KvCacheConfig", "ModelConfig", "SamplingParams"]
