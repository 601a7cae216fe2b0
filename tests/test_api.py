"""jax_fa3.attention / dot_product_attention on CPU (reference path) vs
jax.nn, input validation, the public names, and the kernel/reference routing
(checked by lowering for CUDA, which needs no GPU)."""
import importlib.util
import inspect
import pathlib
import re

import numpy as np
import pytest
import jax
import jax.numpy as jnp

import jax_fa3
from jax_fa3 import _native, core

from fa3_testing import ATOL, RTOL, close as _close, nn_attention as _nn
from fa3_testing import rand as _rand

# XLA:CPU on every host, so float32 tolerances hold (no TF32 on a GPU).
pytestmark = pytest.mark.usefixtures("cpu_backend")


def _check(ours, ref, args, w, argnums=(0, 1, 2), rtol=RTOL, atol=ATOL,
           grad_tol=(1e-4, 2e-5)):
  """Values and gradients of sum(w * out) of `ours` vs `ref` (one jit)."""
  @jax.jit
  def run(*args):
    go = jax.grad(lambda *a: jnp.sum(ours(*a).astype(jnp.float32) * w),
                  argnums)(*args)
    gr = jax.grad(lambda *a: jnp.sum(ref(*a).astype(jnp.float32) * w),
                  argnums)(*args)
    return ours(*args), ref(*args), go, gr

  with jax.default_matmul_precision("highest"):
    o, r, go, gr = run(*args)
  assert o.shape == r.shape and o.dtype == args[0].dtype
  _close(o, r, rtol, atol)
  # gradients are non-trivial (dq can be 0, e.g. window (0, 0))
  assert sum(float(np.max(np.abs(np.asarray(b)))) for b in gr) > 0
  for a, b in zip(go, gr):
    _close(a, b, *grad_tol)
  return o


CASES = {
    "sq<sk": dict(shape=dict(T=37, S=53), kw={}),
    "sq>sk": dict(shape=dict(T=53, S=37), kw={}),
    "causal_sq<sk": dict(shape=dict(T=37, S=53), kw=dict(is_causal=True)),
    "causal_sq>sk": dict(shape=dict(T=53, S=37), kw=dict(is_causal=True)),
    "gqa6/2_causal": dict(shape=dict(T=21, S=30, N=6, K=2),
                          kw=dict(is_causal=True)),
    "mqa6/1": dict(shape=dict(T=21, S=30, N=6, K=1), kw={}),
    "window(3,2)": dict(shape=dict(T=37, S=53),
                        kw=dict(local_window_size=(3, 2))),
    "window(0,0)": dict(shape=dict(T=37, S=53),
                        kw=dict(local_window_size=(0, 0))),
    "window_int4": dict(shape=dict(T=37, S=53), kw=dict(local_window_size=4)),
    "window(6,3)_causal": dict(shape=dict(T=37, S=53, N=4, K=2),
                               kw=dict(local_window_size=(6, 3),
                                       is_causal=True)),
    "seqlens": dict(shape=dict(T=37, S=53), kw=dict(
        query_seq_lengths=np.array([37, 11], np.int32),
        key_value_seq_lengths=np.array([53, 17], np.int32))),
    "seqlens_causal_padded_batch": dict(shape=dict(T=37, S=53), kw=dict(
        is_causal=True, query_seq_lengths=np.array([30, 0], np.int32),
        key_value_seq_lengths=np.array([45, 53], np.int32))),
    # Longer than the reference's K/V block: several blocks, the last padded.
    "long_kv_seqlens_window": dict(shape=dict(T=21, S=1100, N=4, K=2), kw=dict(
        local_window_size=(700, 300),
        key_value_seq_lengths=np.array([1100, 613], np.int32))),
}


@pytest.mark.parametrize("case", list(CASES))
def test_attention_matches_jax_nn(case):
  c = CASES[case]
  q, k, v, w = _rand(list(CASES).index(case), **c["shape"])
  kw = dict(c["kw"], scale=0.4)
  _check(lambda q, k, v: jax_fa3.attention(q, k, v, **kw),
         lambda q, k, v: _nn(q, k, v, **kw), (q, k, v), w)


def test_default_scale_and_reference_impl():
  q, k, v, w = _rand(1, T=9, S=12, H=16)
  f = jax.jit(lambda q, k, v: (
      jax_fa3.attention(q, k, v, implementation="reference"),
      jax_fa3.attention(q, k, v, scale=0.25)))
  a, b = f(q, k, v)
  with jax.default_matmul_precision("highest"):
    r = _nn(q, k, v)
  _close(a, r)
  _close(b, r)  # 1/sqrt(16) = 0.25


def test_softcap_gqa():
  q, k, v, w = _rand(2, T=11, S=17, N=4, K=2)
  scale, cap = 1.0, 1.5

  def dense(q, k, v):
    kr, vr = jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2)
    s = jnp.einsum("btnh,bsnh->bnts", q, kr) * scale
    s = cap * jnp.tanh(s / cap)
    s = jnp.where(jnp.tril(jnp.ones((11, 17), bool)), s, -jnp.inf)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, -1), vr)

  _check(lambda q, k, v: jax_fa3.attention(q, k, v, scale=scale, softcap=cap,
                                           is_causal=True),
         dense, (q, k, v), w)


