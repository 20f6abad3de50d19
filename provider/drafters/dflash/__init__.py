"""DFlash block drafters and their variants: the checkpoint's config and headers (config.py, a variant module
each), the model (head.py and a head module per variant whose layers differ)."""
