"""onnxruntime execution: providers and sessions."""

from graphforge.runtime.sessions import available_providers, create_session

__all__ = ["available_providers", "create_session"]
