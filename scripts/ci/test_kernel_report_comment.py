"""Tests of kernel_report_comment.py on recorded reports (scripts/ci/fixtures/)."""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(__file__))
import kernel_report_comment as krc  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def fixture(name):
    with open(os.path.join(FIXTURES, name), encoding="utf-8") as f:
        return f.read()


class CommentBody(unittest.TestCase):
    def test_a_recorded_report_with_no_change_says_so_and_folds_the_report(self):
        report = fixture("kernels-compare-epyc-2026-12-01.md")
        b = krc.body(report, "https://example.invalid/run/1")
        self.assertTrue(b.startswith(krc.MARKER + "\n"))
        self.assertIn("24 within noise (of 24 compared", b)
        self.assertNotIn("| benchmark |", b.split("<details>")[0])
        self.assertIn("Measured by [this run](https://example.invalid/run/1).", b)
        self.assertIn("| `qmv/q8_g64_n896_k4864_m1/t2` | 228.53 µs |", b.split("<details>")[1])
        self.assertTrue(b.endswith("</details>\n"))

    def test_regressed_and_improved_rows_are_listed_above_the_fold(self):
        b = krc.body(fixture("kernels-compare-regressed.md"))
        top = b.split("<details>")[0]
        self.assertIn("**1 regressed**, **1 improved**, 2 within noise (of 4 compared", top)
        self.assertIn("| `qmv/q4_g64_n4096_k4096_m1/t1` | 964.21 µs | 1.283 ms | 1.331 [1.202, 1.474] | **regressed** | 9.8 / 7.4 | 26% / 20% |", top)
        self.assertIn("| **improved** |", top)
        self.assertNotIn("qmv_wide", top)
        self.assertIn("| GB/s A / B | % of read BW A / B |", top)

    def test_a_report_without_a_table_and_a_report_too_long_for_a_comment(self):
        self.assertIn("did not run", krc.body("## Kernel benchmarks\n\nerror: build failed\n"))
        report = fixture("kernels-compare-regressed.md")
        row = report.splitlines()[-3]
        long = report + "\n".join([row] * 2000)
        b = krc.body(long)
        self.assertLessEqual(len(b), krc.LIMIT)
        self.assertIn("(report cut here", b)
        self.assertTrue(b.endswith("</details>\n"))

    def test_a_missing_report_exits_2_naming_it(self):
        self.assertEqual(krc.main(["/nonexistent/report.md"]), 2)


if __name__ == "__main__":
    unittest.main()
