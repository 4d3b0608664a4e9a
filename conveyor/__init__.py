"""Conveyor: a continuous-batching LLM inference engine with asynchronous batching on every device."""

from conveyor.openmp import set_wait_policy

set_wait_policy()  # before anything imports torch: OpenMP threads spin briefly, then sleep (conveyor/openmp.py)

from conveyor.config import EngineConfig  # noqa: E402
from conveyor.errors import ConfigError, ConveyorError, InvalidRequestError, ModelLoadError  # noqa: E402
from conveyor.llm import LLM, NonFiniteLogitsError  # noqa: E402
from conveyor.outputs import CompletionOutput, RequestOutput  # noqa: E402
from conveyor.params import SamplingParams  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CompletionOutput",
    "ConfigError",
    "ConveyorError",
    "EngineConfig",
    "InvalidRequestError",
    "ModelLoadError",
    "NonFiniteLogitsError",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]