BIAS_CASES = ["bias_full", "bias_1_1_T_S", "bias_B_1_1_S", "mask_causal",
              "bias_mask"]


@pytest.mark.parametrize("case", BIAS_CASES)
def test_bias_mask_via_dot_product_attention(case):
  B, T, S, N, K = 2, 13, 21, 4, 2
  q, k, v, w = _rand(3, B=B, T=T, S=S, N=N, K=K)
  rk = jax.random.split(jax.random.key(4), 2)
  bias_shapes = {"bias_full": (B, N, T, S), "bias_1_1_T_S": (1, 1, T, S),
                 "bias_B_1_1_S": (B, 1, 1, S), "bias_mask": (1, N, T, S)}
  bias = None
  if case in bias_shapes:
    bias = jax.random.normal(rk[0], bias_shapes[case], jnp.float32)
  mask = None
  kw = {}
  if case.startswith("mask") or case == "bias_mask":
    m = jax.random.bernoulli(rk[1], 0.6, (B, 1, T, S))
    mask = m.at[..., 0].set(True)  # no fully-masked rows
    kw = dict(is_causal=case == "mask_causal")
  if bias is not None:
    _check(lambda q, k, v, b: jax_fa3.dot_product_attention(
               q, k, v, b, mask, **kw),
           lambda q, k, v, b: _nn(q, k, v, b, mask, **kw),
           (q, k, v, bias), w, argnums=(0, 1, 2, 3))
  else:
    _check(lambda q, k, v: jax_fa3.dot_product_attention(
               q, k, v, None, mask, **kw),
           lambda q, k, v: _nn(q, k, v, None, mask, **kw), (q, k, v), w)


def test_3d_inputs_and_residual():
  q, k, v, w = _rand(5, B=1, T=10, S=14, N=4, K=2)
  q3, k3, v3, w3 = q[0], k[0], v[0], w[0]
  f = jax.jit(lambda q, k, v: jax_fa3.dot_product_attention(
      q, k, v, is_causal=True, return_residual=True))
  g = jax.jit(lambda q, k, v: _nn(q, k, v, is_causal=True,
                                  return_residual=True))
  with jax.default_matmul_precision("highest"):
    (o, lse), (ro, rlse) = f(q3, k3, v3), g(q3, k3, v3)
    (o4, lse4), (ro4, rlse4) = f(q, k, v), g(q, k, v)
  assert o.shape == q3.shape and lse.shape == (10, 4) == rlse.shape
  assert lse.dtype == k3.dtype and lse4.shape == (1, 10, 4)
  _close(o, ro)
  _close(lse, rlse)
  _close(o4, ro4)
  _close(lse4, rlse4)
  # 3-D gradients as well
  _check(lambda q, k, v: jax_fa3.dot_product_attention(q, k, v),
         lambda q, k, v: _nn(q, k, v), (q3, k3, v3), w3)


def test_residual_has_no_gradient():
  q, k, v, _ = _rand(6, B=1, T=5, S=6)
  g = jax.grad(lambda q: jnp.sum(jax_fa3.dot_product_attention(
      q, k, v, return_residual=True)[1]))(q)
  assert float(jnp.max(jnp.abs(g))) == 0.0


@pytest.mark.parametrize("causal", [False, True])
def test_second_order_gradients_match_jax_nn(causal):
  # The backward of the backward needs the log-sum-exp's cotangent (the
  # outer derivative reaches q and k through it); v does not see it.
  q, k, v, _ = _rand(21, B=1, T=5, S=7, N=4, K=2, H=8)
  bias = jax.random.normal(jax.random.key(22), (1, 4, 5, 7))
  args = (q, k, v, bias)
  for inner in range(4):
    def outer(attn):
      f = lambda *a: jnp.sum(jnp.sin(attn(*a, is_causal=causal)))
      g = lambda *a: jnp.sum(jax.grad(f, argnums=inner)(*a) ** 2)
      return jax.jit(jax.grad(g, argnums=(0, 1, 2, 3)))(*args)
    ours = outer(lambda q, k, v, b, **kw: jax_fa3.dot_product_attention(
        q, k, v, b, implementation="reference", **kw))
    ref = outer(lambda q, k, v, b, **kw: _nn(q, k, v, bias=b, **kw))
    for a, b in zip(ours, ref):
      _close(a, b, rtol=1e-4, atol=1e-5)


