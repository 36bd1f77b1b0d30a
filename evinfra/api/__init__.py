"""The HTTP front end: OpenAI-compatible routes, agent hints, admin, health and metrics."""

from evinfra.api.app import build_app

__all__ = ["build_app"]
