"""Packed sequences: documents of random lengths packed into one row with
segment ids, against the same documents run one by one, and peers.

Implementations (each checked against a float32 reference of every document
alone before it is timed; one that computes the wrong thing is reported, not
timed):

* ``packed``: ``jax_fa3.attention(..., q_segment_ids=ids)`` on the packed row;
* ``separate``: ``jax_fa3.attention`` on each document alone, all in one
  jitted program (the sum of running each document alone);
* ``fa3ref``: the Dao-AILab FA3 varlen kernel (``flash_attn3_jax.varlen``),
  when importable;
* ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")`` with the
  equivalent dense mask, when cuDNN takes it.

Timing: two regimes (``burst``: one run of 20 back-to-back calls; ``steady``:
runs of >= 100 ms), interleaved over the implementations, ``--reps`` times;
the table shows the median and the spread (min-max) of each.  TFLOP/s count
the useful work (the causal half of every document); backward = fwd+bwd - fwd.

  python3 benchmarks/packed_bench.py --out /tmp/packed
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402



def doc_lengths(seed, total, n_docs):
  """n_docs random lengths (>= 64) summing to total."""
  rng = np.random.default_rng(seed)
  cuts = np.sort(rng.choice(np.arange(64, total - 64, 64), n_docs - 1,
                            replace=False))
  return np.diff(np.concatenate([[0], cuts, [total]])).astype(int)


def useful_flops(lens, heads, hdim, causal):
  return sum(4.0 * heads * hdim * n * n * (0.5 if causal else 1.0) for n in lens)


def _impls(lens, causal):
  """name -> (fn(q, k, v, *extra), extra): array operands travel as
  arguments (a 16k x 16k mask captured as a constant took minutes to
  compile)."""
  import jax
  import jax.numpy as jnp
  jax_fa3 = bench._import_jax_fa3()
  starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
  ids = jnp.asarray(np.repeat(np.arange(len(lens), dtype=np.int32), lens)[None])
  impls = {
      "packed": (lambda q, k, v, ids: jax_fa3.attention(
          q, k, v, is_causal=causal, q_segment_ids=ids, implementation="fa3"),
          (ids,)),
      "separate": (lambda q, k, v: jnp.concatenate([jax_fa3.attention(
          q[:, s:s + n], k[:, s:s + n], v[:, s:s + n], is_causal=causal,
          implementation="fa3") for s, n in zip(starts, lens)], axis=1), ()),
  }
  try:
    from flash_attn3_jax.varlen import flash_mha_varlen
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    impls["fa3ref"] = (lambda q, k, v, cu: flash_mha_varlen(
        q[0], k[0], v[0], cu, cu, max_seqlen_q=int(max(lens)),
        max_seqlen_k=int(max(lens)), is_causal=causal)[None], (cu,))
  except ImportError:
    pass
  T = int(sum(lens))
  i = np.arange(T)
  dense = ids[0][:, None] == ids[0][None, :]
  if causal:
    dense = dense & jnp.asarray(i[None, :] <= i[:, None])
  impls["cudnn"] = (lambda q, k, v, m: jax.nn.dot_product_attention(
      q, k, v, mask=m, implementation="cudnn"), (dense[None, None],))
  return impls, starts


def _modes(fn):
  import jax
  fwd = jax.jit(fn)

  def fb(q, k, v, do, *extra):
    out, pull = jax.vjp(lambda q, k, v: fn(q, k, v, *extra), q, k, v)
    return pull(do)
  return fwd, jax.jit(fb)


def _reference(q, k, v, do, lens, starts, causal):
  """float32 output and gradients of every document alone (jax.nn, xla),
  and the same in the input dtype (the error a same-dtype XLA program has)."""
  import jax
  import jax.numpy as jnp

  @jax.jit
  def doc(q, k, v, do):
    with jax.default_matmul_precision("highest"):
      f = lambda a, b, c: jax.nn.dot_product_attention(  # noqa: E731
          a, b, c, is_causal=causal, implementation="xla")
      out, pull = jax.vjp(f, q, k, v)
      return out, pull(do)

  def per_doc(dtype):
    outs, grads = [], [[], [], []]
    for s, n in zip(starts, lens):
      out, g = doc(*(x[:, s:s + n].astype(dtype) for x in (q, k, v, do)))
      outs.append(np.asarray(out, np.float32))
      for acc, x in zip(grads, g):
        acc.append(np.asarray(x, np.float32))
    return [np.concatenate(outs, 1)] + [np.concatenate(a, 1) for a in grads]
  return per_doc(jnp.float32), per_doc(q.dtype)


def check(name, fwd, fb, args, extra, ref, same):
  """None if ``name`` matches the reference (FA3 rule: error <= 2x the
  same-dtype error + slack, 3x for gradients), else why not."""
  q, k, v, do = args
  got = [np.asarray(fwd(q, k, v, *extra), np.float32)]
  try:
    got += [np.asarray(g, np.float32) for g in fb(q, k, v, do, *extra)]
  except Exception as e:  # noqa: BLE001 - a peer without a backward
    return f"backward failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
  for i, (g, r, s) in enumerate(zip(got, ref, same)):
    why = bench.fa3_rule(i, g, r, s, ("out", "dq", "dk", "dv")[i])
    if why:
      return why
  return None


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tokens", type=int, default=16384)
  ap.add_argument("--docs", type=int, default=8)
  ap.add_argument("--heads", type=int, default=16)
  ap.add_argument("--hdim", type=int, default=128)
  ap.add_argument("--non-causal", action="store_true")
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--impls", default="packed,separate,fa3ref,cudnn",
                  help="which of them to run (cuDNN's dense 16k mask is slow)")
  ap.add_argument("--out", default=None, help="folder for the table and plot")
  a = ap.parse_args(argv)
  import jax
  import jax.numpy as jnp
  causal = not a.non_causal
  lens = doc_lengths(a.seed, a.tokens, a.docs)
  env = bench.environment()
  print(bench.header_line(env))
  print(f"documents: {lens.tolist()} ({a.tokens} tokens), heads {a.heads}, "
        f"d {a.hdim}, causal {causal}, bf16")
  keys = jax.random.split(jax.random.key(a.seed), 4)
  shape = (1, a.tokens, a.heads, a.hdim)
  args = tuple(jax.random.normal(kk, shape, jnp.float32).astype(jnp.bfloat16)
               for kk in keys)
  impls, starts = _impls(lens, causal)
  impls = {n: f for n, f in impls.items() if n in a.impls.split(",")}
  ref, same = _reference(*args, lens, starts, causal)
  print("reference done", flush=True)
  timers, status = {}, {}
  for name, (fn, extra) in impls.items():
    fwd, fb = _modes(fn)
    print(f"checking {name}", flush=True)
    try:
      why = check(name, fwd, fb, args, extra, ref, same)
    except Exception as e:  # noqa: BLE001 - report, do not time
      why = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    status[name] = why or "ok"
    if why:
      print(f"{name}: not timed ({why})")
      continue
    timers.update(bench.regime_timers((name, "fwd"), fwd, [args[:3] + extra]))
    timers.update(bench.regime_timers((name, "fwd+bwd"), fb, [args + extra]))
  times = bench.interleaved_times(timers, a.reps)
  flops = useful_flops(lens, a.heads, a.hdim, causal)
  rows = []
  for name in impls:
    if status[name] != "ok":
      continue
    for regime in bench.REGIMES:
      f = times[(name, "fwd", regime)]
      fb = times[(name, "fwd+bwd", regime)]
      b = [x - y for x, y in zip(fb, f)]
      for mode, ts, fl in (("fwd", f, flops), ("bwd", b, 2.5 * flops)):
        rows.append((name, mode, regime, statistics.median(ts) * 1e3,
                     min(ts) * 1e3, max(ts) * 1e3, fl / statistics.median(ts) / 1e12))
  base = {(m, r): ms for n, m, r, ms, *_ in rows if n == "separate"}
  lines = ["| impl | mode | regime | ms (median) | spread | TFLOP/s | vs separate |",
           "|---|---|---|---|---|---|---|"]
  for n, m, r, ms, lo, hi, tf in rows:
    rel = base.get((m, r))
    lines.append(f"| {n} | {m} | {r} | {ms:.3f} | {lo:.3f}-{hi:.3f} | {tf:.0f} | "
                 f"{'' if rel is None else f'{ms / rel:.3f}x time'} |")
  table = "\n".join(lines)
  print(table)
  if a.out:
    bench.write_markdown(a.out, "packed_bench.md", env, table)
    plt = bench.pyplot()
    if plt is not None:
      fig, ax = plt.subplots(figsize=(7, 4))
      names = [n for n in impls if status[n] == "ok"]
      for i, mode in enumerate(("fwd", "bwd")):
        vals = [next(tf for n2, m, r, *_, tf in rows if n2 == n and m == mode
                     and r == "steady") for n in names]
        ax.bar(np.arange(len(names)) + 0.4 * i, vals, 0.4, label=mode)
      ax.set_xticks(np.arange(len(names)) + 0.2, names)
      ax.set_ylabel("useful TFLOP/s (steady)")
      ax.legend()
      bench.save_figure(plt, fig, os.path.join(a.out, "packed_bench.png"),
                        f"{a.docs} documents in {a.tokens} tokens, d{a.hdim}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
