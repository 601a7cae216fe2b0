"""CPU tests of the FP8 API: quantization emulation, scale layout,
Hadamard rotation, validation, the reference (emulated) precision="fp8" path
and its straight-through gradient.  The kernels themselves are tested in
tests/test_gpu_fp8.py."""

import numpy as np
import pytest
import jax
import jax.numpy as jnp

import jax_fa3
from jax_fa3 import fp8

F32 = jnp.float32


def _normal(seed, shape, dtype=jnp.bfloat16):
  return jax.random.normal(jax.random.key(seed), shape, F32).astype(dtype)


def _rmse(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.sqrt(np.mean((a - b) ** 2)))


def test_hadamard_rotation_is_orthogonal_and_cancels_in_qk():
  q, k = _normal(0, (1, 9, 2, 64), F32), _normal(1, (1, 11, 2, 64), F32)
  s = fp8.hadamard_signs(64, seed=3)
  assert set(np.unique(np.asarray(s))) == {-1.0, 1.0}
  qr, kr = fp8.rotate(q, s), fp8.rotate(k, s)
  np.testing.assert_allclose(jnp.linalg.norm(qr, axis=-1),
                             jnp.linalg.norm(q, axis=-1), rtol=1e-5)
  dot = lambda a, b: jnp.einsum("bthd,bshd->bhts", a, b,
                                precision=jax.lax.Precision.HIGHEST)
  np.testing.assert_allclose(dot(qr, kr), dot(q, k), atol=2e-5)
  # Same seed, same signs; another seed, other signs.
  np.testing.assert_array_equal(s, fp8.hadamard_signs(64, seed=3))
  assert not np.array_equal(s, fp8.hadamard_signs(64, seed=4))


def test_hadamard_spreads_an_outlier_channel():
  x = jnp.zeros((1, 1, 1, 128), F32).at[..., 5].set(100.0)
  y = fp8.rotate(x, fp8.hadamard_signs(128))
  np.testing.assert_allclose(jnp.abs(y), 100.0 / np.sqrt(128), rtol=1e-6)


