"""The HTTP front: the OpenAI routes, the operator routes, errors and auth."""

from kvstream.api.app import create_app

__all__ = ["create_app"]
