"""Prompts into token ids, off the engine thread: fit a job to its model, template it, tokenize it.

Before the engine sees a job, a small worker pool checks it against the model it
will reach (token ids inside the vocabulary, top_k, context length), applies the
chat template and encodes it. A prompt longer than the context could hold in
characters is refused before any encoding, so a multi-megabyte prompt neither
stalls other jobs nor holds memory. The tokenizer is mlx-lm's, loaded once per
model from the checkpoint's tokenizer and config files: no weights are read, so
a job can be refused before its model is loaded.
"""

from __future__ import annotations

import concurrent.futures
import copy
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from . import logs
from .engine.grammar_compile import Compiler, compile_rules
from .media.images import ImageProcessor, VisionPrompt
from .media.plan import MediaPlan, plan_media
from .jobs import Job, JobError, check_vocabulary
from .models.tool_format import ToolFormat, tool_format_for
from .types import Cause

log = logs.get("prompts")


@dataclass(frozen=True)
class CompiledGrammar:
    """A constrained job's matcher, compiled off the engine thread; the engine makes it a RowGrammar."""

    matcher: Any  # llguidance.LLMatcher or grammar_compile.LazyCall, used by one row only
    n_vocab: int  # the matcher's mask width, in tokens
    kind: str  # OutputRules.kind


@dataclass(frozen=True)
class Prepared:
    job: Job  # its sampling fitted to the model
    prompt: tuple[int, ...]  # token ids, templated
    shared_prefix: int = 0  # tokens of the leading system messages, a prefix other chats are likely to share
    grammar: CompiledGrammar | None = None  # for a job with output rules
    tool_format: ToolFormat | None = None  # the model's, for a job that may call tools
    vision: MediaPlan | None = None  # a job with images: their shape and bytes; pixels are made at admission