def test_second_order_on_the_kernel_path_is_a_value_error(monkeypatch):
  from jax_fa3 import api
  monkeypatch.setattr(api.V, "kernel_blocker", lambda *a: None)
  q, k, v, _ = _rand(25, B=1, T=4, S=4, N=2, K=2, H=16, dtype=jnp.bfloat16)
  f = lambda q: jnp.sum(jax_fa3.attention(q, k, v, implementation="fa3")
                        .astype(jnp.float32))
  assert jax.grad(f)(q).shape == q.shape  # first order: the kernels
  with pytest.raises(ValueError, match="implementation='reference'"):
    jax.grad(lambda q: jnp.sum(jax.grad(f)(q).astype(jnp.float32) ** 2))(q)


def test_window_wider_than_int32_positions():
  # (left, right) past any sequence: the same as an unbounded side, with no
  # int32 overflow in position + window.
  q, k, v, _ = _rand(23, B=1, T=4, S=5)
  for w in [(0, 2**31 - 1), (2**31, 0), 2**40]:
    wide = w if isinstance(w, tuple) else (w, w)
    near = tuple(min(x, 16) for x in wide)
    _close(jax_fa3.dot_product_attention(q, k, v, local_window_size=w),
           _nn(q, k, v, local_window_size=near))


def test_scale_and_softcap_take_zero_dim_arrays():
  q, k, v, _ = _rand(24, B=1, T=4, S=5)
  want = jax_fa3.attention(q, k, v, scale=0.25, softcap=4.0)
  for sc, cap in [(np.float32(0.25), jnp.float32(4)), (np.array(0.25), jnp.array(4.0)),
                  (jnp.array(0.25), np.array(4))]:
    np.testing.assert_array_equal(
        np.asarray(jax_fa3.attention(q, k, v, scale=sc, softcap=cap)),
        np.asarray(want))
  with pytest.raises(ValueError, match="traced"):
    jax.jit(lambda s: jax_fa3.attention(q, k, v, scale=s))(0.25)


def test_delegates_xla():
  q, k, v, _ = _rand(7, B=1, T=5, S=6)
  a = jax_fa3.dot_product_attention(q, k, v, implementation="xla",
                                    is_causal=True)
  b = _nn(q, k, v, is_causal=True)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_vs_f32(dtype):
  q, k, v, w = _rand(8, T=19, S=27, N=4, K=2, dtype=dtype)
  kw = dict(is_causal=True, query_seq_lengths=np.array([19, 7], np.int32))
  f32 = lambda t: t.astype(jnp.float32)

  @jax.jit
  def run(q, k, v):
    o, vjp = jax.vjp(lambda *a: jax_fa3.attention(*a, **kw), q, k, v)
    ro, rvjp = jax.vjp(lambda *a: _nn(*a, **kw), f32(q), f32(k), f32(v))
    return o, vjp(w.astype(dtype)), ro, rvjp(w)

  with jax.default_matmul_precision("highest"):
    o, g, ro, rg = run(q, k, v)
  assert o.dtype == dtype and all(x.dtype == dtype for x in g)
  _close(o, ro, rtol=2e-2, atol=2e-2)
  for a, b in zip(g, rg):
    _close(a, b, rtol=5e-2, atol=5e-2)


def test_fully_masked_row_outputs_zero():
  q, k, v, w = _rand(9, B=1, T=8, S=8)
  kl = np.array([3], np.int32)
  f = lambda q, k, v: jax_fa3.dot_product_attention(
      q, k, v, local_window_size=(0, 0), key_value_seq_lengths=kl,
      return_residual=True)
  o, lse = jax.jit(f)(q, k, v)
  o = np.asarray(o)
  assert np.all(o[0, 3:] == 0) and np.all(np.isinf(np.asarray(lse)[0, 3:]))
  _close(o[0, :3], np.asarray(v)[0, :3])  # row i sees only key i
  # jax.nn gives the mean of V here instead (documented difference)
  r = np.asarray(_nn(q, k, v, local_window_size=(0, 0),
                     key_value_seq_lengths=kl))
  assert np.max(np.abs(r[0, 3:])) > 1e-3
  g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v)[0] * w),
                       (0, 1, 2)))(q, k, v)
  assert all(np.all(np.isfinite(np.asarray(x))) for x in g)


def test_fp8_needs_16bit_inputs():
  # float32 inputs are refused before anything runs (FP8 itself: test_fp8.py).
  q, k, v, _ = _rand(10, B=1, T=4, S=4)
  with pytest.raises(ValueError, match="bfloat16 or float16"):
    jax_fa3.attention(q, k, v, precision="fp8")


