"""Model definitions. Every supported architecture is served by the Llama-family decoder."""

from pdserve.engine.models.llama import SUPPORTED_ARCHITECTURES, LlamaForCausalLM

__all__ = ["SUPPORTED_ARCHITECTURES", "LlamaForCausalLM"]
