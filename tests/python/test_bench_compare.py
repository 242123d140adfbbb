"""bench/cuda/compare_deepgemm.py on made-up bench lines whose answers are known: the graph
ratio divides graph by graph, % of copy uses the graph time and the run's copy rate, a shape
DeepGEMM did not run has no ratio, and the goal lines count what they say."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

from _support import REPO

SCRIPT = REPO / "bench" / "cuda" / "compare_deepgemm.py"


def load():
    spec = importlib.util.spec_from_file_location("compare_deepgemm", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def ours(req, n, avg, graph, eager, key_bytes, copy_gbs=3000.0, both=None, logits=None):
    return {"requests": req, "next_n": n, "avg": avg, "logits_fp8_graph_us": graph,
            "logits_fp8_us": eager, "key_bytes": key_bytes, "copy_gbs": copy_gbs,
            "logits_us": logits if logits is not None else eager,
            "both_us": both if both is not None else 0.0}


def dg(req, n, avg, graph, frac=0.9, meta=2.0, topk=30.0):
    return {"requests": req, "next_n": n, "avg": avg, "logits_graph_us": graph,
            "key_frac_copy_graph": frac, "meta_graph_us": meta, "topk_graph_us": topk}


class CompareDeepGemmTest(unittest.TestCase):
    def setUp(self):
        self.m = load()
        # 64 x 32K n1: 300 MB in 100 us = 3000 GB/s = 100% of a 3000 GB/s copy.
        self.ours = [
            ours(64, 1, 32768, 100.0, 110.0, 300e6, both=121.0, logits=110.0),
            ours(64, 2, 32768, 120.0, 125.0, 300e6, both=150.0, logits=125.0),
            ours(64, 4, 32768, 150.0, 160.0, 300e6),
            ours(1, 1, 131072, 6.5, 9.0, 17e6),
            ours(8, 1, 32768, 13.0, 15.0, 35e6),
        ]
        self.dg = [dg(64, 1, 32768, 104.0), dg(64, 2, 32768, 100.0), dg(1, 1, 131072, 8.0),
                   dg(8, 1, 32768, 13.0)]

    def summary(self):
        key = lambda d: (d["requests"], d["next_n"], d["avg"])  # noqa: E731
        return self.m.summarize({key(d): d for d in self.ours}, {key(d): d for d in self.dg})

    def test_ratios_are_graph_over_graph(self):
        rows = {(r["requests"], r["next_n"], r["avg"]): r for r in self.summary()["rows"]}
        self.assertAlmostEqual(rows[(64, 1, 32768)]["ratio_graph"], 100.0 / 104.0)
        self.assertAlmostEqual(rows[(64, 1, 32768)]["ratio_eager"], 110.0 / 104.0)
        self.assertAlmostEqual(rows[(64, 2, 32768)]["ratio_graph"], 1.2)
        self.assertAlmostEqual(rows[(64, 1, 32768)]["ours_pct_copy"], 100.0)
        self.assertAlmostEqual(rows[(64, 2, 32768)]["ours_pct_copy"], 100.0 * 100.0 / 120.0)
        self.assertNotIn("ratio_graph", rows[(64, 4, 32768)])  # DeepGEMM stops at next_n 2
        self.assertAlmostEqual(rows[(64, 1, 32768)]["dg_sequence_us"], 2.0 + 104.0 + 30.0)

    def test_goals(self):
        g = self.summary()["goals"]
        self.assertEqual(g["shapes_compared"], 4)
        # 64 x 32K n1 (0.96) and 1 x 128K (0.81) and 8 x 32K (1.00) are at or under.
        self.assertEqual(g["shapes_at_or_under_deepgemm"], 3)
        self.assertAlmostEqual(g["ratio_graph_max"], 1.2)
        self.assertEqual(g["pct_copy_shapes"], 2)
        self.assertEqual(g["pct_copy_shapes_at_92"], 1)
        self.assertAlmostEqual(g["n4_over_n1_64x32k"], 1.5)
        self.assertEqual(g["1x128k_n1_us"], 6.5)
        self.assertEqual(g["8x32k_n1_us"], 13.0)
        self.assertEqual(g["both_over_logits_from_64x32k"], [1.1, 1.2])

    def test_command_line(self):
        with tempfile.TemporaryDirectory() as tmp:
            a, b, j = Path(tmp, "ours.json"), Path(tmp, "dg.json"), Path(tmp, "s.json")
            a.write_text("".join(json.dumps(d) + "\n" for d in self.ours))
            b.write_text("".join(json.dumps(d) + "\n" for d in self.dg))
            done = subprocess.run([sys.executable, str(SCRIPT), str(a), str(b), "--json", str(j)],
                                  capture_output=True, text=True, check=True)
            self.assertIn("| 64 | 1 | 32K | 100.0 | 110.0 | 104.0 | 0.96 | 1.06 | 100% | 90% |",
                          done.stdout)
            self.assertIn("logits <= DeepGEMM's: 3 of 4 shapes", done.stdout)
            self.assertEqual(json.loads(j.read_text())["goals"]["shapes_compared"], 4)


if __name__ == "__main__":
    unittest.main()