# ----------------------------------------------------------- validation
def _bad_cases():
  q, k, v, _ = _rand(11, B=2, T=4, S=5, N=4, K=2, H=8)
  i32 = lambda *x: np.array(x, np.int32)
  A = jax_fa3.attention
  D = jax_fa3.dot_product_attention
  return {
      "rank": lambda: A(q[0], k[0], v[0]),
      "int_dtype": lambda: A(q.astype(jnp.int32), k.astype(jnp.int32),
                             v.astype(jnp.int32)),
      "bool_dtype": lambda: A(q > 0, k > 0, v > 0),
      "fp8_dtype": lambda: A(*(x.astype(jnp.float8_e4m3fn) for x in (q, k, v))),
      "dpa_fp8_dtype": lambda: D(*(x.astype(jnp.float8_e5m2) for x in (q, k, v))),
      "mixed_dtype": lambda: A(q, k.astype(jnp.bfloat16), v),
      "batch": lambda: A(q, k[:1], v[:1]),
      "head_dim": lambda: A(q, k[..., :4], v[..., :4]),
      "head_dim_zero": lambda: A(q[..., :0], k[..., :0], v),
      "kv_len": lambda: A(q, k, v[:, :3]),
      "no_keys": lambda: A(q, k[:, :0], v[:, :0]),
      "dpa_no_keys": lambda: D(q, k[:, :0], v[:, :0]),
      "segments_no_keys": lambda: A(q, k[:, :0], v[:, :0],
                                    q_segment_ids=np.zeros((2, 4), np.int32),
                                    kv_segment_ids=np.zeros((2, 0), np.int32)),
      "kv_heads": lambda: A(q, k, v[:, :, :1]),
      "heads_multiple": lambda: A(q[:, :, :3], k, v),
      "qlens_bool": lambda: A(q, k, v, query_seq_lengths=np.array([1, 1], bool)),
      "qlens_float": lambda: A(q, k, v,
                               query_seq_lengths=np.array([4., 4.], np.float32)),
      "qlens_shape": lambda: A(q, k, v, query_seq_lengths=i32(4, 4, 4)),
      "kvlens_shape": lambda: A(q, k, v, key_value_seq_lengths=i32(5)),
      "window_neg": lambda: A(q, k, v, local_window_size=-1),
      "window_neg_pair": lambda: A(q, k, v, local_window_size=(2, -1)),
      "window_triple": lambda: A(q, k, v, local_window_size=(1, 2, 3)),
      "window_float": lambda: A(q, k, v, local_window_size=2.0),
      "softcap_zero": lambda: A(q, k, v, softcap=0.0),
      "softcap_neg": lambda: A(q, k, v, softcap=-1.0),
      "softcap_inf": lambda: A(q, k, v, softcap=float("inf")),
      "softcap_str": lambda: A(q, k, v, softcap="2"),
      "scale_nan": lambda: A(q, k, v, scale=float("nan")),
      "scale_inf": lambda: A(q, k, v, scale=float("inf")),
      # finite in float64, inf as the float32 the kernels and reference use
      "scale_f32_overflow": lambda: D(q, k, v, scale=1e39),
      "softcap_f32_overflow": lambda: A(q, k, v, softcap=1e39),
      "dpa_return_residual": lambda: D(q, k, v, return_residual="no"),
      "precision": lambda: A(q, k, v, precision="fp16"),
      "implementation": lambda: A(q, k, v, implementation="triton"),
      "fa3_on_f32": lambda: A(q, k, v, implementation="fa3"),
      # head dim 8: no kernel on any host (not built, or not compiled)
      "fa3_unavailable": lambda: A(q.astype(jnp.bfloat16),
                                   k.astype(jnp.bfloat16),
                                   v.astype(jnp.bfloat16),
                                   implementation="fa3"),
      "dpa_impl": lambda: D(q, k, v, implementation="pallas"),
      "dpa_rank_mix": lambda: D(q[0], k, v),
      "dpa_mask_dtype": lambda: D(q, k, v, mask=jnp.ones((1, 1, 4, 5))),
      "dpa_mask_shape": lambda: D(q, k, v, mask=jnp.ones((1, 1, 3, 5), bool)),
      "dpa_bias_shape": lambda: D(q, k, v, bias=jnp.ones((2, 2, 4, 5))),
      "dpa_bias_rank": lambda: D(q, k, v, bias=jnp.ones((1, 2, 4, 4, 5))),
      "dpa_fa3_bias": lambda: D(q, k, v, bias=jnp.ones((1, 1, 4, 5)),
                                implementation="fa3"),
  }


BAD = _bad_cases()


@pytest.mark.parametrize("case", list(BAD))
def test_bad_inputs_raise_value_error(case):
  with pytest.raises(ValueError):
    BAD[case]()


@pytest.mark.parametrize("dtype", [np.int64, np.uint16, np.uint64])
def test_seq_lengths_of_any_integer_type(dtype):
  # NumPy's default int64 works as in jax.nn; lengths past int32's range
  # clamp like lengths past the sequence instead of wrapping.
  q, k, v, _ = _rand(14, B=2, T=5, S=7, H=8)
  want = jax.nn.dot_product_attention(
      q, k, v, query_seq_lengths=np.array([5, 2], np.int32),
      key_value_seq_lengths=np.array([7, 3], np.int32))
  big = np.iinfo(dtype).max
  got = jax_fa3.dot_product_attention(
      q, k, v, query_seq_lengths=np.array([big, 2], dtype),
      key_value_seq_lengths=np.array([big, 3], dtype))
  _close(got, want, 2e-5, 2e-5)


