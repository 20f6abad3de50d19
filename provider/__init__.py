"""Provider node: serves MLX models to a coordinator and as a local OpenAI-style API."""

__version__ = "0.1.0"
