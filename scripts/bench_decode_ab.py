#!/usr/bin/env python3
"""Decode speed and CPU per token of two kiln binaries, interleaved (A B B A per round).

Usage:
  scripts/bench_decode_ab.py OLD_KILN NEW_KILN [--models M,..] [--threads 1,2]
      [--positions 128,512] [--tokens 129] [--rounds 3] [--cpu] [--out FILE.json]

Each cell (model, threads, prompt positions) runs `kiln bench-decode` four times per
round, in the order old, new, new, old. With `--cpu` each of those runs is paired with a
run of the same binary at one generated token: the CPU time (user + system, from wait4)
of the full run minus that of the one-token run, over the decode steps, is the CPU per
token (on a loaded machine the difference is noisy; crates/kiln-model/examples/decode_ab.rs
measures it step by step inside one process).
Once per round and thread count the read bandwidth is probed (`--measure-bandwidth` on
synthetic:tiny), so every cell can be stated against bandwidth / bytes per token, with
bytes per token = the model's bytes read per token + the f16 KV cache read at the
cell's mean depth. Standard library only; prints a table and writes every run as JSON.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys


def run(binary, args):
    """Runs `binary bench-decode args`; returns (record, cpu seconds)."""
    proc = subprocess.Popen([binary, "bench-decode", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.stdout.read(), proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"error: {binary} bench-decode {' '.join(args)} exited {proc.returncode}:\n{err.decode()}")
    return json.loads(out.decode().strip().splitlines()[-1]), usage.ru_utime + usage.ru_stime


def kv_bytes_per_position(record):
    """Bytes of f16 keys and values one position adds, from the run's KV share."""
    kv = record["peak_breakdown"]["kv"]
    return kv / max(1, record["prompt_tokens"] + record["generated_tokens"])


def mean_ci(xs):
    """The mean and the range (min, max) of the values."""
    return statistics.mean(xs), (min(xs), max(xs))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--models", default="synthetic:smollm-135m,synthetic:qwen2.5-0.5b")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--positions", default="128,512")
    p.add_argument("--tokens", type=int, default=129)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    models = a.models.split(",")
    threads = [int(t) for t in a.threads.split(",")]
    positions = [int(n) for n in a.positions.split(",")]
    rows = []
    bw = {t: [] for t in threads}
    for rnd in range(a.rounds):
        for t in threads:
            rec, _ = run(a.new, ["-m", "synthetic:tiny", "--prompt-tokens", "8", "-n", "2",
                                 "--threads", str(t), "--measure-bandwidth"])
            bw[t].append(rec["read_bandwidth_bytes_per_s"])
            for m in models:
                for pos in positions:
                    base = ["-m", m, "--prompt-tokens", str(pos), "--threads", str(t)]
                    for which in ("old", "new", "new", "old"):
                        binary = a.old if which == "old" else a.new
                        rec, cpu = run(binary, base + ["-n", str(a.tokens)])
                        cpu1 = run(binary, base + ["-n", "1"])[1] if a.cpu else float("nan")
                        steps = rec["decode_steps"]
                        depth = pos + (a.tokens + 1) / 2
                        bytes_tok = rec["bytes_read_per_token"] + kv_bytes_per_position(rec) * depth
                        row = {
                            "round": rnd, "model": m, "threads": t, "positions": pos, "binary": which,
                            "decode_tok_s": rec["decode_tok_s"], "cpu_ms_per_token": 1e3 * (cpu - cpu1) / steps,
                            "bytes_per_token": bytes_tok, "read_bandwidth": bw[t][-1],
                        }
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"rows": rows, "bandwidth": bw}, f, indent=1)
    print()
    print("| model | threads | positions | old tok/s | new tok/s | new/old tok/s | new/old CPU per token "
          "| old share of bw/bytes | new share of bw/bytes |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for m in models:
        for t in threads:
            for pos in positions:
                cell = [r for r in rows if (r["model"], r["threads"], r["positions"]) == (m, t, pos)]
                ratios, cpu_ratios, shares, old_shares = [], [], [], []
                olds, news = [], []
                for rnd in range(a.rounds):
                    rr = [r for r in cell if r["round"] == rnd]
                    o = [r for r in rr if r["binary"] == "old"]
                    n = [r for r in rr if r["binary"] == "new"]
                    olds += [r["decode_tok_s"] for r in o]
                    news += [r["decode_tok_s"] for r in n]
                    ratios.append(statistics.mean(r["decode_tok_s"] for r in n) /
                                  statistics.mean(r["decode_tok_s"] for r in o))
                    cpu_ratios.append(statistics.mean(r["cpu_ms_per_token"] for r in n) /
                                      statistics.mean(r["cpu_ms_per_token"] for r in o))
                    shares += [r["decode_tok_s"] * r["bytes_per_token"] / r["read_bandwidth"] for r in n]
                    old_shares += [r["decode_tok_s"] * r["bytes_per_token"] / r["read_bandwidth"] for r in o]
                r_m, r_s = mean_ci(ratios)
                c_m, c_s = mean_ci(cpu_ratios)
                s_m, s_s = mean_ci(shares)
                o_m, o_s = mean_ci(old_shares)
                print(f"| {m} | {t} | {pos} | {statistics.mean(olds):.1f} | {statistics.mean(news):.1f} "
                      f"| {r_m:.2f} [{r_s[0]:.2f}, {r_s[1]:.2f}] | {c_m:.2f} [{c_s[0]:.2f}, {c_s[1]:.2f}] "
                      f"| {o_m:.2f} [{o_s[0]:.2f}, {o_s[1]:.2f}] | {s_m:.2f} [{s_s[0]:.2f}, {s_s[1]:.2f}] |")


if __name__ == "__main__":
    main()
