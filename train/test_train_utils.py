#!/usr/bin/python3
"""Unit tests of the corpus and batch rules (no torch needed for the corpus part):
  /usr/bin/python3 train/test_train_utils.py
"""
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import build_corpus as bc  # noqa: E402


class CorpusRules(unittest.TestCase):
    def test_categories(self):
        self.assertEqual(bc.category_of("/usr/lib/python3.11/json/decoder.py"), "code")
        self.assertIsNone(bc.category_of("/usr/lib/python3.11/test/test_json.py"))
        self.assertEqual(bc.category_of("/usr/include/c++/12/vector"), "code")
        self.assertEqual(bc.category_of("/usr/share/doc/gdb/check.log.gz"), "logs")
        self.assertEqual(bc.category_of("/usr/share/doc/git/changelog.gz"), "logs")
        self.assertEqual(bc.category_of("/usr/share/man/man2/open.2.gz"), "manuals")
        self.assertIsNone(bc.category_of("/usr/share/man/de/man1/ls.1.gz"))
        self.assertEqual(bc.category_of("/usr/share/common-licenses/GPL-3"), "prose")
        self.assertIsNone(bc.category_of("/usr/share/doc/git/copyright"))

    def test_cap_cuts_at_a_newline_and_ends_with_one(self):
        self.assertEqual(bc.cap(b"ab\ncd\nef", 7), b"ab\ncd\n")
        self.assertEqual(bc.cap(b"abc", 10), b"abc\n")
        self.assertEqual(bc.cap(b"abcdef", 3), b"abc\n")  # no newline before the cap

    def test_packages_list_is_read(self):
        self.assertIn("manpages-dev", bc.PACKAGES)
        self.assertEqual(len(bc.PACKAGES), len(set(bc.PACKAGES)))


class BatchRules(unittest.TestCase):
    def setUp(self):
        try:
            import train  # noqa: F401  (needs torch)
        except ImportError:
            self.skipTest("torch not installed")

    def test_restore_points_even_and_half_restored(self):
        import train
        s = train.restore_points(0, 7, 8, 256, 16).tolist()
        self.assertEqual(s[0::2], [0, 0, 0, 0])
        for v in s[1::2]:
            self.assertTrue(2 <= v <= 256 - 32 and v % 2 == 0, v)

    def test_batches_depend_only_on_seed_and_step(self):
        import train
        a = train.batch_offsets(0, 5, 10_000, 4, 256).tolist()
        self.assertEqual(a, train.batch_offsets(0, 5, 10_000, 4, 256).tolist())
        self.assertNotEqual(a, train.batch_offsets(0, 6, 10_000, 4, 256).tolist())

    def test_windows_start_with_bos_then_bytes_plus_3(self):
        import numpy as np
        import train
        ids = train.windows(np.frombuffer(b"hello world", dtype=np.uint8), [6], 5)
        self.assertEqual(ids.tolist(), [[0] + [c + 3 for c in b"world"]])


class TraineeRules(unittest.TestCase):
    """The routing-bias rule reads the reference MoE's own expert loads; stages chain by sha256."""

    def setUp(self):
        try:
            import train  # noqa: F401  (needs torch)
        except ImportError:
            self.skipTest("torch not installed")
        import json
        import torch
        import train
        from reference.config import Config
        root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
        self.model_path = os.path.join(root, "deploy/models/kvmini-trained.safetensors")
        with open(os.path.join(root, "deploy/models/kvmini-trained.json")) as f:
            self.cfg = Config(json.load(f))
        torch.manual_seed(0)
        self.model = train.Trainee(self.cfg)
        self.ids = torch.randint(3, 259, (2, 12))

    def test_training_passes_count_every_routed_token_once_per_layer(self):
        self.model.train()
        self.model(self.ids)
        c = self.cfg
        self.assertEqual(sorted(self.model.expert_load), list(range(c.num_hidden_layers)))
        for counts in self.model.expert_load.values():
            self.assertEqual(counts.shape[0], c.n_routed_experts)
            self.assertEqual(int(counts.sum()), self.ids.numel() * c.num_experts_per_tok)

    def test_bias_moves_against_load_and_eval_passes_do_not_count(self):
        import torch
        self.model.train()
        self.model(self.ids)
        load = self.model.expert_load[3].float()
        before = self.model.p(3, "ffn.gate.bias").clone()
        self.model.update_routing_bias(0.5)
        moved = self.model.p(3, "ffn.gate.bias") - before
        self.assertTrue(torch.equal(moved, 0.5 * torch.sign(load.mean() - load)))
        self.assertEqual(self.model.expert_load, {})
        self.model.eval()
        with torch.no_grad():
            self.model(self.ids)
        self.assertIsNone(self.model.expert_load)

    def test_the_plain_reference_counts_nothing(self):
        import torch
        from reference.model import MiniV41
        m = MiniV41(self.cfg)
        with torch.no_grad():
            m(self.ids)
        self.assertIsNone(m.expert_load)

    def test_init_from_checks_the_pinned_sha256(self):
        import torch
        import train
        with open(self.model_path + ".sha256") as f:
            digest = f.read().split()[0]
        with self.assertRaises(ValueError):
            train.init_from(self.model, self.model_path, "0" * 64)
        train.init_from(self.model, self.model_path, digest)
        from reference.model import load
        ref = load(self.model_path, self.cfg)
        self.assertTrue(torch.equal(self.model.p(5, "ffn.gate.bias"), ref.p(5, "ffn.gate.bias")))


