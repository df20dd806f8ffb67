"""The serving engine: continuous batching, preemption and sharing over a KV cache."""
from vattn.engine.config import EngineConfig
from vattn.engine.llm_engine import LLMEngine
from vattn.engine.request import CompletionOutput, RequestOutput

__all__ = ["CompletionOutput", "EngineConfig", "LLMEngine", "RequestOutput"]
