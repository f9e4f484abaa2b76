#!/usr/bin/env python3
"""Turns `cargo xtask bench-kernels --compare` reports into the pull request's comment.

Usage: kernel_report_comment.py REPORT.md [--run-url URL] > body.md

The body starts with MARKER, which is how the workflow finds its own earlier comment to
update instead of adding another. Above the full report (folded) it says how many
benchmarks regressed, improved or stayed within noise, and lists the regressed and
improved rows, so a reader sees what changed without unfolding anything. A body longer
than GitHub accepts for a comment is cut inside the fold, saying so.
"""

import argparse
import sys

MARKER = "<!-- kiln-kernel-report -->"
# GitHub refuses comment bodies over 65536 characters.
LIMIT = 65000


def rows(report):
    """The comparison table's rows as dicts keyed by its header."""
    header = None
    found = []
    out = []
    for line in report.splitlines():
        line = line.strip()
        if not line.startswith("|"):
            # The comparison's table has ended (or not begun): later tables are others.
            header = None
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if header is None:
            if "verdict" in cells and "benchmark" in cells and not found:
                header = found = cells
            continue
        if all(set(c) <= set("-: ") for c in cells):
            continue
        if len(cells) == len(header):
            out.append(dict(zip(header, cells)))
    return found, out


def verdict(row):
    return row.get("verdict", "").replace("*", "").strip()


def body(report, run_url=None):
    header, table = rows(report)
    tally = {}
    for r in table:
        tally[verdict(r)] = tally.get(verdict(r), 0) + 1
    lines = [MARKER, "### Kernel benchmarks on this pull request", ""]
    if not table:
        lines.append("The report has no comparison table: the benchmarks did not run (see the job log).")
    else:
        order = ["regressed", "improved"] + sorted(v for v in tally if v not in ("regressed", "improved"))
        counts = ", ".join(
            f"**{tally[v]} {v}**" if v in ("regressed", "improved") else f"{tally[v]} {v}" for v in order if v in tally
        )
        lines.append(f"{counts} (of {len(table)} compared, interleaved A/B rounds on one machine).")
        changed = [r for r in table if verdict(r) in ("regressed", "improved")]
        if changed:
            lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            lines += ["| " + " | ".join(r[h] for h in header) + " |" for r in changed]
    if run_url:
        lines += ["", f"Measured by [this run]({run_url})."]
    head = "\n".join(lines) + "\n\n<details><summary>Full report</summary>\n\n"
    tail = "\n</details>\n"
    room = LIMIT - len(head) - len(tail)
    full = report.strip() + "\n"
    if len(full) > room:
        note = "\n\n(report cut here: it is longer than a comment may be; the job summary has all of it)\n"
        full = full[: room - len(note)].rsplit("\n", 1)[0] + note
    return head + full + tail


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("report")
    p.add_argument("--run-url")
    a = p.parse_args(argv)
    try:
        with open(a.report, encoding="utf-8") as f:
            report = f.read()
    except OSError as e:
        print(f"kernel_report_comment: cannot read {a.report}: {e.strerror}", file=sys.stderr)
        return 2
    sys.stdout.write(body(report, a.run_url))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
