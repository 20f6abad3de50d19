"""EAGLE-3 drafters: the checkpoint's config and headers (config.py), the model (head.py)."""
