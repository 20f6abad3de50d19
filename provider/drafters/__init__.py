"""Drafters: every kind of drafter the node speculates with, and one registry of them (drafters.registry).

A kind is one object in a module of its own (`KIND`), which says how to recognise its checkpoints from config and
headers, checks a (target, drafter) pair, books its footprint and per-row KV, loads it, names the engine's proposer
that runs its rounds, and its tag. The model code of each kind lives beside it: the MTP heads targets ship (mtp/),
DFlash and its variants (dflash/), EAGLE-3 (eagle3/), the Gemma 4 assistant (gemma4_assistant). Models (capability,
loader, footprint, residency) ask the registry; nothing here imports provider.models or the engine.
"""
