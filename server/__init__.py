"""The OpenAI-compatible HTTP server: ``build_app(engine, served_model_name)`` -> a FastAPI app."""

from jaxpaged.server.app import build_app

__all__ = ["build_app"]