def test_error_messages_name_the_problem(monkeypatch):
  q, k, v, _ = _rand(12, B=1, T=4, S=4, H=8)
  q16, k16, v16 = (x.astype(jnp.float16) for x in (q, k, v))
  with pytest.raises(ValueError, match="dtype float32"):
    jax_fa3.attention(q, k, v, implementation="fa3")
  # Why the kernel cannot run, for each missing piece (faked: same on any host).
  monkeypatch.setattr(_native, "available", lambda: False)
  with pytest.raises(ValueError, match="not built"):
    jax_fa3.attention(q16, k16, v16, implementation="fa3")
  monkeypatch.setattr(_native, "available", lambda: True)
  monkeypatch.setattr(_native, "sm90_gpu_present", lambda: False)
  with pytest.raises(ValueError, match="sm_90"):
    jax_fa3.attention(q16, k16, v16, implementation="fa3")
  monkeypatch.undo()
  with pytest.raises(ValueError, match="query_seq_lengths"):
    jax_fa3.attention(q, k, v, query_seq_lengths=np.array([1, 2], np.int32))
  with pytest.raises(ValueError, match="local_window_size"):
    jax_fa3.attention(q, k, v, local_window_size=(1,))
  with pytest.raises(ValueError, match="softcap"):
    jax_fa3.attention(q, k, v, softcap=0)


# ---------------------------------------------------------- public names
PUBLIC = {"attention", "dot_product_attention", "flax_attention_fn",
          "attention_fp8", "quantize_fp8", "ring_attention", "to_zigzag",
          "from_zigzag", "kernels_available", "__version__",
          "attention_with_kvcache"}
README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_exports():
  assert len(jax_fa3.__all__) == len(set(jax_fa3.__all__))
  assert set(jax_fa3.__all__) == PUBLIC
  assert re.fullmatch(r"\d+\.\d+\.\d+", jax_fa3.__version__)
  for name in PUBLIC - {"__version__"}:
    obj = getattr(jax_fa3, name)
    assert inspect.isfunction(obj), name
    assert obj.__module__.split(".")[0] == "jax_fa3", (name, obj.__module__)
    assert obj.__doc__ and obj.__doc__.strip(), f"{name} has no docstring"
  assert jax_fa3.kernels_available() is _native.available()


@pytest.mark.skipif(not README.is_file(), reason="no README.md next to tests/")
def test_readme_documents_exactly_the_exports():
  text = README.read_text()
  for name in PUBLIC - {"__version__"}:
    assert re.search(rf"\b{name}\b", text), f"README.md never mentions {name}"
  # Every jax_fa3.<name> the README shows is a submodule or an export.
  for name in set(re.findall(r"\bjax_fa3\.(\w+)", text)):
    submodule = importlib.util.find_spec(f"jax_fa3.{name}") is not None
    assert submodule or name in PUBLIC, (
        f"README.md shows jax_fa3.{name}, which is not in jax_fa3.__all__")


# --------------------------------------------------------------- routing
def _cuda_kernels(f, *args):
  """FFI kernels (custom-call targets) in ``f``'s program lowered for CUDA.
  Lowering needs no GPU, so the routing is checked the same on every host."""
  text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  return set(re.findall(r"custom_call @(jax_fa3\w*)", text))


def _grad(f):
  return jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), (0, 1, 2))


@pytest.fixture
def fake_kernels(monkeypatch):
  """_native as on an sm_90 host whose build has head dim 8 only (no real
  build does, so tests never run a kernel; they lower for CUDA)."""
  configs = frozenset({("bfloat16", 8), ("float16", 8)})
  monkeypatch.setattr(_native, "available", lambda: True)
  monkeypatch.setattr(_native, "sm90_gpu_present", lambda: True)
  monkeypatch.setattr(_native, "compiled_configs", lambda: configs)
  monkeypatch.setattr(_native, "compiled_bwd_configs", lambda: configs)
  monkeypatch.setattr(_native, "compiled_value_configs", lambda: frozenset())
  monkeypatch.setattr(_native, "compiled_bwd_value_configs",
                      lambda: frozenset())


def test_routing_without_kernels_uses_reference(monkeypatch):
  monkeypatch.setattr(_native, "available", lambda: False)
  q, k, v, _ = _rand(13, B=1, T=4, S=4, dtype=jnp.bfloat16)
  f = lambda q, k, v: jax_fa3.attention(q, k, v, is_causal=True)
  assert _cuda_kernels(f, q, k, v) == set()
  assert _cuda_kernels(_grad(f), q, k, v) == set()
  ref = lambda q, k, v: jax_fa3.attention(q, k, v, is_causal=True,
                                          implementation="reference")
  np.testing.assert_array_equal(np.asarray(jax.jit(f)(q, k, v), np.float32),
                                np.asarray(jax.jit(ref)(q, k, v), np.float32))


