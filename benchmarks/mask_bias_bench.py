"""Flax masks and additive bias: an nnx attention layer given
``nnx.make_causal_mask``, and an ALiBi-style bias with its gradient, each
against cuDNN in the same process.

Cases (``--cases``):

* ``nnx``: a GQA attention layer (``nnx.Linear`` q/k/v/o projections over
  ``[B, T, D]``) whose attention is
  - ``mask``: ``jax_fa3.flax_attention_fn`` given ``nnx.make_causal_mask``;
  - ``causal``: ``jax_fa3.attention(is_causal=True)`` (the speed the mask
    path should keep);
  - ``cudnn``: ``jax.nn.dot_product_attention`` with the same mask.
* ``bias``: attention ``[B, T, N, H]`` with an ALiBi bias ``[1, N, T, T]``
  (causal), differentiated with respect to q, k, v and the bias:
  - ``fa3``: ``jax_fa3.dot_product_attention(bias=..., is_causal=True)``;
  - ``cudnn``: ``jax.nn.dot_product_attention`` with the same arguments.

Each implementation is checked against float32 XLA on the case cut to
``--check-len`` tokens before it is timed (FA3 rule: error <= 2x that of the
same computation in the input dtype + slack, 3x for gradients); one that
computes the wrong thing is reported, not timed.  Timing: ``burst`` (20
back-to-back calls) and ``steady`` (runs of >= 100 ms), interleaved over the
implementations, ``--reps`` times; median and spread (min-max);
bwd = fwd+bwd - fwd.

  python3 benchmarks/mask_bias_bench.py --out /tmp/mask_bias
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402

_BASELINE = {"nnx": ("causal", "cudnn"), "bias": ("cudnn",)}


def alibi(heads, length, dtype):
  """ALiBi bias ``[1, N, T, T]``: ``-slope_h * |i - j|``, slopes
  ``2^(-8 (h + 1) / N)``."""
  import jax.numpy as jnp
  slopes = 2.0 ** (-8.0 * (np.arange(heads) + 1) / heads)
  i = np.arange(length)
  dist = np.abs(i[:, None] - i[None, :]).astype(np.float32)
  return jnp.asarray(-slopes[:, None, None] * dist[None], dtype)[None]


def _attend(name, mask):
  """The attention of the nnx layer for implementation ``name``."""
  import jax
  jax_fa3 = bench._import_jax_fa3()
  if name == "mask":
    return lambda q, k, v: jax_fa3.flax_attention_fn(q, k, v, mask=mask)
  if name == "causal":
    return lambda q, k, v: jax_fa3.attention(q, k, v, is_causal=True)
  if name == "cudnn":
    return lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, mask=mask, implementation="cudnn")
  # The float32 reference.
  return lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, mask=mask, implementation="xla")


def nnx_case(batch, length, heads, kv_heads, hdim, dtype, seed=0):
  """(fn(name) -> f(params, x), params, x, dout): the layer's output as a
  function of its parameters and input."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  dim = heads * hdim

  class Layer(nnx.Module):
    def __init__(self, rngs):
      # The computation dtype follows the inputs (the float32 reference).
      lin = lambda i, o: nnx.Linear(i, o, use_bias=False, param_dtype=dtype,  # noqa: E731
                                    rngs=rngs)
      self.q, self.k = lin(dim, dim), lin(dim, kv_heads * hdim)
      self.v, self.o = lin(dim, kv_heads * hdim), lin(dim, dim)

    def __call__(self, x, attend):
      B, T, _ = x.shape
      q = self.q(x).reshape(B, T, heads, hdim)
      k = self.k(x).reshape(B, T, kv_heads, hdim)
      v = self.v(x).reshape(B, T, kv_heads, hdim)
      return self.o(attend(q, k, v).reshape(B, T, dim))

  graph, params = nnx.split(Layer(nnx.Rngs(seed)))
  ks = jax.random.split(jax.random.key(seed + 1), 2)
  x = jax.random.normal(ks[0], (batch, length, dim), jnp.float32).astype(dtype)
  dout = jax.random.normal(ks[1], x.shape, jnp.float32).astype(dtype)

  def fn(name):
    def f(params, x):
      mask = nnx.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32), dtype=jnp.bool_)
      return nnx.merge(graph, params)(x, _attend(name, mask))
    return f
  return fn, (params, x), dout


def bias_case(batch, length, heads, hdim, dtype, seed=0):
  """(fn(name) -> f(q, k, v, bias), args, dout)."""
  import jax
  import jax.numpy as jnp
  jax_fa3 = bench._import_jax_fa3()
  ks = jax.random.split(jax.random.key(seed), 4)
  shape = (batch, length, heads, hdim)
  q, k, v, dout = (jax.random.normal(kk, shape, jnp.float32).astype(dtype) for kk in ks)
  impl = {"fa3": jax_fa3.dot_product_attention,
          "cudnn": lambda *a, **kw: jax.nn.dot_product_attention(
              *a, implementation="cudnn", **kw),
          "reference": lambda *a, **kw: jax.nn.dot_product_attention(
              *a, implementation="xla", **kw)}

  def fn(name):
    return lambda q, k, v, bias: impl[name](q, k, v, bias=bias, is_causal=True)
  return fn, (q, k, v, alibi(heads, length, dtype)), dout


def _modes(f, dout):
  """(forward, forward + vjp with respect to every argument), jitted."""
  import jax

  def fb(*args):
    out, pull = jax.vjp(f, *args)
    return pull(dout)
  return jax.jit(f), jax.jit(fb)


