"""Benchmark tooling that needs no GPU: bench.py's FLOPs and --clocks sampler
(run against a stand-in nvidia-smi), scripts/ncu_regions.py on a synthetic export."""
import csv
import importlib.util
import os
import pathlib
import stat
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _bench():
  spec = importlib.util.spec_from_file_location("bench", ROOT / "benchmarks" / "bench.py")
  mod = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = mod  # dataclasses look their module up while it loads
  spec.loader.exec_module(mod)
  return mod


def test_flops_follow_the_paper():
  b = _bench()
  f = b.attn_flops(2, 16, 8192, 128, False)
  assert f == 4.0 * 2 * 16 * 8192 ** 2 * 128
  assert b.attn_flops(2, 16, 8192, 128, True) == f / 2
  assert b.attn_flops(2, 16, 8192, 128, False, "bwd") == 2.5 * f


def test_flops_with_a_value_head_dim():
  b = _bench()
  # dv == d (or 0) is the paper's count, masks and window included.
  for causal, win in ((False, -1), (True, -1), (True, 1000)):
    for mode in ("fwd", "bwd"):
      assert b.attn_flops(2, 16, 8192, 128, causal, mode, win, 128) == b.attn_flops(
          2, 16, 8192, 128, causal, mode, win)
  # 192/128: forward QK^T over 192 and PV over 128; backward S again, dQ, dK
  # over 192, dP, dV over 128.
  s2 = 8192 ** 2
  assert b.attn_flops(2, 16, 8192, 192, False, hdim_v=128) == 2 * 2 * 16 * s2 * (192 + 128)
  assert b.attn_flops(2, 16, 8192, 192, False, "bwd", hdim_v=128) == (
      2 * 2 * 16 * s2 * (3 * 192 + 2 * 128))
  assert b.attn_flops(2, 16, 8192, 192, True, "bwd", hdim_v=128) == 2 * 2 * 16 * s2 * 832 / 2
  mla = b.Shape(192, True, 8192, 2, 16, hdim_v=128)
  assert b.shape_flops(mla, "fwd") == 2 * 2 * 16 * s2 * 320 / 2
  # One spelling per shape: a value dim equal to hdim is no value dim.
  assert b.Shape(128, True, 8192, 2, 16, hdim_v=128) == b.Shape(128, True, 8192, 2, 16)
  assert (mla.dv, b.Shape(128, False, 1024, 1, 1).dv) == (128, 128)
  assert (b._hdim_name(mla), b._hdim_name(b.Shape(128, False, 1024, 1, 1))) == ("192/128", "128")


def test_dry_run_of_the_mla_shapes(capsys):
  b = _bench()
  assert b.main(["--shapes", "mla", "--dry-run", "--impls", "fa3,cudnn"]) == 0
  out = capsys.readouterr().out
  assert "# 3 shapes x 2 impls x 2 modes = 12 measurements" in out
  plans = [l for l in out.splitlines() if l.startswith("  d=")]
  assert plans == [
      "  d=192/128 causal=no seqlen= 8192 batch= 2 heads=16: fwd 1.374 TFLOP, bwd 3.573 TFLOP",
      "  d=192/128 causal=yes seqlen= 8192 batch= 2 heads=16: fwd 0.687 TFLOP, bwd 1.787 TFLOP",
      "  d=128/64 causal=yes seqlen= 8192 batch= 2 heads=16: fwd 0.412 TFLOP, bwd 1.100 TFLOP"]
  assert sum("| 192/128 |" in l for l in out.splitlines()) == 8
  # --value-hdim gives the sweep (and the real-model shapes) a value dim.
  args = b.parse_args(["--value-hdim", "64", "--hdims", "128", "--seqlens", "8k"])
  assert b.plan(args.seqlens, args.hdims, args.causals, hdim_v=args.value_hdim) == [
      b.Shape(128, c, 8192, 2, 16, hdim_v=64) for c in (False, True)]
  capsys.readouterr()
  assert b.main(["--shapes", "all", "--value-hdim", "64", "--hdims", "128", "--seqlens", "8k",
                 "--dry-run"]) == 0
  plans = [l for l in capsys.readouterr().out.splitlines() if l.startswith("  d=")]
  assert len(plans) == 2 + len(b.REAL_SHAPES) and all(l.startswith("  d=128/64 ") for l in plans)


