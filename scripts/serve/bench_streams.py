"""Concurrent streaming load against a running `kiln serve`, standard library only.

For each concurrency level N, N clients at once send a completion of a prompt of exactly
P token ids (distinct per request, so the prompt cache cannot help) with max_tokens T and
ignore_eos, streaming, and the script reports per level:

- decode tok/s per stream: (tokens - 1) / (last token time - first token time);
- aggregate decode tok/s: the sum of those over the N streams (they run together);
- end-to-end aggregate tok/s: all completion tokens / (last finish - first send);
- mean time to first token;
- the scheduler's share of its steps spent outside the forward, from /metrics.

Usage: bench_streams.py URL MODEL [--levels 1,2,4,8] [--prompt-tokens 128]
       [--max-tokens 128] [--repeats 1]
One JSON object per level is printed on its own line.
"""

import argparse
import http.client
import json
import random
import threading
import time
import urllib.parse


def metrics(url: urllib.parse.ParseResult) -> dict:
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    conn.request("GET", "/metrics")
    body = conn.getresponse().read().decode()
    out = {}
    for line in body.splitlines():
        if line and not line.startswith("#") and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def one_stream(url, model, prompt, max_tokens, result):
    body = json.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=600)
    sent = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        result["error"] = f"status {resp.status}: {resp.read()[:300]!r}"
        return
    first = last = None
    tokens = None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            break
        event = json.loads(data)
        now = time.perf_counter()
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
            continue
        # Token chunks only (the server sends one per sampled token), not the finish chunk.
        if not event["choices"] or event["choices"][0].get("finish_reason"):
            continue
        if first is None:
            first = now
        last = now
    result.update(sent=sent, first=first, last=last, done=time.perf_counter(), tokens=tokens)


def level(url, model, n, prompt_tokens, max_tokens):
    rng = random.Random(n * 7919 + int(time.time()))
    prompts = [[rng.randrange(32, 127) for _ in range(prompt_tokens)] for _ in range(n)]
    results = [{} for _ in range(n)]
    before = metrics(url)
    threads = [
        threading.Thread(target=one_stream, args=(url, model, prompts[i], max_tokens, results[i])) for i in range(n)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = metrics(url)
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise SystemExit(f"level {n}: {errors[0]}")
    rates = [(r["tokens"] - 1) / max(r["last"] - r["first"], 1e-9) for r in results]
    wall = max(r["done"] for r in results) - min(r["sent"] for r in results)
    step = after["kiln_step_seconds_total"] - before["kiln_step_seconds_total"]
    fwd = after["kiln_forward_seconds_total"] - before["kiln_forward_seconds_total"]
    steps = after["kiln_decode_steps_total"] - before["kiln_decode_steps_total"]
    return {
        "streams": n,
        "decode_tok_s_per_stream": round(sum(rates) / n, 2),
        "decode_tok_s_aggregate": round(sum(rates), 2),
        "e2e_tok_s_aggregate": round(sum(r["tokens"] for r in results) / wall, 2),
        "ttft_s_mean": round(sum(r["first"] - r["sent"] for r in results) / n, 3),
        "decode_steps": int(steps),
        "step_ms_mean": round(1e3 * step / max(steps, 1), 2),
        "scheduler_share_outside_forward": round(1 - fwd / step, 4) if step > 0 else None,
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("model")
    p.add_argument("--levels", default="1,2,4,8")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1)
    a = p.parse_args()
    url = urllib.parse.urlparse(a.url)
    # Warm-up: one short request so first-touch costs are not measured.
    level(url, a.model, 1, 16, 4)
    for _ in range(a.repeats):
        for n in [int(x) for x in a.levels.split(",")]:
            print(json.dumps(level(url, a.model, n, a.prompt_tokens, a.max_tokens)), flush=True)


if __name__ == "__main__":
    main()