def test_routing_value_head_dim(fake_kernels, monkeypatch):
  # A value head dim unlike q's runs the forward kernel where its tile was
  # built, and the backward kernel where that was built too.
  q, k, _, _ = _rand(15, B=2, T=9, S=12, N=4, K=2, dtype=jnp.bfloat16)
  v = jax.random.normal(jax.random.key(1), k.shape[:3] + (4,)).astype(k.dtype)
  f = lambda q, k, v: jax_fa3.attention(q, k, v, is_causal=True)
  assert _cuda_kernels(f, q, k, v) == set()
  with pytest.raises(ValueError, match="value head_dim"):
    jax_fa3.attention(q, k, v, implementation="fa3")
  monkeypatch.setattr(_native, "compiled_value_configs",
                      lambda: frozenset({("bfloat16", 8, 4)}))
  f = lambda q, k, v: jax_fa3.attention(q, k, v, is_causal=True)  # a new trace
  assert _cuda_kernels(f, q, k, v) == {"jax_fa3_fwd"}
  assert _cuda_kernels(_grad(f), q, k, v) == {"jax_fa3_fwd"}
  out = jax.eval_shape(f, q, k, v)
  assert out.shape == q.shape[:3] + (4,)
  assert _cuda_kernels(f, q.astype(jnp.float16), k.astype(jnp.float16),
                       v.astype(jnp.float16)) == set()
  # A backward kernel for another pair (or only dv == d ones) is not used.
  monkeypatch.setattr(_native, "compiled_bwd_value_configs",
                      lambda: frozenset({("bfloat16", 8, 2)}))
  f = lambda q, k, v: jax_fa3.attention(q, k, v, is_causal=True)
  assert _cuda_kernels(_grad(f), q, k, v) == {"jax_fa3_fwd"}
  monkeypatch.setattr(_native, "compiled_bwd_value_configs",
                      lambda: frozenset({("bfloat16", 8, 4)}))
  f = lambda q, k, v: jax_fa3.attention(q, k, v, is_causal=True)
  assert _cuda_kernels(_grad(f), q, k, v) == {"jax_fa3_fwd", "jax_fa3_bwd"}
  det = lambda q, k, v: jax_fa3.attention(q, k, v, deterministic=True)
  assert "jax_fa3_bwd" in _cuda_kernels(_grad(det), q, k, v)


def test_routing_with_kernels_binds_the_kernels(fake_kernels):
  q, k, v, w = _rand(14, B=2, T=9, S=12, N=4, K=2, dtype=jnp.bfloat16)
  f = lambda q, k, v: jax_fa3.attention(q, k, v, is_causal=True)
  assert _cuda_kernels(f, q, k, v) == {"jax_fa3_fwd"}
  assert _cuda_kernels(_grad(f), q, k, v) == {"jax_fa3_fwd", "jax_fa3_bwd"}
  det = lambda q, k, v: jax_fa3.attention(q, k, v, deterministic=True)
  assert "jax_fa3_bwd" in _cuda_kernels(_grad(det), q, k, v)
  # Off CUDA the kernel path computes the reference: same numbers on XLA:CPU.
  fa3 = jax.jit(lambda q, k, v: jax_fa3.attention(
      q, k, v, is_causal=True, implementation="fa3"))(q, k, v)
  ref = jax.jit(lambda q, k, v: jax_fa3.attention(
      q, k, v, is_causal=True, implementation="reference"))(q, k, v)
  _close(fa3, ref, rtol=1e-2, atol=1e-2)
  # a boolean mask and a bias run on the kernels; f32 routes to the reference
  m = jnp.ones((1, 1, 9, 12), bool)
  assert _cuda_kernels(_grad(lambda q, k, v: jax_fa3.dot_product_attention(
      q, k, v, mask=m)), q, k, v) == {"jax_fa3_fwd", "jax_fa3_bwd"}
  assert _cuda_kernels(f, *(x.astype(jnp.float32) for x in (q, k, v))) == set()
  b = jnp.zeros((1, 1, 9, 12), jnp.float32)
  assert _cuda_kernels(_grad(lambda q, k, v: jax_fa3.dot_product_attention(
      q, k, v, bias=b)), q, k, v) == {"jax_fa3_fwd", "jax_fa3_bwd"}
  assert _cuda_kernels(lambda q, k, v: jax_fa3.dot_product_attention(
      q, k, v, bias=b, mask=m), q, k, v) == {"jax_fa3_fwd"}
  # implementation="reference" never binds a kernel
  assert _cuda_kernels(lambda q, k, v: jax_fa3.attention(
      q, k, v, implementation="reference"), q, k, v) == set()


