"""The one job path: a `Job` goes in, its events (provider/outputs.py) come out. This module is the request side: a
job, its sampling and every field's bounds, checked once for both front ends, and a verify job's claim.

Both front ends (the coordinator session and the local HTTP API) translate
their requests into a Job and translate events back; neither touches MLX.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from .content import ImageInput, VideoInput, check_content, check_media, check_text, content_text, message_chars  # noqa: F401
from .constraints import NO_RULES, OutputRules, check_message_tool_fields, short
from .keep_alive import parse_keep_alive
from .outputs import GREEDY_SAMPLER, REPLAYABLE_SAMPLER, SPECULATIVE_SAMPLER, Proof
from .proofs.verdicts import Tolerance, clamped
from .types import Cause, JobError, JobId, Policy


ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1000
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300  # as OpenAI's API
MAX_SEED = 1 << 63
MAX_TOP_K = (1 << 32) - 1  # the proto's uint32
MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI's API
MAX_PROMPT_IDS = 1 << 20  # token ids in one prompt (a context is far shorter; this bounds the parsing)
# A temperature below this samples as greedy (0). At 1e-3 a token trailing the best by 0.02 in logit is already
# e^-20 (2e-9) as likely, and below it 1/T overflows half-precision logits (every token NaN) long before it
# could change the argmax; so the node takes the argmax instead of pretending to sample.
GREEDY_BELOW = 1e-3


def _invalid(param: str, rule: str, value: Any = None) -> JobError:
    shown = "" if value is None else f", got {short(value)}"
    return JobError(Cause.INVALID_REQUEST, f"{param} {rule}{shown}", param)


def check_int(param: str, value: Any, lo: int, hi: int | None = None) -> int:
    """An integer (not a bool) within [lo, hi]; Python ints compare exactly, so huge ones cannot overflow."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise _invalid(param, "must be an integer", value)
    if value < lo or (hi is not None and value > hi):
        raise _invalid(param, f"must be an integer from {lo}" + (f" to {hi}" if hi is not None else " up"), value)
    return value


