"""The bundled default model of `provider start --local`: available with no network.

The default is the trained demo pair in provider/models/demo/ (a small Gemma 4 target and its MTP
assistant, trained by tools/scripts/train_demo_pair.py), so a first run shows MTP speculation and its telemetry.
Beside it, `gemma4-demo-chat`: the same target fine-tuned to answer in its chat template and end its turn
(tools/scripts/train_demo_chat.py), served by the same `provider start --local` and loaded on its first request, so
a coding agent's turn completes (docs/api.md). Its weights are committed with the code and installed with the
package: a tree without them is incomplete.
"""

from __future__ import annotations

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent / "demo"
DEMO_TARGET = DEMO_DIR / "gemma4-demo"
DEMO_ASSISTANT = DEMO_DIR / "gemma4-demo-assistant"
DEMO_CHAT = DEMO_DIR / "gemma4-demo-chat"


def _has_weights(path: Path) -> bool:
    return (path / "config.json").exists() and (path / "model.safetensors").exists()


def default_pair() -> tuple[Path, Path | None]:
    """The bundled target and its drafter (None if the assistant's weights are missing)."""
    if not _has_weights(DEMO_TARGET):
        raise FileNotFoundError(f"the bundled demo model is missing (no config.json and model.safetensors in "
                                f"{DEMO_TARGET}): this installation or checkout is incomplete; reinstall the "
                                f"package, or restore provider/models/demo/ from git")
    return DEMO_TARGET, DEMO_ASSISTANT if _has_weights(DEMO_ASSISTANT) else None


def ensure_default_model() -> Path:
    return default_pair()[0]


def primary_models(settings) -> list:
    """The models `start` serves by default: --model / `model`, else the bundled default model (the first, with
    its assistant) and, with the local API on (agents' model), its chat variant."""
    from ..settings import ModelSpec
    from .loader import model_id_for

    if settings.model:
        return [ModelSpec(model_id_for(settings.model), settings.model, drafter=settings.drafter)]
    if settings.models:
        return []
    target, assistant = default_pair()
    drafter = settings.drafter or (str(assistant) if assistant else "")
    chat = [ModelSpec(DEMO_CHAT.name, str(DEMO_CHAT))] if settings.local and _has_weights(DEMO_CHAT) else []
    return [ModelSpec(target.name, str(target), drafter=drafter), *chat]