@pytest.mark.parametrize("window,causal,seen", [
    ((8, 0), False, (-1, 0)),      # left reaches past row 0 (T = 9): causal
    ((4096, 0), False, (-1, 0)),
    ((4096, 4096), True, (-1, 0)),
    ((3, 11), False, (3, -1)),     # right reaches key S - 1 (S = 12)
    ((8, 11), False, (-1, -1)),
    ((7, 10), False, (7, 10)),     # both bounds still cut some row
    ((0, 0), True, (0, 0)),
])
def test_unreachable_window_bounds_reach_the_kernels_as_none(
    fake_kernels, window, causal, seen):
  # Same mask either way; as -1 the kernels pick their causal / unmasked
  # schedule. Forward and backward see the same bounds.
  q, k, v, _ = _rand(17, B=2, T=9, S=12, N=4, K=2, dtype=jnp.bfloat16)
  f = lambda q, k, v: jax_fa3.attention(  # noqa: E731
      q, k, v, local_window_size=window, is_causal=causal)
  lines = (_ffi_lines(_grad(f), "jax_fa3_fwd", q, k, v)
           + _ffi_lines(_grad(f), "jax_fa3_bwd", q, k, v))
  assert len(lines) == 2
  for line in lines:
    assert f"window_left = {seen[0]} :" in line, line
    assert f"window_right = {seen[1]} :" in line, line
  # and the answer is the window's (reference path, float32, vs jax.nn)
  q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
  ours = jax_fa3.attention(q32, k32, v32, local_window_size=window,
                           is_causal=causal, implementation="reference")
  kr = jnp.repeat(k32, 2, axis=2)
  vr = jnp.repeat(v32, 2, axis=2)
  ref = jax.nn.dot_product_attention(q32, kr, vr, local_window_size=window,
                                     is_causal=causal)
  _close(ours, ref, rtol=1e-5, atol=1e-5)


def test_empty_query_on_the_kernel_path(fake_kernels):
  # T = 0 (or B = 0): an empty output and gradients, also where segment
  # ids or a mask build block spans against the other side's empty rows.
  for B, T in ((2, 0), (0, 5)):
    q, k, v, _ = _rand(16, B=B, T=T, S=5, N=4, K=2, dtype=jnp.bfloat16)
    ids = lambda n: jnp.zeros((B, n), jnp.int32)  # noqa: E731
    fs = [lambda q, k, v: jax_fa3.attention(q, k, v, is_causal=True),
          lambda q, k, v: jax_fa3.attention(
              q, k, v, q_segment_ids=ids(T), kv_segment_ids=ids(5)),
          lambda q, k, v: jax_fa3.dot_product_attention(
              q, k, v, mask=jnp.ones((T, 5), bool))]
    for f in fs:
      assert _cuda_kernels(f, q, k, v) <= {"jax_fa3_fwd"}  # lowers for CUDA
      out = jax.jit(f)(q, k, v)
      assert out.shape == q.shape
      grads = jax.jit(_grad(f))(q, k, v)
      assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
      assert all(np.isfinite(np.asarray(g, np.float32)).all() for g in grads)


def test_fa3_rejects_uncompiled_head_dim(fake_kernels):
  q, k, v, _ = _rand(15, B=1, T=4, S=4, H=16, dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="head_dim 16"):
    jax_fa3.attention(q, k, v, implementation="fa3")
  # implementation=None silently falls back to the reference
  assert _cuda_kernels(lambda q, k, v: jax_fa3.attention(q, k, v),
                       q, k, v) == set()


def _ffi_lines(f, target, *args):
  text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  return [l for l in text.splitlines() if f"custom_call @{target}(" in l]


def test_cuda_lowering_of_a_bias(fake_kernels):
  # The bias reaches the kernels in q's dtype, S padded to even (odd S: 11
  # -> 12); its gradient is a kernel result only where it is differentiated,
  # per batch row and head, in float32 where it is summed over broadcast
  # dims next; a bias constant along the keys never reaches them (the
  # softmax drops it: zero gradient).
  q, k, v, _ = _rand(21, B=2, T=9, S=11, N=4, K=2, dtype=jnp.bfloat16)

  def loss(b, argnums):
    f = lambda q, k, v, b: jnp.sum(jax_fa3.dot_product_attention(  # noqa: E731
        q, k, v, bias=b).astype(jnp.float32))
    return jax.grad(f, argnums)

  heads = jnp.ones((1, 4, 9, 11), jnp.float32)
  fwd = _ffi_lines(loss(heads, 0), "jax_fa3_fwd", q, k, v, heads)
  assert len(fwd) == 1 and "tensor<1x4x9x12xbf16>" in fwd[0].split("->")[0]
  bwd = _ffi_lines(loss(heads, 0), "jax_fa3_bwd", q, k, v, heads)
  assert len(bwd) == 1 and "tensor<2x0xbf16>" in bwd[0].split("->")[1]
  bwd = _ffi_lines(loss(heads, 3), "jax_fa3_bwd", q, k, v, heads)
  assert "tensor<2x4x9x12xf32>" in bwd[0].split("->")[1]  # summed over B next
  full = jnp.ones((2, 4, 9, 11), jnp.bfloat16)
  bwd = _ffi_lines(loss(full, 3), "jax_fa3_bwd", q, k, v, full)
  assert "tensor<2x4x9x12xbf16>" in bwd[0].split("->")[1]
  rows = jnp.ones((2, 1, 9, 1), jnp.float32)
  fwd = _ffi_lines(loss(rows, (0, 3)), "jax_fa3_fwd", q, k, v, rows)
  assert len(fwd) == 1 and "tensor<2x0xbf16>" in fwd[0]
  g = jax.jit(loss(rows, (0, 3)))(q, k, v, rows)[1]
  assert g.shape == rows.shape and not np.any(np.asarray(g))


