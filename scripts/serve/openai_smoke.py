"""The official `openai` Python client against a running `kiln serve`: a streamed chat
with usage and a non-streamed completion, asserting content and usage, and the sampling
fields the client sends (penalties, logit bias, vLLM's min_p and repetition_penalty).
Usage:

    python openai_smoke.py http://127.0.0.1:PORT MODEL_ID

Exits non-zero with a message on the first failed expectation.
"""

import sys

import openai


def main() -> None:
    base, model = sys.argv[1], sys.argv[2]
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120, max_retries=0)

    listed = [m.id for m in client.models.list()]
    assert listed == [model], f"/v1/models lists {listed}, expected [{model!r}]"

    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say something about kilns."}],
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, usage, finish = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert text, "the streamed chat sent no content"
    assert finish == "length", f"finish_reason {finish!r}, expected 'length'"
    assert usage is not None, "no usage chunk despite include_usage"
    assert usage.completion_tokens == 16, f"completion_tokens {usage.completion_tokens}, expected 16"
    assert usage.total_tokens == usage.prompt_tokens + 16, usage
    assert usage.prompt_tokens_details.cached_tokens is not None, usage

    done = client.completions.create(
        model=model, prompt="The kiln was built", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert done.choices[0].text, "the completion has no text"
    assert done.choices[0].finish_reason == "length", done
    assert done.usage.completion_tokens == 8, done.usage
    # The byte tokenizer of synthetic models: BOS plus one token per byte.
    assert done.usage.prompt_tokens == len("The kiln was built".encode()) + 1, done.usage

    try:
        client.completions.create(model=model, prompt="x", max_tokens=0)
    except openai.BadRequestError as e:
        assert e.status_code == 400 and "max_tokens" in str(e), e
    else:
        raise AssertionError("max_tokens=0 was accepted")
    # The client's own sampling fields and vLLM's extensions: accepted, and a bias of 100
    # on "a" (byte 97 in the synthetic byte tokenizer) makes greedy output all "a".
    biased = client.completions.create(
        model=model,
        prompt="The kiln",
        max_tokens=6,
        temperature=0,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={"97": 100},
        extra_body={"ignore_eos": True, "repetition_penalty": 1.1, "min_p": 0.05},
    )
    assert biased.choices[0].text == "a" * 6, biased
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0.8,
        presence_penalty=-1,
        frequency_penalty=2,
        logit_bias={"98": -100},
        extra_body={"min_p": 0.1},
    )
    assert chat.usage.completion_tokens >= 1, chat.usage
    try:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=1, presence_penalty=3
        )
    except openai.BadRequestError as e:
        assert e.status_code == 400 and "presence_penalty" in str(e), e
    else:
        raise AssertionError("presence_penalty=3 was accepted")
    print(f"openai {openai.__version__}: streamed chat {usage.completion_tokens} tokens, completion ok")


if __name__ == "__main__":
    main()
