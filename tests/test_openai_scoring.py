"""What evaluation harnesses and batch clients send, through `provider start --local` with the official openai
SDK (issue 22): logprobs on chat and completions, streamed and not; token-id and batched prompts; echo with
prompt logprobs, and echo alone with max_tokens 0; n choices sharing one prefill; /tokenize and /detokenize."""

import httpx
import mlx.core as mx
import openai
import pytest
from mlx_lm import load

from tests.helpers import LocalServer

TOL = 2e-3


@pytest.fixture(scope="module")
def served(fixtures_dir, tmp_path_factory):
    srv = LocalServer(fixtures_dir / "llama-tiny", tmp_path_factory.mktemp("node"))
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=srv.token, max_retries=0)
    yield srv, client
    assert srv.stop() == 0
    assert "Traceback" not in srv.logs()


@pytest.fixture(scope="module")
def reference(fixtures_dir):
    model, tok = load(str(fixtures_dir / "llama-tiny"))

    def logprobs(ids: list[int]) -> mx.array:
        logits = model(mx.array(ids)[None])[0].astype(mx.float32)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    return tok, logprobs


def test_echo_scores_token_id_prompts_as_lm_eval_reads_them(served, reference):
    """lm-eval's loglikelihood request: a batch of token-id prompts, max_tokens 1, logprobs 1, echo."""
    _, client = served
    tok, forward = reference
    prompts = [tok.encode("The cache batch token"), tok.encode("A model stream window prefix memory")]
    r = client.completions.create(model="llama-tiny", prompt=prompts, max_tokens=1, logprobs=1, echo=True,
                                  temperature=0, seed=1234)
    assert [c.index for c in r.choices] == [0, 1]
    for ids, choice in zip(prompts, r.choices):
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(ids) + 1  # the prompt's tokens, then the one generated
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        ref = forward(ids)
        for i in range(1, len(ids)):
            assert abs(lp.token_logprobs[i] - ref[i - 1, ids[i]].item()) < TOL
            best = max(lp.top_logprobs[i].values())  # lm-eval's greedy check
            assert abs(best - mx.max(ref[i - 1]).item()) < TOL
        assert choice.text.startswith(tok.decode(ids))
    assert r.usage.prompt_tokens == sum(len(p) for p in prompts)


def test_echo_alone_and_max_tokens_zero_score_without_generating(served, reference):
    _, client = served
    tok, forward = reference
    r = client.completions.create(model="llama-tiny", prompt="The cache batch", max_tokens=0, echo=True, logprobs=0)
    (c,) = r.choices
    ids = tok.encode("The cache batch")
    assert c.text == "The cache batch" and r.usage.completion_tokens == 0
    assert len(c.logprobs.tokens) == len(ids) and all(len(t) == 1 for t in c.logprobs.top_logprobs[1:])
    ref = forward(ids)
    assert all(abs(c.logprobs.token_logprobs[i] - ref[i - 1, ids[i]].item()) < TOL for i in range(1, len(ids)))
    plain = client.completions.create(model="llama-tiny", prompt="The cache batch", max_tokens=0, echo=True)
    assert plain.choices[0].text == "The cache batch" and plain.choices[0].logprobs is None