@dataclass(frozen=True)
class PromptTokenizer:
    """What preparing a prompt needs of a model, with no weights loaded."""

    tokenizer: Any  # mlx-lm TokenizerWrapper
    vocab_size: int  # token ids at or above this would index past the logits
    context_length: int
    max_token_chars: int  # the longest token's text: a prompt of n characters is at least n / this tokens
    lock: threading.Lock  # HF fast tokenizers are not safe to call from two threads at once
    tool_format: ToolFormat
    n_vocab: int  # the widest of the logits and the tokenizer: the grammar masks' width
    images: ImageProcessor | None = None  # the model's image processor, when it takes images
    images_refused: str = ""  # else why not
    message_tokens: int = 1  # the fewest tokens its chat template spends on a message, even an empty one
    _compiler: list = field(default_factory=list)  # built on first use (its tokenizer takes ~1 s on big vocabularies)

    @property
    def max_prompt_chars(self) -> int:
        return self.context_length * self.max_token_chars

    def check_size(self, job: Job) -> None:
        """Refuse, before templating or encoding it, a prompt this context cannot hold: its characters make at
        least one token per max_token_chars, and each chat message at least message_tokens more (99,999 empty
        messages were 3.4 MB that templated to 950,000 tokens in 7 s, holding the tokenizer's lock)."""
        where = "messages" if job.messages is not None else "prompt"
        n = len(job.messages or ())
        if job.prompt_chars > self.max_prompt_chars:
            raise JobError(
                Cause.CONTEXT_LENGTH_EXCEEDED,
                f"the prompt is {job.prompt_chars} characters, more than {job.model}'s context of "
                f"{self.context_length} tokens can hold (at most {self.max_prompt_chars} characters with its "
                "tokenizer); shorten the prompt", where)
        least = -(-job.prompt_chars // self.max_token_chars) + n * self.message_tokens
        if n and least > self.context_length:
            raise JobError(
                Cause.CONTEXT_LENGTH_EXCEEDED,
                f"the prompt is {job.prompt_chars} characters in {n} messages, at least {least} tokens (a token per "
                f"{self.max_token_chars} characters at most, and {self.message_tokens} of its chat template a "
                f"message): more than {job.model}'s context of {self.context_length} tokens can hold; shorten "
                "the prompt or send fewer messages", where)

    def compiler(self) -> Compiler:
        with self.lock:
            if not self._compiler:
                self._compiler.append(Compiler(self.tokenizer, self.n_vocab))
            return self._compiler[0]

    def grammar(self, job: Job) -> CompiledGrammar | None:
        """The job's output rules compiled for this model, or None when it has none."""
        if not job.rules.constrained:
            return None
        compiler = self.compiler()
        matcher = compile_rules(compiler, job.rules, self.tool_format)  # None: `auto` calls are only parsed
        return CompiledGrammar(matcher, compiler.n_vocab, job.rules.kind) if matcher is not None else None


def for_model(job: Job, model_id: str) -> Job:
    """`job` for the served id of its model. Its fields were checked when it was made, and are not again: a chat
    of 20,000 messages took 60 ms to check, on the event loop (dataclasses.replace runs __post_init__)."""
    served = copy.copy(job)
    object.__setattr__(served, "model", model_id)
    return served


def load_prompt_tokenizer(model_id: str, path: Path, config: dict) -> PromptTokenizer:
    from mlx_lm.utils import load_tokenizer

    from .models.capability import images_refused, vocab_size
    from .memory.checkpoint import context_length

    try:  # the same call mlx_lm.load makes, so ids and templates match the loaded model's
        tok = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
        vocab = tok.get_vocab()
    except Exception as e:
        raise JobError(Cause.MODEL_LOAD_FAILED,
                       f"cannot load the tokenizer of {model_id}: {type(e).__name__}: {e}") from None
    declared = vocab_size(config)
    sizes = [n for n in (declared, len(vocab)) if isinstance(n, int) and n > 0]
    images, refused = None, images_refused(config)
    if refused is None:
        try:
            images = ImageProcessor(path, config, tok)
        except ImportError:
            refused = "the node was installed without its vision extra (pip install 'provider-node[vision]')"
        except Exception as e:  # a processor config this code cannot read: text is still served
            refused = f"its image processor cannot be loaded ({type(e).__name__}: {e})"
    return PromptTokenizer(tok, min(sizes), context_length(config), max((len(t) for t in vocab), default=1) or 1,
                           threading.Lock(), tool_format_for(tok), max(sizes), images, refused or "",
                           message_tokens(tok))


def message_tokens(tok: Any) -> int:
    """The fewest tokens a chat template spends on one message: half what an empty assistant turn and an empty
    user turn add on average (a system or tool message may cost less than the average), at least 1; 1 when the
    template cannot render the probe."""
    def length(messages: list[dict]) -> int:
        ids = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=True)
        return len(ids["input_ids"] if isinstance(ids, dict) else ids)

    turn = [{"role": "user", "content": ""}]
    try:
        pair = length([*turn, {"role": "assistant", "content": ""}, *turn]) - length(turn)
    except Exception:
        return 1
    return max(1, pair // 4)


class PromptPreparer:
    """`prepare(job)` returns a future of `Prepared`, or of the JobError that refuses the job."""

    def __init__(self, checkpoint: Callable[[str], tuple[Path, dict]], workers: int = 2):
        self._checkpoint = checkpoint  # model id -> (directory, config); may download config and tokenizer
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="prompts")
        self._models: dict[str, concurrent.futures.Future] = {}
        self._lock = threading.Lock()

    def prepare(self, job: Job) -> concurrent.futures.Future:
        return self._pool.submit(self._prepare, job)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def tokenizer(self, model_id: str) -> PromptTokenizer:
        """Loaded once per model; every job for a model still loading waits for the same load."""
        with self._lock:
            future = self._models.get(model_id)
            owner = future is None
            if owner:
                future = self._models[model_id] = concurrent.futures.Future()
        if owner:
            try:
                path, config = self._checkpoint(model_id)
                future.set_result(load_prompt_tokenizer(model_id, path, config))
            except BaseException as e:
                with self._lock:  # not cached: the next job tries again (the files may be fixed by then)
                    self._models.pop(model_id, None)
                future.set_exception(e)
        return future.result()

    def _prepare(self, job: Job) -> Prepared:
        m = self.tokenizer(job.model)
        sampling = job.sampling.fitted(m.vocab_size)
        where = "messages" if job.messages is not None else "prompt"
        m.check_size(job)
        vision = None
        if job.images or job.videos:
            if m.images is None:
                raise JobError(Cause.INVALID_REQUEST, f"model {job.model} takes no images: {m.images_refused}",
                               "messages")
            # decoded outside the tokenizer's lock, one at a time, for their soft tokens and bytes only: the
            # pixels are made again when the job is admitted, so a queued job holds its files, not its pixels
            vision = plan_media(m.images, job.images, job.videos, self._pool.submit)
        with m.lock:
            messages, tools = m.tool_format.prompt_messages(list(job.messages), job.rules) if job.messages \
                else (None, None)
            if vision is not None:
                ids = encode_with_images(job, m.tokenizer, m.images, vision.shape, messages, tools)
            else:
                ids = encode_prompt(job, m.tokenizer, messages, tools)
            # The first of n choices keeps its whole prompt's KV for the others (all but the last token, which
            # each computes to take its first token); otherwise the leading system messages, for other chats.
            shared = len(ids) - 1 if job.share_prompt and len(ids) > 1 else \
                system_prefix_length(messages, tools, m.tokenizer, ids)
        if job.prompt_ids is not None:
            check_vocabulary("prompt", ids, m.vocab_size)
        beyond = next((t for t in ids if t >= m.vocab_size), None)
        if beyond is not None:  # an embedding lookup past the table's rows crashes native code
            raise JobError(
                Cause.INVALID_REQUEST,
                f"the prompt encodes to token id {beyond} ({m.tokenizer.convert_ids_to_tokens(beyond)!r}), which "
                f"{job.model} has no embedding for (its {m.vocab_size} rows end at {m.vocab_size - 1}): its "
                "tokenizer knows tokens its weights do not; remove that text", where)
        if job.verify is not None:  # its claim is read, not generated: inside the vocabulary (native code indexes)
            check_vocabulary("verify.output_ids", job.verify.output, m.vocab_size)
            # Its sampling stays the request's: the verifier judges the claim's length against it (one longer than
            # the request or the context allowed fails its verdict, unread).
        if len(ids) >= m.context_length + (sampling.max_tokens == 0):  # room to generate, unless it only scores
            raise JobError(
                Cause.CONTEXT_LENGTH_EXCEEDED,
                f"the prompt is {len(ids)} tokens but {job.model} has a context of {m.context_length}; "
                "shorten the prompt", where)
        return Prepared(replace(job, sampling=sampling), tuple(ids), shared, m.grammar(job), m.tool_format, vision)