def test_bias_gradient_matches_jax_nn_off_gpu():
  # The same contract off the GPU (the reference path): gradients of q and
  # of biases of every broadcast shape match jax.nn in float32.
  q, k, v, w = _rand(22, B=2, T=9, S=11, N=4, K=2)
  for shape in [(1, 4, 9, 11), (2, 1, 9, 11), (4, 9, 11), (9, 11),
                (1, 4, 1, 11), (2, 1, 9, 1)]:
    b = jax.random.normal(jax.random.key(len(shape)), shape)

    def loss(fn):
      return lambda q, b: jnp.sum(fn(q, k, v, bias=b, is_causal=True) * w)
    got = jax.grad(loss(jax_fa3.dot_product_attention), (0, 1))(q, b)
    want = jax.grad(loss(jax.nn.dot_product_attention), (0, 1))(q, b)
    for g, x in zip(got, want):
      assert g.shape == x.shape
      _close(g, x, rtol=1e-4, atol=1e-5)


def test_vmap_of_a_broadcast_bias_and_mask():
  # Under vmap a bias or mask that broadcasts over the batch ([1, ...])
  # meets the folded batch of the kernel path: the same numbers as a loop.
  q, k, v, _ = _rand(23, B=2, T=9, S=11, N=4, K=2)
  qs, ks, vs = (jnp.stack([x, 2 * x]) for x in (q, k, v))
  b = jax.random.normal(jax.random.key(5), (1, 4, 9, 11))
  m = jax.random.uniform(jax.random.key(6), (1, 1, 9, 11)) < 0.8
  cfg = core.Config(scale=0.3, softcap=0.0, window_left=-1, window_right=-1,
                    kernel=True)
  f = lambda q, k, v, b: core.attention(q, k, v, None, None, b, m, cfg)[0]  # noqa: E731
  got = jax.vmap(f, (0, 0, 0, None))(qs, ks, vs, b)
  for i in range(2):
    _close(got[i], f(qs[i], ks[i], vs[i], b), rtol=1e-5, atol=1e-5)
  gb = jax.vmap(jax.grad(lambda q, b: jnp.sum(f(q, k, v, b)), (0, 1)),
                (0, None))(qs, b)
  for i in range(2):
    want = jax.grad(lambda q, b: jnp.sum(f(q, k, v, b)), (0, 1))(qs[i], b)
    _close(gb[0][i], want[0], rtol=1e-4, atol=1e-5)
    _close(gb[1][i], want[1], rtol=1e-4, atol=1e-5)


def test_forward_alone_skips_the_masks_key_side(fake_kernels):
  # Only the backward reads a mask's transposed bits and key spans: the
  # forward call gets zeros of their shape (XLA then drops their pre-pass
  # from programs without a backward); the backward call gets them.
  q, k, v, _ = _rand(24, B=2, T=40, S=24, N=4, K=2, dtype=jnp.bfloat16)
  m = jax.random.uniform(jax.random.key(7), (2, 1, 40, 24)) < 0.5
  f = lambda q, k, v: jax_fa3.dot_product_attention(q, k, v, mask=m)  # noqa: E731
  text = jax.jit(_grad(f)).trace(q, k, v).lower(
      lowering_platforms=("cuda",)).as_text()
  funcs = {m.group(1): m.group(2) for m in re.finditer(
      r"func\.func (?:public |private )?@(\w+)\((.*?)^  }", text, re.M | re.S)}

  def operands(body, callee):
    call = re.search(rf"call @{callee}\(([^)]*)\)", body).group(1)
    return [o.strip() for o in call.split(",")]

  def defining(name, fn):  # the op defining SSA value `name` of func `fn`
    arg = re.fullmatch(r"%arg(\d+)", name)
    if arg:  # a parameter: follow it to the caller's operand
      caller = next(c for c, b in funcs.items() if re.search(rf"call @{fn}\(", b))
      return defining(operands(funcs[caller], fn)[int(arg.group(1))], caller)
    return re.search(rf"^\s+{name}(?::\d+)? = (.*)$", funcs[fn], re.M).group(1)

  def key_side(target, first):  # defining ops of mask_t and kv_spans
    fn = next(n for n, b in funcs.items() if f"custom_call @{target}(" in b)
    ops = operands(funcs[fn], f"{target}")
    return [defining(ops[first + i], fn) for i in (1, 3)]
  assert all(d.startswith("stablehlo.broadcast_in_dim %c")
             for d in key_side("jax_fa3_fwd", 5))
  assert not any(d.startswith("stablehlo.broadcast_in_dim %c")
                 for d in key_side("jax_fa3_bwd", 8))
