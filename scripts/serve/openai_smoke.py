"""The official `openai` Python client against a running `kiln serve`: a streamed chat
with usage and a non-streamed completion, asserting content and usage, the sampling
fields the client sends (penalties, logit bias, vLLM's min_p and repetition_penalty),
log-probabilities streamed and not, `n` choices, the prompt's log-probabilities (`echo`
with `max_tokens` 0, as lm-evaluation-harness asks for a loglikelihood), a `json_schema`
response format whose output parses, and a tool call round trip (the call forced by
`tool_choice`, streamed and not, then the tool's result and an answer).
Usage:

    python openai_smoke.py http://127.0.0.1:PORT MODEL_ID

Exits non-zero with a message on the first failed expectation.
"""

import json
import sys

import openai

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def check_weather(arguments: str) -> None:
    args = json.loads(arguments)
    assert list(args) == ["city", "unit"], args
    assert isinstance(args["city"], str) and len(args["city"]) <= 12, args
    assert args["unit"] in ("celsius", "fahrenheit"), args


def structured_and_tools(client: openai.OpenAI, model: str) -> None:
    """A schema's output parses; a forced tool call round trips (synthetic weights emit
    garbage, so only the mask makes either valid)."""
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "size": {"type": "integer", "minimum": 1, "maximum": 99},
            "fired": {"type": "boolean"},
        },
        "required": ["name", "size", "fired"],
        "additionalProperties": False,
    }
    out = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Describe a kiln."}],
        max_tokens=120,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "kiln", "schema": schema, "strict": True}},
    )
    value = json.loads(out.choices[0].message.content)
    assert list(value) == ["name", "size", "fired"], value
    assert 1 <= value["size"] <= 99 and isinstance(value["fired"], bool), value
    assert out.choices[0].finish_reason == "stop", out

    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    called = client.chat.completions.create(
        model=model, messages=question, max_tokens=120, temperature=0, tools=[WEATHER], tool_choice=named
    )
    choice = called.choices[0]
    assert choice.finish_reason == "tool_calls", called
    assert choice.message.content is None, called
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather", call
    check_weather(call.function.arguments)

    # Streamed: index, id and name first, then the arguments, as OpenAI streams a call.
    stream = client.chat.completions.create(
        model=model, messages=question, max_tokens=120, temperature=0, tools=[WEATHER], tool_choice="required",
        stream=True,
    )
    name, arguments, ids, finish = "", "", set(), None
    for chunk in stream:
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                assert tc.index == 0, tc
                if tc.id:
                    ids.add(tc.id)
                if tc.function and tc.function.name:
                    name += tc.function.name
                if tc.function and tc.function.arguments:
                    arguments += tc.function.arguments
            finish = c.finish_reason or finish
    assert name == "get_weather" and len(ids) == 1 and finish == "tool_calls", (name, ids, finish)
    check_weather(arguments)

    answer = client.chat.completions.create(
        model=model,
        messages=question
        + [
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})},
        ],
        max_tokens=8,
        temperature=0,
        tools=[WEATHER],
        tool_choice="none",
    )
    assert answer.choices[0].message.content, answer
    assert not answer.choices[0].message.tool_calls, answer
    assert answer.choices[0].finish_reason in ("stop", "length"), answer


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

    check_logprobs(client, model)
    check_n(client, model)
    check_echo(client, model)
    structured_and_tools(client, model)
    print(
        f"openai {openai.__version__}: streamed chat {usage.completion_tokens} tokens, completion ok, "
        "logprobs, n and echo ok, json_schema ok, tool call round trip ok"
    )


def check_logprobs(client: "openai.OpenAI", model: str) -> None:
    """Chat log-probabilities with alternatives, whole and streamed, agree."""
    args = dict(
        model=model,
        messages=[{"role": "user", "content": "Say something about kilns."}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    whole = client.chat.completions.create(**args)
    content = whole.choices[0].logprobs.content
    assert len(content) == 6, whole
    for e in content:
        assert e.logprob <= 0 and isinstance(e.bytes, list), e
        assert len(e.top_logprobs) == 3, e
        # Greedy: the chosen token is the most likely one.
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob, e
    assert "".join(e.token for e in content) == whole.choices[0].message.content, whole
    streamed = []
    for chunk in client.chat.completions.create(stream=True, **args):
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.content:
                streamed.extend(choice.logprobs.content)
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content], streamed
    done = client.completions.create(
        model=model, prompt="The kiln", max_tokens=4, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4, lp
    assert all(len(t) <= 2 for t in lp.top_logprobs), lp


def check_n(client: "openai.OpenAI", model: str) -> None:
    """`n=3` greedy: three identical texts, each indexed, the usage three times one."""
    done = client.completions.create(
        model=model, prompt="The kiln was built", max_tokens=1, temperature=0, n=3, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in done.choices] == [0, 1, 2], done
    assert len({c.text for c in done.choices}) == 1, done
    assert done.usage.completion_tokens == 3 * 1, done.usage
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        n=3,
        extra_body={"ignore_eos": True},
    )
    assert len({c.message.content for c in chat.choices}) == 1 and len(chat.choices) == 3, chat
    assert chat.usage.completion_tokens == 3 * 4, chat.usage
    texts = {}
    for chunk in client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        n=3,
        stream=True,
        extra_body={"ignore_eos": True},
    ):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    assert texts == {k: chat.choices[0].message.content for k in range(3)}, texts
    try:
        client.completions.create(model=model, prompt="x", max_tokens=1, n=17)
    except openai.BadRequestError as e:
        assert e.status_code == 400 and "n 17" in str(e), e
    else:
        raise AssertionError("n=17 was accepted")


def check_echo(client: "openai.OpenAI", model: str) -> None:
    """The prompt's own log-probabilities: the first token's is null, every other one's a
    log-probability, and the text is the prompt."""
    prompt = "The kiln was built into the hill"
    done = client.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    choice = done.choices[0]
    assert choice.text == prompt, choice
    lp = choice.logprobs
    assert len(lp.token_logprobs) == done.usage.prompt_tokens == len(prompt.encode()) + 1, (lp, done.usage)
    assert lp.token_logprobs[0] is None, lp
    assert all(v <= 0 for v in lp.token_logprobs[1:]), lp
    assert done.usage.completion_tokens == 0, done.usage


if __name__ == "__main__":
    main()
