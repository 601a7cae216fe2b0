"""KV-cache attention for decoding: achieved K/V read bandwidth against the
device's copy bandwidth, and peers on the same caches.

Implementations (each checked against a float32 reference on a reduced copy
of the point before it is timed; one that computes the wrong thing is
reported, not timed):

* ``jax_fa3``: ``jax_fa3.attention_with_kvcache`` (contiguous cache), and
  ``jax_fa3_paged`` (the same cache in pages of ``--page-size`` through a
  shuffled page table, or an identity one with ``--page-order sequential``;
  a list of page sizes adds ``jax_fa3_paged<size>`` for the others);
* ``jax_fa3_append`` / ``jax_fa3_paged_append``: a serving loop's step, the
  query's keys and values appended first (``k_new``/``v_new``, inputs of
  the step: the cache's last Tq rows rewritten with their own values, so the
  answer is the read-only one) with the caches donated and carried from call
  to call;
* ``fa3ref``: the Dao-AILab FA3 KV-cache kernel
  (``flash_attn3_jax.kvcache.flash_mha_with_kvcache``), when importable;
* ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")`` with
  ``key_value_seq_lengths`` (decode only: jax.nn has no bottom-right causal
  mask for Tq > 1).

Every row of the cache holds ``L`` valid tokens; ``Tq`` queries sit at the
last positions (bottom-right causal).  Bandwidth counts the K and V bytes
read once (``2 B L K H`` elements); the reference is a device copy of
``--copy-gib`` (read + write).  Timing: ``burst`` (20 back-to-back calls)
and ``steady`` (runs of >= 100 ms), interleaved over the implementations,
``--reps`` times; the table shows the median and the spread (min-max).

  python3 benchmarks/decode_bench.py --out /tmp/decode
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402

# batch x cache length, 1 x 128k to 64 x 4k (>= 256k tokens but the first).
DEFAULT_POINTS = "1x131072,2x131072,8x32768,16x16384,32x8192,64x4096"


def parse_points(text):
  """'1x131072,64x4096' -> [(1, 131072), (64, 4096)]."""
  out = []
  for item in text.split(","):
    b, l = item.lower().split("x")
    out.append((int(b), int(l)))
  return out


def kv_bytes(batch, length, kv_heads, hdim, itemsize=2):
  """Bytes of K and V a decode step must read once."""
  return 2 * batch * length * kv_heads * hdim * itemsize


def paged_layout(batch, length, page_size, seed=0, shuffled=True):
  """(page_table int32 [B, pages], inverse permutation): the rows' pages in
  a shuffled pool, so consecutive pages of a row are not adjacent (or in
  order: the contiguous cache's own layout, cut into pages)."""
  per = -(-length // page_size)
  perm = np.arange(batch * per, dtype=np.int32)
  if shuffled:
    perm = np.random.default_rng(seed).permutation(batch * per).astype(np.int32)
  return perm.reshape(batch, per), np.argsort(perm)


def to_pages(cache, table, page_size):
  """Contiguous ``[B, L, K, H]`` -> the pool ``[pages, page_size, K, H]``
  that ``table`` addresses."""
  import jax.numpy as jnp
  B, L = cache.shape[:2]
  per = table.shape[1]
  c = jnp.pad(cache, [(0, 0), (0, per * page_size - L), (0, 0), (0, 0)])
  c = c.reshape((B * per, page_size) + cache.shape[2:])
  pool = jnp.zeros_like(c)
  return pool.at[jnp.asarray(table.reshape(-1))].set(c)


def reference(q, k, v, lens):
  """float32 bottom-right causal attention over the first ``lens[b]`` keys."""
  import jax
  import jax.numpy as jnp
  B, Tq, N, H = q.shape
  L, K = k.shape[1], k.shape[2]
  g = N // K
  kf = jnp.repeat(k.astype(jnp.float32), g, axis=2)
  vf = jnp.repeat(v.astype(jnp.float32), g, axis=2)
  with jax.default_matmul_precision("highest"):
    s = jnp.einsum("btnh,bsnh->bnts", q.astype(jnp.float32), kf) / np.sqrt(H)
    qpos = lens[:, None] - Tq + jnp.arange(Tq)[None]
    j = jnp.arange(L)[None, None]
    vis = (j < lens[:, None, None]) & (j <= qpos[..., None])
    s = jnp.where(vis[:, None], s, -jnp.inf)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), vf)


def _paged_name(page_sizes, i):
  return "jax_fa3_paged" if i == 0 else f"jax_fa3_paged{page_sizes[i]}"


def _appending(jax_fa3, q, k_cache, v_cache, lens_before, k_new, v_new, table):
  """``(out, k_cache, v_cache)`` of a decode step that first appends ``k_new,
  v_new`` (make_point's rows at positions ``lens - Tq ..``, so the step keeps
  the read-only answer) at ``lens_before``."""
  return jax_fa3.attention_with_kvcache(q, k_cache, v_cache, lens_before, k_new=k_new,
                                        v_new=v_new, page_table=table)