def test_window_flops_and_real_shapes():
  b = _bench()
  # (4096, 0) window at 16k: rows 0..4095 see i + 1 keys, the rest 4097.
  pairs = sum(min(i, 4096) + 1 for i in range(16384))
  assert b.attn_flops(1, 16, 16384, 128, True, window_left=4096) == 4.0 * 16 * 128 * pairs
  # A window as long as the sequence is plain causal.
  assert b.attn_flops(1, 16, 4096, 128, True, window_left=5000) == b.attn_flops(
      1, 16, 4096, 128, True)
  names = {b._mask_name(s) for s in b.REAL_SHAPES}
  assert names == {"yes", "w4096"}
  assert {b._heads(s) for s in b.REAL_SHAPES} == {"32/8", "64/8", "8/1", "16"}


def test_clock_reason_shares():
  b = _bench()
  assert b.clock_reason_shares([]) == ""
  assert b.clock_reason_shares([None, None]) == ""
  assert b.clock_reason_shares([0, 0]) == ""
  assert b.clock_reason_shares([0x4 | 0x8, 0x4, 0, 0]) == "sw_power_cap:50%;hw_slowdown:25%"


def test_clock_sampler_parses_nvidia_smi(tmp_path, monkeypatch):
  fake = tmp_path / "nvidia-smi"
  fake.write_text("#!/bin/sh\n"
                  "while true; do\n"
                  "  echo '1830, 450.25, 0x0000000000000004'\n"
                  "  echo 'garbage'\n"
                  "  echo '1980, 300.00, [N/A]'\n"
                  "  sleep 0.02\n"
                  "done\n")
  fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
  monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
  b = _bench()
  with b.ClockSampler(period_ms=20) as sampler:
    time.sleep(0.3)
  assert sampler.samples, "no samples parsed"
  assert (1830.0, 450.25, 4) in sampler.samples
  assert (1980.0, 300.0, None) in sampler.samples
  assert all(len(s) == 3 for s in sampler.samples)


def test_results_csv_round_trip_and_replot(tmp_path):
  b = _bench()
  shape = b.Shape(128, True, 8192, 2, 16, 4)
  rows = [b.Row("fa3", "fwd", "bfloat16", shape, 1.5, 700.0, None, 40, "ok", 1800.0, 450.0,
                "sw_power_cap:100%"),
          b.Row("cudnn", "fwd", "bfloat16", shape, 1.65, 636.4, None, 38),
          b.Row("cudnn", "bwd", "bfloat16", shape, status="OOM")]
  b.fill_ratios(rows)
  path = tmp_path / "run" / "results.csv"
  b.write_csv(rows, str(path))
  back = b.read_csv(str(path))
  key = lambda r: (r.impl, r.mode)  # noqa: E731
  for want, got in zip(sorted(rows, key=key), sorted(back, key=key)):
    assert (got.impl, got.mode, got.dtype, got.shape, got.iters, got.status, got.clock_reasons) == (
        want.impl, want.mode, want.dtype, want.shape, want.iters, want.status, want.clock_reasons)
    for a, c in ((got.ms, want.ms), (got.tflops, want.tflops), (got.ratio, want.ratio),
                 (got.sm_mhz, want.sm_mhz)):
      assert (a is None) == (c is None) and (a is None or abs(a - c) <= 5e-3 * abs(c))
  assert abs(next(r for r in back if r.impl == "fa3").ratio - 700.0 / 636.4) < 1e-3
  # The value head dim round-trips; a CSV written before it existed reads as hdim.
  mla = b.Shape(192, True, 8192, 2, 16, hdim_v=128)
  b.write_csv([b.Row("fa3", "bwd", "bfloat16", mla, 2.0, 600.0)], str(tmp_path / "mla.csv"))
  assert [r.shape for r in b.read_csv(str(tmp_path / "mla.csv"))] == [mla]
  with open(path, newline="") as f:
    old = [{k: v for k, v in d.items() if k != "hdim_v"} for d in csv.DictReader(f)]
  with open(tmp_path / "old.csv", "w", newline="") as f:
    w = csv.DictWriter(f, [k for k in b.CSV_FIELDS if k != "hdim_v"])
    w.writeheader()
    w.writerows(old)
  assert sorted((r.impl, r.mode, r.shape) for r in b.read_csv(str(tmp_path / "old.csv"))) == sorted(
      (r.impl, r.mode, r.shape) for r in rows)
  out = tmp_path / "plot"
  rc = b.main(["--replot", str(path), "--out", str(out)])
  if b.pyplot() is not None:  # the plot needs matplotlib; the table does not
    assert rc == 0 and (out / "bench.png").stat().st_size > 1000


