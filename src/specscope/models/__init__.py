from specscope.models.config import ModelConfig, SUPPORTED_ARCHITECTURES
from specscope.models.llama import Transformer
from specscope.models.loader import load_model, load_config

__all__ = ["ModelConfig", "SUPPORTED_ARCHITECTURES", "Transformer", "load_model", "load_config"]