APPENDING = ("jax_fa3_append", "jax_fa3_paged_append")
# Which of make_point's arrays an appending impl carries: (k, v) or a page size's pools.
_CARRIED = {"jax_fa3_append": (1, 2), "jax_fa3_paged_append": (5, 6)}


class CarriedCaches:
  """A step whose caches are donated and carried from call to call, as a
  serving loop holds them (no copy of a cache per call): calls take
  make_point's arrays and use their own copies of the carried ones."""

  def __init__(self, name, fn, args):
    import jax
    import jax.numpy as jnp
    self.slots = _CARRIED[name]
    self.state = [jnp.copy(args[i]) for i in self.slots]
    slots = self.slots

    def step(*xs):
      out, kc, vc = fn(*xs)
      return out, (kc, vc)
    self.step = jax.jit(step, donate_argnums=slots)

  def __call__(self, *args):
    args = list(args)
    for i, x in zip(self.slots, self.state):
      args[i] = x
    out, self.state = self.step(*args)
    return out


def _impls(names, page_sizes):
  """name -> fn(q, k_cache, v_cache, lens, *rest), rest: (table, pool_k,
  pool_v) per page size, then (k_new, v_new, lens - Tq) (make_point)."""
  import jax
  jax_fa3 = bench._import_jax_fa3()
  impls = {}
  if "jax_fa3" in names:
    impls["jax_fa3"] = lambda q, k, v, lens, *pg: jax_fa3.attention_with_kvcache(
        q, k, v, lens)
  if "jax_fa3_paged" in names:
    for i in range(len(page_sizes)):
      impls[_paged_name(page_sizes, i)] = (
          lambda q, k, v, lens, *pg, i=i: jax_fa3.attention_with_kvcache(
              q, pg[3 * i + 1], pg[3 * i + 2], lens, page_table=pg[3 * i]))
  if "jax_fa3_append" in names:
    impls["jax_fa3_append"] = lambda q, k, v, lens, *pg: _appending(
        jax_fa3, q, k, v, pg[-1], pg[-3], pg[-2], None)
  if "jax_fa3_paged_append" in names:
    impls["jax_fa3_paged_append"] = lambda q, k, v, lens, *pg: _appending(
        jax_fa3, q, pg[1], pg[2], pg[-1], pg[-3], pg[-2], pg[0])
  if "fa3ref" in names:
    try:
      from flash_attn3_jax.kvcache import flash_mha_with_kvcache
      impls["fa3ref"] = lambda q, k, v, lens, *pg: flash_mha_with_kvcache(
          q, k, v, cache_seqlens=lens, is_causal=True)
    except ImportError:
      pass
  if "cudnn" in names:
    impls["cudnn"] = lambda q, k, v, lens, *pg: jax.nn.dot_product_attention(
        q, k, v, key_value_seq_lengths=lens, implementation="cudnn")
  return impls


def make_point(key, batch, length, tq, heads, kv_heads, hdim, page_sizes, shuffled=True):
  import jax
  import jax.numpy as jnp
  ks = jax.random.split(key, 3)
  q = jax.random.normal(ks[0], (batch, tq, heads, hdim), jnp.float32).astype(jnp.bfloat16)
  k = jax.random.normal(ks[1], (batch, length, kv_heads, hdim), jnp.float32).astype(jnp.bfloat16)
  v = jax.random.normal(ks[2], (batch, length, kv_heads, hdim), jnp.float32).astype(jnp.bfloat16)
  lens = jnp.full((batch,), length, jnp.int32)
  pages = []
  for ps in page_sizes:
    table, _ = paged_layout(batch, length, ps, shuffled=shuffled)
    pages += [jnp.asarray(table), to_pages(k, table, ps), to_pages(v, table, ps)]
  # An appending step's new rows, as a model would hand them over: the cache's
  # own last tq rows, written back where they came from.
  k_new, v_new = k[:, length - tq:], v[:, length - tq:]
  return (q, k, v, lens, *pages, k_new, v_new, lens - tq)


def check(name, fn, args):
  """None if ``fn`` matches the float32 reference within 2x the reference's
  own bf16 rounding + 4e-3, else why not."""
  import jax
  import jax.numpy as jnp
  q, k, v, lens = args[:4]
  try:
    got = jax.jit(fn)(*args)
    got = np.asarray(got[0] if isinstance(got, tuple) else got, np.float32)  # appending: (out, caches)
  except Exception as e:  # noqa: BLE001 - report, do not time
    return f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
  exact = reference(q, k, v, lens)
  ref = np.asarray(exact, np.float32)
  same = np.asarray(exact.astype(jnp.bfloat16), np.float32)
  return bench.fa3_rule(0, got, ref, same, "out")