@pytest.mark.parametrize("block_rows,seq", [(128, 300), (64, 64), (128, 1)])
def test_quantize_layout_and_error(block_rows, seq):
  x = _normal(2, (2, seq, 3, 64)) * 3
  x8, sc = jax_fa3.quantize_fp8(x, block_rows=block_rows)
  nb = -(-seq // block_rows)
  assert x8.dtype == jnp.float8_e4m3fn and x8.shape == x.shape
  assert sc.dtype == F32 and sc.shape == (2, 3, nb)
  xf = np.asarray(x, np.float32)
  for b in range(2):
    for h in range(3):
      for i in range(nb):
        blk = xf[b, i * block_rows:(i + 1) * block_rows, h]
        np.testing.assert_allclose(sc[b, h, i], np.abs(blk).max() / 448,
                                   rtol=1e-6)
  deq = np.asarray(x8, np.float32) * np.repeat(
      np.swapaxes(np.asarray(sc), 1, 2), block_rows, axis=1)[:, :seq, :, None]
  # e4m3: 3 mantissa bits -> relative error <= 2**-4 (normals); subnormal
  # spacing 2**-9 of the scale.
  scale_b = np.repeat(np.swapaxes(np.asarray(sc), 1, 2), block_rows,
                      axis=1)[:, :seq, :, None]
  assert np.all(np.abs(deq - xf) <= np.abs(xf) * 2.0 ** -4 + scale_b * 2.0 ** -9)
  assert np.abs(np.asarray(x8, np.float32)).max() <= 448


def test_quantize_per_tensor_zero_block_and_hadamard():
  x = _normal(3, (1, 256, 2, 128)).at[:, :128, 0].set(0)
  _, sc = jax_fa3.quantize_fp8(x, block_rows=128)
  assert float(sc[0, 0, 0]) == 1.0  # all-zero block: scale 1, not 0
  _, sc_t = jax_fa3.quantize_fp8(x, block_rows=128, per_tensor=True)
  np.testing.assert_allclose(
      sc_t, np.full(sc_t.shape, np.abs(np.asarray(x, np.float32)).max() / 448), rtol=1e-6)
  x8h, sch = jax_fa3.quantize_fp8(x, block_rows=128, hadamard=True, seed=7)
  deq = x8h.astype(F32) * jnp.repeat(jnp.swapaxes(sch, 1, 2), 128,
                                     axis=1)[..., None]
  # Inverse of x diag(s) H: y H diag(s) (H symmetric, H H = I, s * s = 1).
  back = fp8.rotate(deq, jnp.ones((128,), F32)) * fp8.hadamard_signs(128, 7)
  assert _rmse(back, x) < 0.05


@pytest.mark.parametrize("pow2", [False, True])
def test_quantize_tiny_block_is_finite(pow2):
  # amax / 448 of a tiny block flushes to 0: the scale's floor is the
  # smallest normal, so no 0/0 (NaN) and the value survives.
  x = jnp.zeros((1, 2, 1, 4)).at[0, 0, 0, 0].set(1e-37)
  x8, sc = jax_fa3.quantize_fp8(x, pow2_scales=pow2)
  deq = np.asarray(x8, np.float32) * np.asarray(sc)[..., None, None]
  assert np.isfinite(np.asarray(x8, np.float32)).all() and float(sc.min()) > 0
  np.testing.assert_allclose(deq.ravel()[0], 1e-37, rtol=0.15)
  assert (deq.ravel()[1:] == 0).all()


def test_scale_blocks_follow_the_kernel_tiles():
  assert fp8.Q_BLOCK_ROWS == 128
  assert [fp8.kv_block_rows(d) for d in (64, 128, 256)] == [128, 128, 128]


def _inputs(seed, B=1, T=200, S=260, N=4, K=2, H=64, dtype=jnp.bfloat16):
  return (_normal(seed, (B, T, N, H), dtype), _normal(seed + 1, (B, S, K, H), dtype),
          _normal(seed + 2, (B, S, K, H), dtype))


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_reference_path_close_to_exact(causal):
  q, k, v = _inputs(10)
  ref = jax_fa3.attention(q.astype(F32), k.astype(F32), v.astype(F32),
                          is_causal=causal)
  out = jax_fa3.attention(q, k, v, is_causal=causal, precision="fp8")
  assert out.dtype == q.dtype and out.shape == q.shape
  assert _rmse(out, ref) < 2e-2


def test_fp8_seq_lengths_and_window_zero_rows():
  q, k, v = _inputs(11, B=2)
  ql = jnp.array([200, 7], jnp.int32)
  kl = jnp.array([13, 260], jnp.int32)
  out = jax_fa3.attention(q, k, v, precision="fp8", query_seq_lengths=ql,
                          key_value_seq_lengths=kl, local_window_size=(4, 0))
  ref = jax_fa3.attention(q.astype(F32), k.astype(F32), v.astype(F32),
                          query_seq_lengths=ql, key_value_seq_lengths=kl,
                          local_window_size=(4, 0))
  assert np.all(np.asarray(out[1, 7:], np.float32) == 0)
  assert np.all(np.isfinite(np.asarray(out, np.float32)))
  assert _rmse(out, ref) < 3e-2


def test_fp8_outlier_ordering_emulated():
  # (b)-style inputs: N(0,1) plus N(0, 10^2) on 0.1% of entries.
  B, T, N, H = 1, 512, 2, 128
  keys = jax.random.split(jax.random.key(5), 6)
  def gen(i, j):
    x = jax.random.normal(keys[i], (B, T, N, H), F32)
    m = jax.random.bernoulli(keys[j], 1e-3, x.shape)
    return (x + m * 10 * jax.random.normal(keys[j], x.shape, F32)).astype(jnp.bfloat16)
  q, k, v = gen(0, 1), gen(2, 3), gen(4, 5)
  ref = jax_fa3.attention(q.astype(F32), k.astype(F32), v.astype(F32))
  err = {}
  for bs in (False, True):
    for hd in (False, True):
      out = jax_fa3.attention(q, k, v, precision="fp8", fp8_block_scales=bs,
                              fp8_hadamard=hd)
      assert np.all(np.isfinite(np.asarray(out, np.float32)))
      err[bs, hd] = _rmse(out, ref)
  assert err[True, True] < err[False, False]
  assert err[False, True] < err[False, False]
  assert err[True, True] <= err[True, False]


def test_fp8_grad_is_straight_through():
  q, k, v = _inputs(12, T=64, S=64)
  loss = lambda prec: (lambda q, k, v: jnp.sum(
      jax_fa3.attention(q, k, v, precision=prec).astype(F32) ** 2))
  g8 = jax.grad(loss("fp8"), argnums=(0, 1, 2))(q, k, v)
  g16 = jax.grad(loss(None), argnums=(0, 1, 2))(q, k, v)
  # Same backward at the same inputs; only the incoming cotangent (2 * out)
  # differs by the FP8 forward's error.
  for a, b in zip(g8, g16):
    assert a.shape == b.shape and a.dtype == b.dtype
    assert _rmse(a, b) < 0.1 * float(jnp.sqrt(jnp.mean(b.astype(F32) ** 2))) + 1e-3


def test_fp8_jit_matches_eager():
  q, k, v = _inputs(13, T=33, S=40)
  f = lambda q, k, v: jax_fa3.attention(q, k, v, precision="fp8")
  got, want = jax.jit(f)(q, k, v), f(q, k, v)
  assert got.shape == q.shape and got.dtype == q.dtype
  np.testing.assert_allclose(np.asarray(got, np.float32),
                             np.asarray(want, np.float32), rtol=2e-2,
                             atol=2e-2)


def test_attention_fp8_low_level_reference():
  q, k, v = _inputs(14, H=128)
  s = fp8.hadamard_signs(128, 0)
  q8, qs = jax_fa3.quantize_fp8(q, block_rows=128, hadamard=True, signs=s)
  k8, ks = jax_fa3.quantize_fp8(k, block_rows=fp8.kv_block_rows(128), hadamard=True, signs=s)
  v8, vs = jax_fa3.quantize_fp8(v, block_rows=fp8.kv_block_rows(128))
  out = jax_fa3.attention_fp8(q8, k8, v8, qs, ks, vs, out_dtype=jnp.float16)
  assert out.dtype == jnp.float16
  ref = jax_fa3.attention(q.astype(F32), k.astype(F32), v.astype(F32))
  assert _rmse(out, ref) < 2.5e-2


def test_validation_errors():
  q, k, v = _inputs(15, T=8, S=8)
  with pytest.raises(ValueError, match="softcap"):
    jax_fa3.attention(q, k, v, precision="fp8", softcap=5.0)
  with pytest.raises(ValueError, match="bfloat16 or float16"):
    jax_fa3.attention(q.astype(F32), k.astype(F32), v.astype(F32), precision="fp8")
  with pytest.raises(ValueError, match="fp8_block_scales"):
    jax_fa3.attention(q, k, v, precision="fp8", fp8_block_scales=1)
  for seed in (1.5, 2**64):  # 2**64: PRNGKey's OverflowError before
    with pytest.raises(ValueError, match="fp8_seed"):
      jax_fa3.attention(q, k, v, precision="fp8", fp8_seed=seed)
  with pytest.raises(ValueError, match="power-of-two"):
    q3 = jnp.zeros((1, 8, 2, 96), jnp.bfloat16)
    jax_fa3.attention(q3, q3, q3, precision="fp8")
  with pytest.raises(ValueError, match="precision"):
    jax_fa3.attention(q, k, v, precision="fp16")
  if fp8.fp8_kernel_blocker(q.dtype, 64) is not None:
    with pytest.raises(ValueError, match="implementation='fa3'"):
      jax_fa3.attention(q, k, v, precision="fp8", implementation="fa3")
  q8, qs = jax_fa3.quantize_fp8(q)
  k8, ks = jax_fa3.quantize_fp8(k)
  with pytest.raises(ValueError, match="q_scale"):
    jax_fa3.attention_fp8(q8, k8, k8, qs[:, :, :0], ks, ks)
  with pytest.raises(ValueError, match="float8_e4m3fn"):
    jax_fa3.attention_fp8(q, k8, k8, qs, ks, ks)
  for dt in (F32, "not a dtype"):  # the second was numpy's TypeError
    with pytest.raises(ValueError, match="out_dtype"):
      jax_fa3.attention_fp8(q8, k8, k8, qs, ks, ks, out_dtype=dt)
  with pytest.raises(ValueError, match="block_rows"):
    jax_fa3.quantize_fp8(q, block_rows=0)
  for kw, match in ((dict(hadamard="no"), "hadamard must be a bool"),
                    (dict(per_tensor=1), "per_tensor must be a bool"),
                    (dict(hadamard=True, seed=1.5), "seed must be an int"),
                    (dict(hadamard=True, seed=-2**63 - 1), "seed must be an int"),
                    (dict(signs=jnp.ones(q.shape[-1])), "pass hadamard=True"),
                    (dict(hadamard=True, signs=jnp.full(q.shape[-1], 0.5)),
                     "must be \\+1 or -1")):
    with pytest.raises(ValueError, match=match):
      jax_fa3.quantize_fp8(q, **kw)


def test_attention_fp8_gradient_is_a_value_error():
  # Documented as not differentiable: a clear error, not a gradient of the
  # emulation with respect to the scales.
  q = _normal(4, (1, 128, 2, 64))
  q8, qs = jax_fa3.quantize_fp8(q)
  f = lambda s: jnp.sum(jax_fa3.attention_fp8(q8, q8, q8, s, s, s)
                        .astype(F32))
  assert np.isfinite(np.asarray(f(qs)))
  with pytest.raises(ValueError, match="not differentiable"):
    jax.grad(f)(qs)


def test_fp8_emulation_pins_its_e4m3_roundings():
  # XLA:GPU may fold an f32 -> e4m3 -> f32 round trip inside one jit; the
  # emulation keeps its roundings behind optimization barriers.
  q = jnp.ones((1, 8, 1, 64), jnp.bfloat16)
  hlo = jax.jit(lambda q: jax_fa3.attention(
      q, q, q, precision="fp8", implementation="reference")).lower(q).as_text()
  assert hlo.count("optimization_barrier") >= 4, hlo.count("optimization_barrier")
  assert fp8.FWD_TARGET not in hlo and fp8.QUANT_TARGET not in hlo


def test_quantize_pow2_scales():
  # V's scales: the smallest power of two >= amax / 448 (the kernel folds V's
  # scale ratios into P); an all-zero block gets the smallest normal float.
  x = _normal(5, (2, 300, 2, 64)).at[:, :128, 1].set(0)
  x8, sc = jax_fa3.quantize_fp8(x, block_rows=128, pow2_scales=True)
  _, exact = jax_fa3.quantize_fp8(x, block_rows=128)
  sc, exact = np.asarray(sc), np.asarray(exact)
  zero = np.zeros_like(sc, bool)
  zero[:, 1, 0] = True
  assert np.all(sc[zero] == np.finfo(np.float32).tiny)
  lg = np.log2(sc[~zero])
  assert np.all(lg == np.round(lg))
  assert np.all(sc[~zero] >= exact[~zero]) and np.all(sc[~zero] < 2 * exact[~zero])
  scale_b = np.repeat(np.swapaxes(sc, 1, 2), 128, axis=1)[:, :300, :, None]
  deq = np.asarray(x8, np.float32) * scale_b
  xf = np.asarray(x, np.float32)
  assert np.all(np.abs(deq - xf) <= np.abs(xf) * 2.0 ** -4 + scale_b * 2.0 ** -9)


def test_vt_layout_key_order_and_padding():
  """The V^T layout precision="fp8" feeds its kernel (fp8 module docstring):
  within each 32-key slice position 16h + 4t + i holds key 16h + 8(i//2) +
  2t + i%2 (the P register order of cc/fp8/mainloop.h); keys padded to 128."""
  order = fp8.vt_key_order(128)
  assert sorted(order.tolist()) == list(range(128))
  assert order[:8].tolist() == [0, 1, 8, 9, 2, 3, 10, 11]
  assert order[16:20].tolist() == [16, 17, 24, 25]
  assert order[32:36].tolist() == [32, 33, 40, 41]
  rng = np.random.default_rng(0)
  v = rng.standard_normal((2, 300, 3, 64)).astype(np.float32)
  v8 = jnp.asarray(v).astype(jnp.float8_e4m3fn)
  vt = np.asarray(fp8.to_vt_layout(v8)).astype(np.float32)
  assert vt.shape == (2, 3, 64, 384)
  v8f = np.asarray(v8).astype(np.float32)
  for pos in (0, 2, 5, 37, 128 + 18, 256 + 31, 256 + 41):  # keys 0 .. 297
    key = (pos // 128) * 128 + order[pos % 128]
    np.testing.assert_array_equal(vt[:, :, :, pos], v8f[:, key])
  keys = (np.arange(384) // 128) * 128 + order[np.arange(384) % 128]
  assert np.all(vt[..., keys >= 300] == 0)


@pytest.mark.parametrize("block_scales", [True, False])
def test_fp8_kernel_path_vmap_equals_loop(monkeypatch, block_scales):
  """vmap of the FP8 primitives (traced as on an H200; on CPU they lower to
  the emulation): block scales fold the vmapped axis into the batch, the
  per-element tensor-wide scales of block_scales=False run one by one."""
  from jax_fa3 import _native
  cfg = frozenset({("bfloat16", 64)})
  monkeypatch.setattr(_native, "_jax_fa3", _native._jax_fa3 or object())
  for name in ("_CONFIGS", "_BWD_CONFIGS", "_FP8_CONFIGS"):
    monkeypatch.setattr(_native, name, cfg)
  monkeypatch.setattr(_native, "_SM90", True)
  cpu = jax.devices("cpu")[0]
  q, k, v = (jax.device_put(jnp.stack([x, 3 * x]), cpu)
             for x in _inputs(16, T=130, S=150))
  f = lambda q, k, v: jax_fa3.attention(q, k, v, precision="fp8",
                                        fp8_block_scales=block_scales)
  hlo = jax.jit(jax.vmap(f)).trace(q, k, v).lower(
      lowering_platforms=("cuda",)).as_text()
  assert fp8.FWD_TARGET in hlo and fp8.QUANT_TARGET in hlo
  got = jax.jit(jax.vmap(f))(q, k, v)
  for i in range(2):
    np.testing.assert_array_equal(np.asarray(got[i], np.float32),
                                  np.asarray(jax.jit(f)(q[i], k[i], v[i]),
                                             np.float32))