class DSparkTrainingRules(unittest.TestCase):
    """train_dspark's self-distillation mix and its pinned --init."""

    def setUp(self):
        try:
            import torch  # noqa: F401
        except ImportError:
            self.skipTest("torch not installed")

    def test_mix_self_replaces_the_last_rows_deterministically(self):
        import torch
        import train_dspark as td
        ids = torch.arange(4 * 6).view(4, 6)
        self_ids = 100 + torch.arange(5 * 6).view(5, 6)
        a = td.mix_self(ids.clone(), self_ids, 0, 7, 2)
        self.assertTrue(torch.equal(a[:2], ids[:2]))  # corpus rows kept
        for r in (2, 3):  # every replaced row is a whole self row
            self.assertTrue(any(torch.equal(a[r], self_ids[k]) for k in range(5)))
        self.assertTrue(torch.equal(a, td.mix_self(ids.clone(), self_ids, 0, 7, 2)))
        steps = [td.mix_self(ids.clone(), self_ids, 0, s, 2)[2:].tolist() for s in range(8)]
        self.assertGreater(len(set(map(str, steps))), 1)  # rows depend on the step
        self.assertTrue(torch.equal(td.mix_self(ids.clone(), self_ids, 0, 7, 0), ids))

    def test_self_text_files_are_joined_in_order_and_checked(self):
        import tempfile
        import numpy as np
        import train_dspark as td
        with tempfile.TemporaryDirectory() as d:
            a = np.arange(2 * 10, dtype=np.int16).reshape(2, 10)
            b = 100 + np.arange(3 * 12, dtype=np.int16).reshape(3, 12)
            pa, pb = os.path.join(d, "a.npy"), os.path.join(d, "b.npy")
            np.save(pa, a)
            np.save(pb, b)
            got = td.load_self_text([pa, pb], 8, 512)
            self.assertEqual(got.tolist(), a[:, :8].tolist() + b[:, :8].tolist())
            self.assertEqual(td.load_self_text([pa], 8, 512).tolist(), a[:, :8].tolist())
            with self.assertRaises(ValueError):  # a file shorter than seq
                td.load_self_text([pb, pa], 11, 512)
            with self.assertRaises(ValueError):  # an id outside the vocabulary
                td.load_self_text([pa, pb], 8, 120)
            pf = os.path.join(d, "f.npy")
            np.save(pf, a.astype(np.float32))
            with self.assertRaises(ValueError):  # not token ids
                td.load_self_text([pf], 8, 512)
            limit = td.SELF_TEXT_ROWS_MAX
            try:
                td.SELF_TEXT_ROWS_MAX = 4  # a and b hold 5 rows together
                with self.assertRaises(ValueError):
                    td.load_self_text([pa, pb], 8, 512)
                self.assertEqual(len(td.load_self_text([pb], 8, 512)), 3)
            finally:
                td.SELF_TEXT_ROWS_MAX = limit

    def test_anchors_start_at_anchor_min_and_default_to_the_old_draws(self):
        import numpy as np
        import train_dspark as td
        old = np.random.default_rng((3, 5, 7)).integers(1, 256 - 5 + 1, size=(8, 64))
        self.assertEqual(td.draw_anchors(3, 5, 8, 64, 256, 5).tolist(), old.tolist())
        a = td.draw_anchors(3, 5, 8, 64, 256, 5, anchor_min=97)
        self.assertEqual(tuple(a.shape), (8, 64))
        self.assertGreaterEqual(int(a.min()), 97)
        self.assertLessEqual(int(a.max()), 256 - 5)
        self.assertEqual(td.draw_anchors(3, 5, 8, 64, 256, 5, 97).tolist(), a.tolist())
        edge = td.draw_anchors(0, 0, 2, 16, 32, 5, anchor_min=27)  # a single allowed position
        self.assertEqual(set(edge.flatten().tolist()), {27})

    def test_hard_weight_adds_the_cross_entropy_to_the_teacher_argmax(self):
        import torch
        import torch.nn.functional as F
        import train_dspark as td
        g = torch.Generator().manual_seed(0)
        draft = torch.randn(3, 5, 7, generator=g)
        teacher = torch.randn(3, 5, 7, generator=g)
        loss0, kl0 = td.distill_loss(draft, teacher)
        ref_kl = F.kl_div(torch.log_softmax(draft, -1), torch.log_softmax(teacher, -1),
                          log_target=True, reduction="none").sum(-1).mean()
        self.assertTrue(torch.allclose(kl0, ref_kl, atol=1e-6))
        self.assertTrue(torch.equal(loss0, kl0))  # weight 0: the KL alone
        loss, kl = td.distill_loss(draft, teacher, hard_weight=0.5)
        self.assertTrue(torch.equal(kl, kl0))
        ce = F.cross_entropy(draft.reshape(-1, 7), teacher.argmax(-1).reshape(-1))
        self.assertTrue(torch.allclose(loss, kl0 + 0.5 * ce, atol=1e-6))
        # The hard term pulls the draft's argmax to the teacher's even where the KL is 0.
        same = teacher.clone().requires_grad_(True)
        l2, k2 = td.distill_loss(same, teacher, hard_weight=1.0)
        self.assertLess(float(k2), 1e-6)
        l2.backward()
        top = teacher.argmax(-1, keepdim=True)
        self.assertTrue(bool((same.grad.gather(-1, top) < 0).all()))

    def test_init_draft_checks_the_pinned_sha256(self):
        import json
        import torch
        import train_dspark as td
        from reference.config import Config
        from reference.dspark import DSpark, load
        root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
        path = os.path.join(root, "deploy/models/kvmini-trained-dspark.safetensors")
        with open(os.path.join(root, "deploy/models/kvmini-trained.json")) as f:
            cfg = Config(json.load(f))
        bb = td.load_backbone(cfg, os.path.join(root, "deploy/models/kvmini-trained.safetensors"))
        with open(path + ".sha256") as f:
            digest = f.read().split()[0]
        torch.manual_seed(0)
        draft = DSpark(cfg, bb)
        with self.assertRaises(ValueError):
            td.init_draft(draft, path, "0" * 64)
        td.init_draft(draft, path, digest)
        ref = load(path, cfg, bb).engine_tensors()
        got = draft.engine_tensors()
        self.assertEqual(sorted(got), sorted(ref))
        self.assertTrue(all(torch.equal(got[n], ref[n]) for n in ref))

    def test_stop_after_writes_the_checkpoint_of_that_step(self):
        import subprocess
        import tempfile
        import numpy as np
        root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
        with tempfile.TemporaryDirectory() as d:
            rng = np.random.default_rng(0)
            os.mkdir(os.path.join(d, "corpus"))
            for name, n in (("train.txt", 4096), ("val.txt", 1024)):
                rng.integers(32, 127, n, dtype=np.uint8).tofile(os.path.join(d, "corpus", name))
            np.save(os.path.join(d, "self.npy"), rng.integers(3, 259, (3, 40)).astype(np.int16))

            def run(out, *extra):
                subprocess.run(
                    [sys.executable, os.path.join(root, "train/train_dspark.py"),
                     "--config", os.path.join(root, "deploy/models/kvmini-trained.json"),
                     "--backbone", os.path.join(root, "deploy/models/kvmini-trained.safetensors"),
                     "--corpus", os.path.join(d, "corpus"), "--out", os.path.join(d, out),
                     "--batch", "2", "--seq", "32", "--anchors", "2", "--val-windows", "1",
                     "--val-every", "1", "--warmup", "1", "--self-text",
                     os.path.join(d, "self.npy"), "--self-frac", "0.5", *extra],
                    check=True, capture_output=True)
                with open(os.path.join(d, out), "rb") as f:
                    return f.read()
            full = run("full.safetensors", "--steps", "3")
            with open(os.path.join(d, "full.safetensors.last"), "rb") as f:
                at2 = f.read()  # the checkpoint at step 2 of 3
            stopped = run("stop.safetensors", "--steps", "3", "--stop-after", "2")
            self.assertEqual(stopped, at2)
            self.assertNotEqual(stopped, full)


if __name__ == "__main__":
    unittest.main()