def _leaves(tree):
  import jax
  return [np.asarray(x, np.float32) for x in jax.tree_util.tree_leaves(tree)]


def compare(got, ref, same):
  """None if every output/gradient leaf passes the FA3 rule, else why not
  (the slack scales with the leaf: the layer's parameter gradients run large)."""
  for i, (g, r, s) in enumerate(zip(got, ref, same)):
    why = bench.fa3_rule(i, g, r, s, "out" if i == 0 else f"gradient {i}",
                         slack=4e-3 * max(1.0, float(np.abs(r).max())))
    if why:
      return why
  return None


def verify(fn, name, args, dout):
  """None if implementation ``name`` of factory ``fn`` passes, else why not."""
  import jax
  import jax.numpy as jnp
  f32 = lambda t: jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), t)  # noqa: E731

  def run(f, a, d):
    fwd, fb = _modes(f, d)
    return _leaves(fwd(*a)) + _leaves(fb(*a))
  try:
    got = run(fn(name), args, dout)
  except Exception as e:  # noqa: BLE001 - report, do not time
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
  with jax.default_matmul_precision("highest"):
    ref = run(fn("reference"), f32(args), dout.astype(jnp.float32))
  return compare(got, ref, run(fn("reference"), args, dout))


def make_case(case, a, length):
  import jax.numpy as jnp
  dtype = jnp.bfloat16
  if case == "nnx":
    return nnx_case(a.batch, length, a.heads, a.kv_heads, a.hdim, dtype)
  return bias_case(a.batch, length, a.heads, a.hdim, dtype)


def table(rows):
  """Markdown rows ``(case, impl, mode, regime, [s])`` with the ratio of each
  baseline's median time to this one's (> 1: faster than the baseline)."""
  med = {(c, i, m, r): statistics.median(ts) for c, i, m, r, ts in rows}
  lines = ["| case | impl | mode | regime | ms (median) | spread | speed vs |",
           "|---|---|---|---|---|---|---|"]
  for c, i, m, r, ts in rows:
    vs = [f"{b} {med[(c, b, m, r)] / med[(c, i, m, r)]:.3f}x"
          for b in _BASELINE[c] if b != i and (c, b, m, r) in med]
    lines.append(f"| {c} | {i} | {m} | {r} | {med[(c, i, m, r)] * 1e3:.3f} | "
                 f"{min(ts) * 1e3:.3f}-{max(ts) * 1e3:.3f} | {', '.join(vs)} |")
  return "\n".join(lines)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--cases", default="nnx,bias")
  ap.add_argument("--length", type=int, default=8192)
  ap.add_argument("--batch", type=int, default=1,
                  help="1: cuDNN's bias gradient needs batch 1 (jax #30593)")
  ap.add_argument("--heads", type=int, default=32)
  ap.add_argument("--kv-heads", type=int, default=8, help="nnx layer only")
  ap.add_argument("--hdim", type=int, default=128)
  ap.add_argument("--check-len", type=int, default=1024)
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--out", default=None, help="folder for the table and plot")
  a = ap.parse_args(argv)
  env = bench.environment()
  print(bench.header_line(env))
  impls = {"nnx": ("mask", "causal", "cudnn"), "bias": ("fa3", "cudnn")}
  timers, timed = {}, []
  for case in a.cases.split(","):
    small_fn, small_args, small_dout = make_case(case, a, min(a.check_len, a.length))
    fn, args, dout = make_case(case, a, a.length)
    for name in impls[case]:
      why = verify(small_fn, name, small_args, small_dout)
      print(f"{case} {name}: {why or 'matches float32 XLA'}", flush=True)
      if why:
        continue
      fwd, fb = _modes(fn(name), dout)
      if name != "cudnn":  # which path jax_fa3 took: the kernel's FFI call or the reference
        kernel = "jax_fa3_fwd" in fwd.lower(*args).as_text()
        print(f"{case} {name}: {'kernel' if kernel else 'reference path'}", flush=True)
      timers.update(bench.regime_timers((case, name, "fwd"), fwd, [args]))
      timers.update(bench.regime_timers((case, name, "fwd+bwd"), fb, [args]))
      timed.append((case, name))
  times = bench.interleaved_times(timers, a.reps)
  rows = []
  for case, name in timed:
    for regime in bench.REGIMES:
      f, fb = times[(case, name, "fwd", regime)], times[(case, name, "fwd+bwd", regime)]
      rows.append((case, name, "fwd", regime, f))
      rows.append((case, name, "bwd", regime, [y - x for x, y in zip(f, fb)]))
  text = table(rows)
  print(text)
  if a.out:
    bench.write_markdown(a.out, "mask_bias_bench.md", env, text)
    plt = bench.pyplot()
    if plt is not None and rows:
      fig, ax = plt.subplots(figsize=(7, 4))
      steady = [(c, i, m, statistics.median(ts)) for c, i, m, r, ts in rows if r == "steady"]
      ax.bar(range(len(steady)), [ms * 1e3 for *_, ms in steady])
      ax.set_xticks(range(len(steady)), [f"{c}\n{i}\n{m}" for c, i, m, _ in steady], fontsize=7)
      ax.set_ylabel("ms (steady, median)")
      bench.save_figure(plt, fig, os.path.join(a.out, "mask_bias_bench.png"),
                        f"T={a.length}, N={a.heads}, d{a.hdim}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