def check_number(param: str, value: Any, lo: float, hi: float, *, low_open: bool = False) -> float:
    """A finite number within the range. Compared before float() so a 400-digit integer is refused, not raised on."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _invalid(param, "must be a number", value)
    if isinstance(value, float) and not math.isfinite(value):
        raise _invalid(param, "must be a finite number", value)
    if value > hi or value < lo or (low_open and value == lo):
        raise _invalid(param, f"must be {'>' if low_open else '>='} {lo} and <= {hi}", value)
    return float(value)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. Every bound lives here, once for both front ends; `fitted` adds the model's."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    # Logits processors (mlx-lm's): honoured on the plain path; speculation steps aside for them.
    logit_bias: tuple[tuple[int, float], ...] = ()
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Log-probabilities (provider.engine.logprobs): None, none; n, each generated token's and its n best
    # alternatives'. prompt_logprobs: the prompt's tokens' too (then max_tokens may be 0: score only).
    logprobs: int | None = None
    prompt_logprobs: bool = False

    @property
    def has_logits_processors(self) -> bool:
        return bool(self.logit_bias or self.repetition_penalty or self.presence_penalty or self.frequency_penalty)

    def __post_init__(self) -> None:
        # Assume every value is hostile: wrong types, huge or non-finite numbers, odd containers.
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        if not isinstance(self.prompt_logprobs, bool):
            raise _invalid("echo", "must be a boolean", self.prompt_logprobs)
        check_int("max_tokens", self.max_tokens, 0 if self.prompt_logprobs else 1)
        if self.logprobs is not None:
            check_int("top_logprobs", self.logprobs, 0, MAX_TOP_LOGPROBS)
        set_("temperature", check_number("temperature", self.temperature, 0.0, 2.0))
        set_("top_p", check_number("top_p", self.top_p, 0.0, 1.0, low_open=True))
        check_int("top_k", self.top_k, 0, MAX_TOP_K)  # `fitted` turns k >= the vocabulary into "no top-k"
        set_("min_p", check_number("min_p", self.min_p, 0.0, 1.0))
        if self.seed is not None:  # OpenAI's seed is a signed 64-bit integer, the proto's unsigned
            set_("seed", check_int("seed", self.seed, -(1 << 63), (1 << 64) - 1) % MAX_SEED)
        if not isinstance(self.stop, tuple) or len(self.stop) > MAX_STOP_STRINGS:
            raise _invalid("stop", f"must be at most {MAX_STOP_STRINGS} strings")
        for s in self.stop:
            if len(check_text("stop", s)) > MAX_STOP_CHARS:
                raise _invalid("stop", f"strings must be at most {MAX_STOP_CHARS} characters")
        if not isinstance(self.stop_token_ids, tuple) or len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise _invalid("stop_token_ids", f"must be at most {MAX_STOP_TOKEN_IDS} token ids")
        for t in self.stop_token_ids:
            check_int("stop_token_ids", t, 0)
        if not isinstance(self.logit_bias, tuple) or len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise _invalid("logit_bias", f"must map at most {MAX_LOGIT_BIAS} token ids to biases")
        bias = []
        for pair in self.logit_bias:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise _invalid("logit_bias", "must map token ids to numbers")
            bias.append((check_int("logit_bias", pair[0], 0), check_number("logit_bias", pair[1], -100.0, 100.0)))
        set_("logit_bias", tuple(bias))
        if self.repetition_penalty is not None:
            set_("repetition_penalty",
                 check_number("repetition_penalty", self.repetition_penalty, 0.0, 10.0, low_open=True))
        set_("presence_penalty", check_number("presence_penalty", self.presence_penalty, -2.0, 2.0))
        set_("frequency_penalty", check_number("frequency_penalty", self.frequency_penalty, -2.0, 2.0))

    def fitted(self, vocab_size: int) -> "SamplingParams":
        """These params against the model they will reach: every token id inside its vocabulary (native code
        indexes with them and crashes rather than raising), and top_k >= the vocabulary meaning no top-k."""
        for param, ids in (("logit_bias", [t for t, _ in self.logit_bias]), ("stop_token_ids", self.stop_token_ids)):
            check_vocabulary(param, ids, vocab_size)
        return replace(self, top_k=0) if self.top_k >= vocab_size else self

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def top_logprobs(self) -> int:
        return self.logprobs or 0


def check_vocabulary(param: str, ids, vocab_size: int) -> None:
    """Every id inside the model's vocabulary: native code indexes with them and crashes rather than raising."""
    bad = next((t for t in ids if t >= vocab_size), None)
    if bad is not None:
        raise _invalid(param, f"has token id {short(bad)}, outside this model's vocabulary of {vocab_size} "
                              f"(ids 0 to {vocab_size - 1})")


def resolve_max_tokens(value: Any, default: int, limit: int, least: int = 1) -> int:
    """A request's max_tokens (None: the node's default) within the node's limit (`least` 0: a scoring request)."""
    return default if value is None else check_int("max_tokens", value, least, limit)


@dataclass(frozen=True)
class PrefixScope:
    """Who may reuse a job's prompt prefix (engine.prefix_cache): the tenant ("" the node's own: the local API's
    token holder), whether it may be written to disk, and whether it is kept at all: a sealed job's is not, nor is
    anything kept served to it (its cached tokens go back in the clear)."""

    tenant: str = ""
    to_disk: bool = True
    kept: bool = True


