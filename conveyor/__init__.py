"""Conveyor: a continuous-batching LLM inference engine with asynchronous batching on every device."""

from conveyor.config import EngineConfig
from conveyor.errors import ConfigError, ConveyorError, InvalidRequestError, ModelLoadError
from conveyor.llm import LLM
from conveyor.outputs import CompletionOutput, RequestOutput
from conveyor.params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput", "ConveyorError",
           "ConfigError", "InvalidRequestError", "ModelLoadError", "__version__"]
