"""What a model's running batches will hold, as the residency books it: each batch's rows as memory sees them (a
`Layout`), and the bytes a pair of layouts (plain rows, speculating rows) holds: KV at every row's final length, the
copy a plain batch makes when rows join or leave, a finished row's KV kept for reuse, the scratch of reading
prompts, and what a job's media hold until read. Functions over plain data: `Running` gathers a model's layouts
from its batches, the scheduler books what they give (Residency.admit_batch, Residency.book)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..media.plan import MediaPlan
from ..memory.batch_kv import plain_batch_bytes, spec_batch_bytes
from ..memory.estimate import media_read_bytes, vision_scratch_bytes
from ..models.loader import LoadedModel
from .prompt_reader import reading_bytes


@dataclass
class Layout:
    """One batch's rows as memory sees them: each row's final length, and the prompts still being read."""

    finals: list[int] = field(default_factory=list)
    reading: list[int] = field(default_factory=list)
    scoring: bool = False  # a prompt is being scored: its logits' scratch (prompt_reader.SCORE_SCRATCH_BYTES) is held
    copying: int = 0  # bytes of the copy of its caches its next step makes, rows having joined or left (PlainBatch)
    media: int = 0  # what prompts with media hold beside their KV until read: prepared arrays, embeddings
    vision: int = 0  # the vision tower's scratch, for the largest image left to encode (one encode at a time)


def layout_of(rows: list, reading) -> Layout:
    """The rows' layout; `reading(row)`: the row still reads its prompt."""
    return Layout([r.output.prompt_tokens + r.output.max_tokens for r in rows],
                  [r.output.prompt_tokens for r in rows if reading(r)],
                  any(getattr(r, "scorer", None) is not None for r in rows))


def held_bytes(lm: LoadedModel, plain: Layout, spec: Layout, *, step_tokens: int, prefix_cache_bytes: int) -> int:
    """What a model's plain and speculating batches hold at these layouts."""
    if lm.kv_shape is None:
        return 0
    # A plain batch that copies its caches (a row joined or left) holds the copy beside them for a step.
    kv = plain_batch_bytes(plain.finals, lm.kv_shape) + plain.copying \
        + spec_batch_bytes(spec.finals, lm.kv_shape, lm.draft_kv_shape)
    return kv + _keeping_bytes(lm, plain.finals + spec.finals, prefix_cache_bytes) \
        + reading_bytes(lm, plain, spec, step_tokens)


def _keeping_bytes(lm: LoadedModel, finals: list[int], prefix_cache_bytes: int) -> int:
    """A row that ends is kept for reuse: the prefix cache copies its KV (prefix_cache.owned) while its batch
    holds it, until the step ends. The largest row's copy is booked (~80 MiB: a 10k-token KV-heavy turn)."""
    if prefix_cache_bytes <= 0 or not finals:
        return 0
    return min(lm.kv_shape.bytes_for(max(finals)), prefix_cache_bytes)


def with_one_more(lm: LoadedModel, plain: Layout, spec: Layout, prompt: int, final: int, scored: bool,
                  media: MediaPlan | None) -> list[tuple[Layout, Layout]]:
    """The layouts the model's batches may take with one more job (`prompt` tokens, `final` at the end; `scored`:
    its prompt logprobs wanted; `media`: its images), wherever it will decode: plain, plain with the speculating
    rows demoted, or speculating (decided after admission, so each is booked: the largest). A job with media is read
    first (media held, the tower's scratch)."""
    held, scratch = (0, 0) if media is None else job_media_bytes(lm, prompt, media)
    joined = Layout(plain.finals + [final], plain.reading + [prompt], plain.scoring or scored, plain.copying,
                    plain.media + held, max(plain.vision, scratch))
    layouts = [(joined, spec), (Layout(joined.finals + spec.finals, joined.reading + spec.reading, joined.scoring,
                                       plain.copying, joined.media, joined.vision), Layout())]
    if lm.drafter is not None:
        layouts.append((plain, Layout(spec.finals + [final], spec.reading + [prompt])))
    return layouts


def job_media_bytes(lm: LoadedModel, prompt: int, media: MediaPlan) -> tuple[int, int]:
    """What a job's media hold while its prompt is read (their prepared arrays, the prompt's embeddings), and the
    tower's scratch for the largest of them: what its MediaRead will say (held_bytes, scratch_bytes) at its start."""
    return (media.nbytes + media_read_bytes(lm.config, prompt),
            max((vision_scratch_bytes(lm.config, n) * at_once for n, at_once in media.encodes()), default=0))