def system_prefix_length(messages: list[dict] | None, tools: list | None, tok: Any, ids: list[int]) -> int:
    """How many leading tokens of `ids` render the leading system messages (and the tools), found as
    mlx_lm.server does: template the system messages before an empty user turn and keep what agrees with the
    prompt. Those tokens' KV is kept apart so the next chat with the same system prompt reuses it."""
    if not messages or messages[-1].get("role") != "user":
        return 0
    system = [m for m in messages[: next((i for i, m in enumerate(messages) if m.get("role") != "system"),
                                         len(messages))]]
    if not system:
        return 0
    try:
        rendered = tok.apply_chat_template([*system, {"role": "user", "content": ""}], add_generation_prompt=False,
                                           tokenize=True, tools=tools)
        if isinstance(rendered, dict):
            rendered = rendered["input_ids"]
    except Exception:  # a template that refuses this shape: no shared prefix, nothing lost
        return 0
    n = next((i for i, (a, b) in enumerate(zip(rendered, ids)) if a != b), min(len(rendered), len(ids)))
    return n if 0 < n < len(ids) - 1 else 0


def encode_with_images(job: Job, tok: Any, processor: ImageProcessor, vision: VisionPrompt, messages: list[dict],
                       tools: list | None) -> list[int]:
    """A chat with images: templated as text (each image part becomes the template's placeholder), each
    placeholder expanded to the image's soft tokens, then encoded as the template's own tokenization does."""
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, tools=tools)
    except Exception as e:
        raise JobError(Cause.INVALID_REQUEST, f"the chat template of {job.model} rejected the messages: {e}",
                       "messages") from None
    ids = tok.encode(processor.expand(text, list(vision.images), list(vision.videos)), add_special_tokens=False)
    for token, items in ((vision.image_token_id, vision.images), (vision.video_token_id, vision.videos)):
        if sum(1 for t in ids if t == token) != sum(i.soft_tokens for i in items):  # else features land off them
            raise JobError(Cause.INVALID_REQUEST, "the prompt's text holds image or video tokens of its own; remove "
                                                  "them", "messages")
    return list(ids)


def encode_prompt(job: Job, tok: Any, messages: list[dict] | None = None, tools: list | None = None) -> list[int]:
    """The job's prompt as token ids: its chat `messages` (as its tool format renders them; the job's own by
    default) through the model's template, with `tools` for templates that render them, or its raw prompt
    (text, or token ids as given)."""
    if job.prompt_ids is not None:
        return list(job.prompt_ids)
    try:
        if job.messages is not None:
            if not tok.has_chat_template:
                raise JobError(Cause.INVALID_REQUEST, f"model {job.model} has no chat template; send a raw "
                                                      "prompt to /v1/completions instead", "messages")
            try:
                ids = tok.apply_chat_template(list(job.messages) if messages is None else messages,
                                              add_generation_prompt=True, tokenize=True, tools=tools)
            except Exception as e:  # jinja raises for, e.g., roles that do not alternate
                raise JobError(Cause.INVALID_REQUEST, f"the chat template of {job.model} rejected the messages: "
                                                      f"{e}", "messages") from None
            if isinstance(ids, dict):  # transformers may return a BatchEncoding
                ids = ids["input_ids"]
        else:
            # Same rule as mlx_lm.stream_generate: add BOS unless the prompt already starts with it.
            add_special = tok.bos_token is None or not job.prompt.startswith(tok.bos_token)
            ids = tok.encode(job.prompt, add_special_tokens=add_special)
    except JobError:
        raise
    except Exception as e:  # a tokenizer failure on text Job already checked is ours, not the client's
        log.exception("prompt_encoding_failed", job_id=job.id, model=job.model)
        raise JobError(Cause.INTERNAL, f"the tokenizer of {job.model} failed: {type(e).__name__}") from None
    if not ids:
        raise JobError(Cause.INVALID_REQUEST, "the prompt is empty", "prompt")
    return list(ids)
