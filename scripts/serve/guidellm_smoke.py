"""Real clients' view of a running `kiln serve`, in two parts. Usage:

    python guidellm_smoke.py tokenizer URL KILN MODEL TOKENIZER_DIR
    python guidellm_smoke.py report REPORT.json PROFILE

`tokenizer`: `transformers.AutoTokenizer.from_pretrained(TOKENIZER_DIR)` (the files
`kiln export-tokenizer MODEL TOKENIZER_DIR` wrote) must encode a few strings to the ids
`kiln score --ids-only` gives, and count a completion's and a chat's prompt as the
server's usage does (with special tokens, and through the chat template).

`report`: a guidellm JSON report must hold one benchmark of PROFILE with successful
requests and none errored or incomplete.

Exits non-zero with a message on the first failed expectation.
"""

import json
import subprocess
import sys
import tempfile
import urllib.request

STRINGS = [
    "hello world",
    "The kiln was built into the side of the hill.",
    "  two  spaces\nand\ttabs\r\n",
    "héllo, wörld! 你好 🎉",
    "<think> tags </think> and <|im_start|>",
]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def kiln_ids(kiln: str, model: str, text: str) -> list:
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        out = subprocess.run(
            [kiln, "score", "-m", model, "--text-file", f.name, "--ids-only"],
            check=True,
            capture_output=True,
            text=True,
        )
    return json.loads(out.stdout)


def check_tokenizer(url: str, kiln: str, model: str, directory: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(directory)
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as r:
        served = json.load(r)["data"][0]["id"]
    for s in STRINGS:
        want = kiln_ids(kiln, model, s)
        got = tok.encode(s, add_special_tokens=False)
        assert got == want, f"AutoTokenizer encodes {s!r} to {got}, kiln to {want}"
        usage = post(
            f"{url}/v1/completions", {"model": served, "prompt": s, "max_tokens": 1}
        )["usage"]
        n = len(tok.encode(s))
        assert n == usage["prompt_tokens"], (
            f"{s!r}: AutoTokenizer counts {n} tokens with special tokens, "
            f"the server {usage['prompt_tokens']}"
        )
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": s}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        usage = post(
            f"{url}/v1/chat/completions",
            {"model": served, "messages": messages, "max_tokens": 1},
        )["usage"]
        assert len(ids) == usage["prompt_tokens"], (
            f"{s!r}: the chat template gives {len(ids)} tokens, the server counts "
            f"{usage['prompt_tokens']}"
        )
    print(f"tokenizer: {len(STRINGS)} strings encode to kiln's ids and counts")


def walk(value, key):
    """Every value stored under `key` anywhere in a JSON document."""
    if isinstance(value, dict):
        for k, v in value.items():
            if k == key:
                yield v
            yield from walk(v, key)
    elif isinstance(value, list):
        for v in value:
            yield from walk(v, key)


def check_report(path: str, profile: str) -> None:
    with open(path, encoding="utf-8") as f:
        report = json.load(f)
    benchmarks = report.get("benchmarks") or []
    assert len(benchmarks) == 1, f"{path}: {len(benchmarks)} benchmarks, expected 1"
    b = benchmarks[0]
    totals = b["metrics"]["request_totals"]
    ok, errored, incomplete = totals["successful"], totals["errored"], totals["incomplete"]
    summary = f"{profile}: {ok} successful, {errored} errored, {incomplete} incomplete"
    if errored or ok == 0:
        errors = [e for e in walk(b, "error") if e][:3]
        raise AssertionError(f"{summary}; first errors: {errors}")
    # Incomplete requests are the ones cut off when --max-seconds ran out, not failures.
    print(f"guidellm {summary}")


def main() -> None:
    if sys.argv[1:2] == ["tokenizer"] and len(sys.argv) == 6:
        check_tokenizer(*sys.argv[2:])
    elif sys.argv[1:2] == ["report"] and len(sys.argv) == 4:
        check_report(*sys.argv[2:])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        sys.exit(f"guidellm smoke: {e}")
