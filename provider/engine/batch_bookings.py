"""What the residency books for each model's running batches, kept true as rows join and leave (the engine thread's
alone). A booking grows at once and shrinks a step late: MLX evaluates a step after the engine has moved on
(async), and a row leaving a batch copies the rows that stay, so memory goes a step after the rows do. A model with
no rows left holds nothing (its last step was read back)."""

from __future__ import annotations

from typing import Callable


class BatchBookings:
    def __init__(self, book: Callable[[str, int], None]):
        self._book = book  # Residency.book: (model id, bytes its batches hold)
        self._booked_models: set[str] = set()
        self._last_step: dict[str, int] = {}  # what each model's batches held at the last step
        self._floor: dict[str, int] = {}  # what each keeps booked until the next step

    def update(self, now: dict[str, int], step: bool = False) -> None:
        """Book `now` (by model id: what its batches will hold, from the rows they run now); `step`: a step has
        just run, so the floor until the next one is this step's rows and the previous step's."""
        if step:
            self._floor = {m: max(b, self._last_step.get(m, 0)) for m, b in now.items()}
            self._last_step = now
        for model_id in self._booked_models | set(now):
            booked = now.get(model_id, 0)
            self._book(model_id, max(booked, self._floor.get(model_id, 0)) if booked else 0)
        self._booked_models = set(now)
