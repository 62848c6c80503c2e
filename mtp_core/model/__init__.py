from mtp_core.model.attention_metadata import AttentionMetadata
from mtp_core.model.deepseek_v3 import DeepseekV3ForCausalLM

__all__ = ["AttentionMetadata", "DeepseekV3ForCausalLM"]
