"""The MTP heads shipped inside target checkpoints: one module per head layout (heads.py lists them)."""