def copy_bandwidth(gib, reps):
  """Device copy bandwidth (bytes/s): the best of ``reps`` timed runs of
  ``x + 1`` over ``gib`` GiB of bf16 (read + write)."""
  import jax
  import jax.numpy as jnp
  n = int(gib * 2 ** 30) // 2
  x = jnp.zeros((n,), jnp.bfloat16)
  t = bench.RunTimer(jax.jit(lambda x: x + 1), [(x,)], warmup=2, min_run_s=0.1,
                     max_iters=1000)
  best = min(t.run() for _ in range(reps))
  return 2 * n * 2 / best


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--points", default=DEFAULT_POINTS, help="batch x cache length list")
  ap.add_argument("--tq", default="1", help="query counts, e.g. 1,4,8 (verification)")
  ap.add_argument("--heads", type=int, default=32)
  ap.add_argument("--kv-heads", type=int, default=8)
  ap.add_argument("--hdim", type=int, default=128)
  ap.add_argument("--page-size", default="128", help="page sizes, e.g. 128,256")
  ap.add_argument("--page-order", default="shuffled", choices=("shuffled", "sequential"))
  ap.add_argument("--impls", default="jax_fa3,jax_fa3_paged,fa3ref,cudnn")
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--copy-gib", type=float, default=4.0)
  ap.add_argument("--check-tokens", type=int, default=4096,
                  help="cache length of the reduced copy each impl is checked on")
  ap.add_argument("--out", default=None, help="folder for the table and plot")
  a = ap.parse_args(argv)
  import jax
  env = bench.environment()
  print(bench.header_line(env))
  copy_bw = copy_bandwidth(a.copy_gib, a.reps)
  print(f"device copy bandwidth: {copy_bw / 1e9:.0f} GB/s ({a.copy_gib} GiB, read + write)")
  page_sizes = [int(x) for x in a.page_size.split(",")]
  shuffled = a.page_order == "shuffled"
  impls = _impls(a.impls.split(","), page_sizes)
  rows = []
  for tq in (int(x) for x in a.tq.split(",")):
    for batch, length in parse_points(a.points):
      small = make_point(jax.random.key(1), min(batch, 2), min(length, a.check_tokens), tq,
                         a.heads, a.kv_heads, a.hdim, page_sizes, shuffled)
      args = make_point(jax.random.key(0), batch, length, tq, a.heads, a.kv_heads,
                        a.hdim, page_sizes, shuffled)
      timers, status = {}, {}
      for name, fn in impls.items():
        why = "n/a: Tq > 1" if name == "cudnn" and tq > 1 else check(name, fn, small)
        status[name] = why or "ok"
        if why:
          print(f"{batch}x{length} tq={tq} {name}: not timed ({why})")
          continue
        timed = CarriedCaches(name, fn, args) if name in APPENDING else jax.jit(fn)
        timers.update(bench.regime_timers((name,), timed, [args]))
      times = bench.interleaved_times(timers, a.reps)
      nbytes = kv_bytes(batch, length, a.kv_heads, a.hdim)
      for (name, regime), ts in times.items():
        ms = statistics.median(ts) * 1e3
        bw = nbytes / (ms * 1e-3)
        rows.append(dict(impl=name, batch=batch, length=length, tq=tq, regime=regime, ms=ms,
                         lo=min(ts) * 1e3, hi=max(ts) * 1e3, gbs=bw / 1e9,
                         of_copy=bw / copy_bw, tokens=batch * length))
      del args
  ref_ms = {(r["batch"], r["length"], r["tq"], r["regime"]): r["ms"]
            for r in rows if r["impl"] == "fa3ref"}
  lines = ["| impl | B x L | Tq | regime | ms (median) | spread | K/V GB/s | of copy BW | vs fa3ref |",
           "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    key = (r["batch"], r["length"], r["tq"], r["regime"])
    rel = f"{ref_ms[key] / r['ms']:.2f}x" if key in ref_ms else ""
    lines.append(f"| {r['impl']} | {r['batch']}x{r['length']} | {r['tq']} | {r['regime']} | "
                 f"{r['ms']:.4f} | {r['lo']:.4f}-{r['hi']:.4f} | {r['gbs']:.0f} | "
                 f"{r['of_copy'] * 100:.0f}% | {rel} |")
  table = "\n".join(lines)
  print(table)
  if a.out:
    bench.write_markdown(a.out, "decode_bench.md", env,
                         f"copy bandwidth {copy_bw / 1e9:.0f} GB/s\n\n{table}")
    plt = bench.pyplot()
    if plt is not None and rows:
      fig, ax = plt.subplots(figsize=(7, 4))
      for name in dict.fromkeys(r["impl"] for r in rows):
        pts = sorted((r["length"], r["gbs"]) for r in rows
                     if r["impl"] == name and r["regime"] == "steady" and r["tq"] == 1)
        if pts:
          ax.plot(*zip(*pts), marker="o", label=name)
      ax.axhline(copy_bw / 1e9, color="gray", ls="--", label="device copy")
      ax.set_xscale("log", base=2)
      ax.set_xlabel("cache length per row (batch x length: --points)")
      ax.set_ylabel("K/V read GB/s (steady)")
      ax.legend()
      bench.save_figure(plt, fig, os.path.join(a.out, "decode_bench.png"),
                        f"decode, {a.heads}/{a.kv_heads} heads, d{a.hdim}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