def test_softmax_reference_matches_jax_nn_and_numpy(cpu_backend):
  """check_peer's reference where jax.nn cannot run (Hv != H): jax.nn's xla path
  at Hv == H, a NumPy softmax at Hv != H (GQA, causal, window)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  b = _bench()
  ks = jax.random.split(jax.random.key(3), 3)
  q = jax.random.normal(ks[0], (2, 40, 4, 16))
  k = jax.random.normal(ks[1], (2, 40, 2, 16))
  for causal, win in ((False, -1), (True, -1), (True, 7)):
    v = jax.random.normal(ks[2], (2, 40, 2, 16))
    want = jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="xla",
        local_window_size=None if win < 0 else (win, 0))
    np.testing.assert_allclose(b.softmax_attention(q, k, v, causal, win), want,
                               rtol=1e-5, atol=1e-5)
    v = jax.random.normal(ks[2], (2, 40, 2, 8))
    qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
    kn, vn = np.repeat(kn, 2, axis=2), np.repeat(vn, 2, axis=2)
    s = np.einsum("btnh,bsnh->bnts", qn, kn) / 4.0
    i, j = np.arange(40)[:, None], np.arange(40)[None, :]
    keep = (j <= i if causal else np.ones((40, 40), bool)) & (j >= i - win if win >= 0 else True)
    p = np.exp(np.where(keep, s, -np.inf) - np.where(keep, s, -np.inf).max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(b.softmax_attention(q, k, v, causal, win),
                               np.einsum("bnts,bsnh->btnh", p, vn), rtol=1e-5, atol=1e-5)


def test_check_peer_with_a_value_head_dim(cpu_backend, monkeypatch):
  """check_peer at Hv != H: jax_fa3's reference passes, a wrong result and
  wrong gradients fail, and cuDNN off a GPU is unavailable."""
  import jax
  import jax.numpy as jnp
  b = _bench()
  assert b.check_peer("cudnn", b.Shape(64, True, 256, 1, 4, 2, hdim_v=32), jnp.bfloat16,
                      True)[0].startswith("unavailable")
  # The cuDNN route for Hv != H: JAX's cuDNN wrapper, causal, scale 1/sqrt(H).
  fn = b._attn_fn("cudnn", b.Shape(192, True, 8192, 2, 16, hdim_v=128))
  assert fn.func.__module__.endswith("fused_attention_stablehlo")
  assert fn.keywords["mask_type"].name == "CAUSAL" and abs(fn.keywords["scale"] - 192 ** -0.5) < 1e-12
  jax_fa3 = b._import_jax_fa3()
  attn_fn = b._attn_fn
  peers = {
      "good": lambda s: lambda q, k, v: jax_fa3.attention(
          q, k, v, is_causal=s.causal, implementation="reference"),
      "wrong": lambda s: lambda q, k, v: 1.1 * jax_fa3.attention(
          q, k, v, is_causal=s.causal, implementation="reference"),
      # Right values, the gradients of a second, unmasked attention added.
      "badgrad": lambda s: lambda q, k, v: b.softmax_attention(q, k, v, s.causal) + (
          lambda x: x - jax.lax.stop_gradient(x))(b.softmax_attention(q, k, v, False))}
  monkeypatch.setattr(b, "_attn_fn", lambda impl, s: peers[impl](s) if impl in peers
                      else attn_fn(impl, s))
  shape = b.Shape(64, True, 256, 1, 4, 2, hdim_v=32)
  assert b.check_peer("good", shape, jnp.bfloat16, True) == (None, None)
  fwd, _ = b.check_peer("wrong", shape, jnp.bfloat16, False)
  assert fwd and fwd.startswith("out error")
  fwd, grads = b.check_peer("badgrad", shape, jnp.bfloat16, True)
  assert fwd is None and grads and "dq error" in grads


def test_ncu_regions_groups_by_execution_count(tmp_path, capsys):
  """scripts/ncu_regions.py: consecutive instructions with one execution count form
  a region, whose share of the samples and top stall are reported."""
  spec = importlib.util.spec_from_file_location("ncu_regions", ROOT / "scripts" / "ncu_regions.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  hdr = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
         "stall_wait", "stall_barrier", "stall_wait (Not Issued)"]
  rows = [["0x0", "IMAD R1, R2, R3", "10", "16", "10", "0", "0"],      # per tile
          ["0x10", "@P0 BRA 0x40", "30", "16", "0", "30", "0"],
          ["0x20", "MUFU.EX2 R4, R4", "50", "256", "45", "5", "0"],    # per block
          ["0x30", "FADD R5, R5, R4", "10", "256", "10", "0", "0"]]
  path = tmp_path / "src.csv"
  with open(path, "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["Kernel Name", "k"])
    w.writerow(hdr)
    w.writerows(rows)
  assert mod.main([str(path), "--min-share", "0", "--top", "1"]) == 0
  out = capsys.readouterr().out
  regions = [l for l in out.split("hottest")[0].splitlines()[2:] if l.strip()]
  shares = [[t for t in l.split() if t.endswith("%")][0] for l in regions]
  assert shares == ["40.0%", "60.0%"], out
  assert "barrier:30.0" in regions[0] and "BRAx1" in regions[0]
  assert "wait:55.0" in regions[1] and "MUFUx1" in regions[1]
  assert "MUFU.EX2" in out.split("hottest")[1]


def _decode_bench():
  sys.path.insert(0, str(ROOT / "benchmarks"))
  spec = importlib.util.spec_from_file_location("decode_bench", ROOT / "benchmarks" / "decode_bench.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_decode_bench_pages_points_and_check(cpu_backend):
  import jax
  import jax.numpy as jnp
  import numpy as np
  d = _decode_bench()
  assert d.parse_points("1x131072,64X4096") == [(1, 131072), (64, 4096)]
  assert d.kv_bytes(2, 1000, 8, 128) == 2 * 2 * 1000 * 8 * 128 * 2
  # The pool the shuffled table addresses holds every row's tokens in order.
  table, _ = d.paged_layout(3, 150, 64, seed=1)
  assert table.shape == (3, 3) and sorted(table.reshape(-1)) == list(range(9))
  cache = jax.random.normal(jax.random.key(0), (3, 150, 2, 4))
  pool = d.to_pages(cache, table, 64)
  pos = np.arange(150)
  for b in range(3):
    np.testing.assert_array_equal(pool[table[b, pos // 64], pos % 64], cache[b])
  # The check passes the reference itself and rejects a wrong answer.
  seq, _ = d.paged_layout(2, 150, 64, shuffled=False)
  np.testing.assert_array_equal(seq, [[0, 1, 2], [3, 4, 5]])
  args = d.make_point(jax.random.key(2), 2, 100, 3, 4, 2, 16, [64, 32])
  assert d.check("ref", lambda q, k, v, lens, *_: d.reference(q, k, v, lens), args) is None
  wrong = lambda q, k, v, lens, *_: d.reference(q, k, v, lens - 1)  # noqa: E731
  assert d.check("wrong", wrong, args) is not None
  impls = d._impls(["jax_fa3_paged", "jax_fa3_append", "jax_fa3_paged_append"], [64, 32])
  assert sorted(impls) == ["jax_fa3_append", "jax_fa3_paged", "jax_fa3_paged32",
                           "jax_fa3_paged_append"]
  for fn in impls.values():
    assert d.check("pure JAX", fn, args) is None
  # An appending step carries its own caches: repeated calls rewrite the
  # same rows, so they keep giving the read-only answer, and the arrays
  # passed in are never donated.
  for name in d.APPENDING:
    step = d.CarriedCaches(name, impls[name], args)
    first, second = step(*args), step(*args)
    np.testing.assert_array_equal(np.asarray(first), np.asarray(second))
    assert not any(x.is_deleted() for x in args)


def _mask_bias_bench():
  sys.path.insert(0, str(ROOT / "benchmarks"))
  spec = importlib.util.spec_from_file_location("mask_bias_bench",
                                                ROOT / "benchmarks" / "mask_bias_bench.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_mask_bias_bench_cases_and_check(cpu_backend):
  import jax.numpy as jnp
  import numpy as np
  m = _mask_bias_bench()
  b = np.asarray(m.alibi(4, 6, jnp.float32))
  assert b.shape == (1, 4, 6, 6) and b[0, 0, 5, 2] == -(2.0 ** -2) * 3
  assert (np.diagonal(b, axis1=2, axis2=3) == 0).all()
  fn, args, dout = m.nnx_case(1, 64, 4, 2, 16, jnp.bfloat16)
  for name in ("mask", "causal"):
    assert m.verify(fn, name, args, dout) is None, name
  fn, args, dout = m.bias_case(1, 64, 2, 16, jnp.bfloat16)
  assert m.verify(fn, "fa3", args, dout) is None
  # A wrong answer (the bias counted twice) is reported.
  wrong = lambda name: (lambda q, k, v, bias: fn(name)(q, k, v, 2 * bias))  # noqa: E731
  assert m.verify(lambda n: fn(n) if n == "reference" else wrong(n), "fa3", args, dout)