@dataclass(frozen=True)
class Job:
    """One generation request. Exactly one of `prompt` (raw text), `prompt_ids` (token ids) or `messages`
    (chat) is set."""

    id: JobId
    model: str  # as requested; Node.run replaces it with the served ModelId
    sampling: SamplingParams
    prompt: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    speculation: Policy = Policy.AUTO
    rules: OutputRules = NO_RULES  # response_format, tools, tool_choice
    prompt_ids: tuple[int, ...] | None = None
    share_prompt: bool = False  # keep the prompt's KV for reuse once read (the first of n choices)
    images: tuple[ImageInput, ...] = ()  # in the order their IMAGE_PART placeholders appear in `messages`
    videos: tuple[VideoInput, ...] = ()  # likewise, VIDEO_PART
    verify: Claim | None = None  # a verify job: check this claim against the prompt instead of generating
    # How long its model stays loaded once idle after it (keep_alive.py: seconds, FOREVER); None: the settings'.
    keep_alive: float | str | None = None
    prefix_scope: PrefixScope = PrefixScope()

    def __post_init__(self) -> None:
        if sum(p is not None for p in (self.prompt, self.messages, self.prompt_ids)) != 1:
            raise JobError(Cause.INVALID_REQUEST, "a job needs exactly one of prompt, prompt_ids or messages")
        if self.prompt is not None:
            check_text("prompt", self.prompt)
        if self.prompt_ids is not None:
            if not isinstance(self.prompt_ids, tuple) or not 0 < len(self.prompt_ids) <= MAX_PROMPT_IDS:
                raise _invalid("prompt", f"token ids must be a non-empty array of at most {MAX_PROMPT_IDS}")
            for t in self.prompt_ids:
                check_int("prompt", t, 0)
        if self.messages is None and self.rules.calls_tools:
            raise _invalid("tools", "need chat messages (a raw prompt has no chat template to render them)")
        placeholders = (0, 0)
        for i, m in enumerate(self.messages or ()):
            role = m.get("role")
            if not isinstance(role, str) or role not in ROLES:
                raise _invalid(f"messages[{i}].role", f"must be one of {', '.join(sorted(ROLES))}")
            placeholders = tuple(a + b for a, b in zip(placeholders, check_content(f"messages[{i}].content",
                                                                                  m.get("content"))))
            check_message_tool_fields(i, m)
        check_media(self.images, self.videos, placeholders)
        if self.verify is not None and not isinstance(self.verify, Claim):
            raise _invalid("verify", "must be a claim")
        if not isinstance(self.rules, OutputRules):
            raise _invalid("response_format", "must be the job's output rules")
        if not isinstance(self.speculation, str) or self.speculation not in {p.value for p in Policy}:
            raise _invalid("speculation", "must be one of auto, on, off", self.speculation)
        object.__setattr__(self, "speculation", Policy(self.speculation))
        object.__setattr__(self, "keep_alive", parse_keep_alive(self.keep_alive))

    @property
    def prompt_chars(self) -> int:
        """Characters of text the prompt carries (a template only adds to them; offered tools are written into it)."""
        if self.prompt_ids is not None:
            return 0  # counted in tokens when prepared
        text = len(self.prompt) if self.prompt is not None else sum(map(message_chars, self.messages))
        return text + (self.rules.tools_chars if self.rules.calls_tools else 0)


MAX_COMMITMENT_BYTES = 4 + (2 + 2 * 4 * 32) * (1 << 15)  # a commitment to the longest output a node makes


@dataclass(frozen=True)
class Claim:
    """A verify job's subject: the output another node says it made for this job's prompt and sampling."""

    output: tuple[int, ...]
    proof: Proof
    tolerance: Tolerance | None = None  # the coordinator's (held to the loosest profile known); None: this backend's

    def __post_init__(self) -> None:
        if self.tolerance is not None and not isinstance(self.tolerance, Tolerance):
            raise _invalid("verify.tolerance", "must be a tolerance")
        object.__setattr__(self, "tolerance", self.tolerance and clamped(self.tolerance))
        p = self.proof
        if p.end_token is not None:  # the wire's uint32; whether it is an end id is the verifier's to judge
            check_int("verify.proof.end_token", p.end_token, 0, (1 << 32) - 1)
        # An output may be empty only when it ended on an end token: that token is then what is checked.
        least = 0 if p.end_token is not None else 1
        if not isinstance(self.output, tuple) or not least <= len(self.output) <= 1 << 20:
            raise _invalid("verify.output_ids", "must be a non-empty array of token ids (or end on an end token)")
        for t in self.output:
            check_int("verify.output_ids", t, 0)
        if p.sampler not in (GREEDY_SAMPLER, REPLAYABLE_SAMPLER, SPECULATIVE_SAMPLER):
            raise _invalid("verify.proof.sampler", "must name how the tokens were drawn")
        if p.sampler == REPLAYABLE_SAMPLER and p.seed is None:
            raise _invalid("verify.proof.seed", "a replayable proof needs the seed its tokens were drawn with")
        if not isinstance(p.commitment, bytes) or not 0 < len(p.commitment) <= MAX_COMMITMENT_BYTES:
            raise _invalid("verify.proof.commitment", "must be the commitment of the claimed output")

    @property
    def length(self) -> int:
        """Tokens the claim says the model generated: its output and the end token it claims."""
        return len(self.output) + (self.proof.end_token is not None)