def test_chat_logprobs_streamed_and_whole_agree(served, reference):
    _, client = served
    msgs = [{"role": "user", "content": "Say something about caches"}]
    whole = client.chat.completions.create(model="llama-tiny", messages=msgs, max_tokens=8, temperature=0,
                                           logprobs=True, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    for t in content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == t.logprob  # greedy: the best
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token
    streamed = [t for chunk in client.chat.completions.create(
        model="llama-tiny", messages=msgs, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3, stream=True)
        if chunk.choices and chunk.choices[0].logprobs for t in chunk.choices[0].logprobs.content]
    assert [(t.token, round(t.logprob, 4)) for t in streamed] == [(t.token, round(t.logprob, 4)) for t in content]


def test_n_choices_share_one_prefill_and_seeds_reproduce(served):
    srv, client = served
    prompt = "The provider node serves models to the network " * 4
    greedy = client.completions.create(model="llama-tiny", prompt=prompt, max_tokens=10, temperature=0, n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert len({c.text for c in greedy.choices}) == 1  # greedy: three equal choices
    body = greedy.model_dump()
    prompt_tokens = greedy.usage.prompt_tokens
    # The first choice read the prompt; the others took all of it but the last token from the prefix cache.
    assert [c["telemetry"]["cached_prompt_tokens"] for c in body["choices"][1:]] == [prompt_tokens - 1] * 2
    assert greedy.usage.completion_tokens == 30

    sampled = [client.completions.create(model="llama-tiny", prompt=prompt, max_tokens=10, temperature=1.0, n=3,
                                         seed=42) for _ in range(2)]
    assert [c.text for c in sampled[0].choices] == [c.text for c in sampled[1].choices]
    assert len({c.text for c in sampled[0].choices}) > 1  # each choice draws with its own seed
    one = client.completions.create(model="llama-tiny", prompt=prompt, max_tokens=10, temperature=1.0, seed=42)
    assert one.choices[0].text == sampled[0].choices[0].text  # choice 0 is what n=1 gives

    chunks = list(client.completions.create(model="llama-tiny", prompt=["The cache", "A river"], max_tokens=6,
                                            temperature=0, n=2, stream=True))
    texts = {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert sorted(texts) == [0, 1, 2, 3] and texts[0] == texts[1] and texts[2] == texts[3]


def test_tokenize_and_detokenize_in_vllms_shapes(served, reference):
    srv, _ = served
    tok, _ = reference
    h = {"Authorization": f"Bearer {srv.token}"}
    r = httpx.post(f"{srv.url}/tokenize", json={"model": "llama-tiny", "prompt": "The cache"}, headers=h).json()
    assert r["tokens"] == tok.encode("The cache") and r["count"] == len(r["tokens"]) and r["max_model_len"] > 0
    bare = httpx.post(f"{srv.url}/tokenize", json={"prompt": "The cache", "add_special_tokens": False},
                      headers=h).json()
    assert bare["tokens"] == tok.encode("The cache", add_special_tokens=False)
    chat = httpx.post(f"{srv.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, headers=h)
    assert chat.status_code == 200 and chat.json()["count"] > 2
    back = httpx.post(f"{srv.url}/detokenize", json={"tokens": bare["tokens"]}, headers=h).json()
    assert back["prompt"] == "The cache"
    info = httpx.get(f"{srv.url}/tokenizer_info", headers=h).json()
    assert "eos_token" in info and "bos_token" in info
    for path, body, param in [("/detokenize", {"tokens": [1 << 40]}, "tokens"),
                              ("/detokenize", {"tokens": "1 2"}, "tokens"),
                              ("/tokenize", {"prompt": 5}, "prompt"),
                              ("/tokenize", {"model": "nope", "prompt": "a"}, None)]:
        bad = httpx.post(f"{srv.url}{path}", json=body, headers=h)
        assert bad.status_code in (400, 404) and bad.json()["error"]["param"] == param, bad.text
    assert httpx.post(f"{srv.url}/tokenize", json={"prompt": "a"}).status_code == 401  # behind the token too


def test_prompt_ids_outside_the_vocabulary_get_a_400_and_the_node_serves_on(served):
    _, client = served
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="llama-tiny", prompt=[[1, 2], [1, 1 << 40]], max_tokens=2)
    assert e.value.body["param"] == "prompt"
    assert client.completions.create(model="llama-tiny", prompt=[1, 2], max_tokens=2).choices[0].text is not None


def test_text_offsets_agree_streamed_and_whole_with_a_bos_the_echo_does_not_show(served):
    """The tokenizer adds a BOS the echoed text does not hold: it takes no room, and each token's offset is where
    it begins in the choice's text, the same whether streamed or not (issue 37, finding 8)."""
    _, client = served
    prompt = "Hi there"
    args = dict(model="llama-tiny", prompt=prompt, max_tokens=4, logprobs=0, echo=True, temperature=0.0)
    whole = client.completions.create(**args).choices[0]
    offsets, tokens, text = [], [], ""
    for chunk in client.completions.create(stream=True, **args):
        c = chunk.choices[0]
        text += c.text
        if c.logprobs is not None:
            offsets += c.logprobs.text_offset
            tokens += c.logprobs.tokens
    assert text == whole.text and tokens == whole.logprobs.tokens
    assert offsets == whole.logprobs.text_offset, (tokens, offsets, whole.logprobs.text_offset, whole.text)
    assert whole.logprobs.tokens[0] == "<bos>" and whole.logprobs.text_offset[:2] == [0, 0]
    generated = whole.logprobs.tokens[-4:]
    starts = [len(prompt) + len("".join(generated[:i])) for i in range(4)]
    assert whole.logprobs.text_offset[-4:] == starts
