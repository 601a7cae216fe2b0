"""The main job: ``python -m jax_fa3.demo`` trains a small decoder-only transformer.

A Flax (linen) causal language model with GQA attention through ``jax_fa3``
learns a generated copy task (each sequence is a random block of ``--period``
tokens repeated; after the first block every token is predictable by attending
``period`` positions back) for a fixed number of steps, over all local devices
with a mesh data x tensor (heads) x context (sequence) chosen by flags.  With
``--context > 1`` and ``--attention fa3`` attention is ring attention
(:func:`jax_fa3.ring_attention`, zig-zag layout) inside ``shard_map``.

It prints loss, step time, tokens/s and model-FLOPs utilisation, compares
attention backends with the same seed (``--attention fa3,cudnn``), and writes a
loss-curve PNG.  On an H100/H200 with the kernels built ``fa3`` is the
FlashAttention-3 kernel; anywhere else it is the pure-JAX reference path, and
the defaults shrink to a tiny configuration that runs in seconds on a CPU
(``--cpu-devices 8`` gives 8 virtual CPU devices so the sharding runs
anywhere).  Before training it checks jax_fa3 attention against an fp32
reference, next to ``jax.nn.dot_product_attention`` (cuDNN on a GPU).
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time

H200_BF16_PEAK = 989e12  # dense bf16 TFLOP/s of an H200 (SXM)


# ---------------------------------------------------------------- arguments
def parse_args(argv, on_gpu):
  g = on_gpu
  ap = argparse.ArgumentParser(
      prog="python -m jax_fa3.demo",
      description=__doc__.splitlines()[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  ap.add_argument("--attention", default="fa3",
                  help="comma-separated backends to train with, in order: "
                       "fa3 (jax_fa3), cudnn, xla (jax.nn)")
  ap.add_argument("--steps", type=int, default=100 if g else 50)
  ap.add_argument("--batch", type=int, default=4 if g else 8,
                  help="global batch (sequences per step)")
  ap.add_argument("--seq-len", type=int, default=8192 if g else 128)
  ap.add_argument("--layers", type=int, default=8 if g else 2)
  ap.add_argument("--heads", type=int, default=16 if g else 4)
  ap.add_argument("--kv-heads", type=int, default=4 if g else 2)
  ap.add_argument("--head-dim", type=int, default=128 if g else 16)
  ap.add_argument("--vocab", type=int, default=256 if g else 64)
  ap.add_argument("--period", type=int, default=64 if g else 16,
                  help="length of the repeated random block (copy task)")
  # GPU: 2e-3 spikes the loss above log(vocab) in the first steps at
  # d_model 2048; 5e-4 is the usual range for this width.
  ap.add_argument("--lr", type=float, default=5e-4 if g else 1e-2)
  ap.add_argument("--dtype", default="bfloat16" if g else "float32",
                  choices=["bfloat16", "float16", "float32"],
                  help="activation/attention dtype (params are fp32)")
  ap.add_argument("--data", type=int, default=-1,
                  help="data-parallel mesh axis size (-1: all remaining)")
  ap.add_argument("--tensor", type=int, default=1,
                  help="tensor (heads) mesh axis size")
  ap.add_argument("--context", type=int, default=1,
                  help="context (sequence, ring attention) mesh axis size")
  ap.add_argument("--cpu-devices", type=int, default=0,
                  help="use N virtual CPU devices (sharding anywhere)")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--plot", default="demo_loss.png",
                  help="loss-curve PNG ('' to skip)")
  ap.add_argument("--generate", type=int, default=0, metavar="N",
                  help="after training, decode N tokens of a copy-task prompt "
                       "with a paged KV cache (jax_fa3.attention_with_kvcache)")
  ap.add_argument("--page-size", type=int, default=128,
                  help="KV-cache page size for --generate")
  ap.add_argument("--no-check", action="store_true",
                  help="skip the attention accuracy check")
  return ap.parse_args(argv)


# ------------------------------------------------------------------- model
def _build(args, mesh, attention):
  import jax
  import jax.numpy as jnp
  import flax.linen as nn
  from jax.sharding import NamedSharding, PartitionSpec as P

  import jax_fa3

  dtype = jnp.dtype(args.dtype)
  N, K, H = args.heads, args.kv_heads, args.head_dim
  D = N * H
  part = lambda *axes: nn.with_partitioning(nn.initializers.lecun_normal(),
                                            axes)

  def rope(x, pos):  # x [B,T,heads,H], pos [B,T]
    half = H // 2
    freq = 1.0 / (10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
    ang = pos[..., None, None].astype(jnp.float32) * freq
    c, s = jnp.cos(ang), jnp.sin(ang)
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(
        jnp.float32)
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s],
                           -1).astype(x.dtype)

  def attend(q, k, v):
    if attention == "fa3" and args.context > 1:
      # Context parallelism: the sequence is in zig-zag order (see _batch),
      # so the causal ring does equal work on every device.
      spec = P("data", "context", "tensor", None)
      ring = functools.partial(jax_fa3.ring_attention, axis_name="context",
                               is_causal=True, layout="zigzag")
      return jax.shard_map(ring, mesh=mesh, in_specs=(spec,) * 3,
                           out_specs=spec, check_vma=False)(q, k, v)
    if attention == "fa3":
      return jax_fa3.attention(q, k, v, is_causal=True)
    if args.context > 1:
      # jax.nn has no ring: inside shard_map, all-gather the sequence (natural
      # order), attend over all of it, keep this device's query rows.  Left
      # to jit, cuDNN's partitioning rule refuses a sharded sequence, and
      # gathering through a sharding constraint instead trains to NaN.
      spec = P("data", "context", "tensor", None)

      def gathered(q, k, v):
        t = q.shape[1]
        qf, kf, vf = (jax.lax.all_gather(x, "context", axis=1, tiled=True)
                      for x in (q, k, v))
        o = jax.nn.dot_product_attention(qf, kf, vf, is_causal=True,
                                         implementation=attention)
        i = jax.lax.axis_index("context")
        return jax.lax.dynamic_slice_in_dim(o, i * t, t, axis=1)

      return jax.shard_map(gathered, mesh=mesh, in_specs=(spec,) * 3,
                           out_specs=spec, check_vma=False)(q, k, v)
    return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                        implementation=attention)

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, pos, cache=None):
      """cache: None (training) or (k_cache, v_cache, cache_seqlens,
      page_table): x's tokens are appended and attended to; returns
      (x, (k_cache, v_cache)) then."""
      h = nn.RMSNorm(dtype=dtype)(x)
      q = nn.DenseGeneral((N, H), use_bias=False, dtype=dtype,
                          kernel_init=part(None, "tensor", None))(h)
      k = nn.DenseGeneral((K, H), use_bias=False, dtype=dtype,
                          kernel_init=part(None, "tensor", None))(h)
      v = nn.DenseGeneral((K, H), use_bias=False, dtype=dtype,
                          kernel_init=part(None, "tensor", None))(h)
      new_cache = None
      if cache is None:
        o = attend(rope(q, pos), rope(k, pos), v)
      else:
        kc, vc, lens, table = cache
        o, kc, vc = jax_fa3.attention_with_kvcache(
            rope(q, pos), kc, vc, lens, k_new=rope(k, pos), v_new=v,
            page_table=table)
        new_cache = (kc, vc)
      x = x + nn.DenseGeneral(D, axis=(-2, -1), use_bias=False, dtype=dtype,
                              kernel_init=part("tensor", None, None))(o)
      h = nn.RMSNorm(dtype=dtype)(x)
      h = nn.Dense(4 * D, use_bias=False, dtype=dtype,
                   kernel_init=part(None, "tensor"))(h)
      h = nn.Dense(D, use_bias=False, dtype=dtype,
                   kernel_init=part("tensor", None))(nn.gelu(h))
      return x + h if cache is None else (x + h, new_cache)

  class LM(nn.Module):
    @nn.compact
    def __call__(self, tokens, pos, caches=None, cache_seqlens=None,
                 page_table=None):
      """Logits; with ``caches`` (one (k, v) pair per layer) the tokens
      extend the cached sequences: returns (logits, caches)."""
      emb = nn.Embed(args.vocab, D, dtype=dtype,
                     embedding_init=nn.with_partitioning(
                         nn.initializers.normal(D ** -0.5), (None, None)))
      x = emb(tokens)
      new = []
      for i in range(args.layers):
        if caches is None:
          x = Block()(x, pos)
        else:
          x, c = Block()(x, pos, (*caches[i], cache_seqlens, page_table))
          new.append(c)
      x = nn.RMSNorm(dtype=dtype)(x)
      logits = emb.attend(x).astype(jnp.float32)
      return logits if caches is None else (logits, new)

  return LM()


def model_flops_per_step(args):
  """Training FLOPs (fwd + bwd = 3x fwd) of the matmuls, causal attention."""
  B, T, L = args.batch, args.seq_len, args.layers
  N, K, H, V = args.heads, args.kv_heads, args.head_dim, args.vocab
  D = N * H
  dense = L * (D * N * H + 2 * D * K * H + N * H * D + 2 * 4 * D * D) + D * V
  attn = L * 2 * 2 * T * T * N * H / 2  # QK^T and PV, half under causal
  return 3 * (2 * dense * B * T + attn * B)


# -------------------------------------------------------------------- data
def make_batch(args, rng, step, n_ctx):
  """Copy task: random ``period``-blocks tiled; next-token targets."""
  import numpy as np
  from jax_fa3.ring import to_zigzag
  r = np.random.default_rng((args.seed, step))
  reps = -(-(args.seq_len + 1) // args.period)
  block = r.integers(0, args.vocab, (args.batch, args.period), np.int32)
  seq = np.tile(block, (1, reps))[:, :args.seq_len + 1]
  x, y = seq[:, :-1], seq[:, 1:]
  pos = np.broadcast_to(np.arange(args.seq_len, dtype=np.int32), x.shape)
  # Loss mask: the first block is unpredictable noise, score the rest.
  w = (np.arange(args.seq_len) >= args.period - 1).astype(np.float32)
  w = np.broadcast_to(w, x.shape)
  if n_ctx > 1:  # zig-zag sequence order for the load-balanced causal ring
    x, y, pos, w = (np.asarray(to_zigzag(a, n_ctx, axis=1))
                    for a in (x, y, pos, w))
  return x, y, pos, w


# --------------------------------------------------------------- training
class _Bar:
  """tqdm if installed, else a one-line text bar."""

  def __init__(self, total, desc):
    try:
      from tqdm import tqdm
      self._t = tqdm(total=total, desc=desc, leave=False)
    except ImportError:
      self._t = None
    self.total, self.desc, self.n = total, desc, 0

  def update(self, loss):
    self.n += 1
    if self._t is not None:
      self._t.set_postfix(loss=f"{loss:.4f}")
      self._t.update(1)
    elif sys.stdout.isatty():
      w = 30
      f = int(w * self.n / self.total)
      sys.stdout.write(f"\r{self.desc} [{'#' * f}{'.' * (w - f)}] "
                       f"{self.n}/{self.total} loss {loss:.4f}")
      sys.stdout.flush()
    elif self.n % max(1, self.total // 5) == 0 or self.n == self.total:
      print(f"{self.desc} step {self.n}/{self.total} loss {loss:.4f}",
            flush=True)

  def close(self):
    if self._t is not None:
      self._t.close()
    elif sys.stdout.isatty():
      sys.stdout.write("\r" + " " * (len(self.desc) + 70) + "\r")
      sys.stdout.flush()


def make_mesh(args):
  import numpy as np
  import jax
  from jax.sharding import Mesh
  devs = jax.devices()
  n = len(devs)
  tp, cp = args.tensor, args.context
  dp = args.data if args.data > 0 else n // (tp * cp)
  if dp * tp * cp != n and args.data > 0:
    devs = devs[:dp * tp * cp]
  if dp < 1 or dp * tp * cp > n:
    raise ValueError(f"mesh data {dp} x tensor {tp} x context {cp} does not "
                     f"fit {n} devices")
  if args.batch % dp:
    raise ValueError(f"--batch {args.batch} must be divisible by the data "
                     f"axis ({dp})")
  if args.kv_heads % tp:
    raise ValueError(f"--kv-heads {args.kv_heads} must be divisible by "
                     f"--tensor {tp}")
  if cp > 1 and args.seq_len % (2 * cp):
    raise ValueError(f"--seq-len {args.seq_len} must be divisible by 2 x "
                     f"--context ({2 * cp})")
  arr = np.array(devs[:dp * tp * cp]).reshape(dp, tp, cp)
  return Mesh(arr, ("data", "tensor", "context"))


def make_train_step(args, mesh, attention):
  """Returns (model, init_fn, step_fn); step_fn(state, x, y, pos, w)."""
  import jax
  import jax.numpy as jnp
  import optax
  import flax.linen as nn
  from jax.sharding import NamedSharding, PartitionSpec as P

  model = _build(args, mesh, attention)
  warmup = max(1, args.steps // 10)
  sched = optax.join_schedules(
      [optax.linear_schedule(args.lr / warmup, args.lr, warmup),
       optax.constant_schedule(args.lr)], [warmup])
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=0.0))
  data_sh = NamedSharding(mesh, P("data", "context"))

  def loss_fn(params, x, y, pos, w):
    logits = model.apply({"params": params}, x, pos)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    return jnp.sum(ce * w) / jnp.sum(w)

  def init(key, x, pos):
    params = nn.unbox(model.init(key, x, pos)["params"])
    return params, tx.init(params)

  x0 = jnp.zeros((args.batch, args.seq_len), jnp.int32)
  abstract = jax.eval_shape(lambda k: model.init(k, x0, x0),
                            jax.random.key(0))
  p_spec = nn.get_partition_spec(abstract)["params"]
  p_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), p_spec)
  opt_sh = jax.eval_shape(lambda p: tx.init(p),
                          jax.eval_shape(lambda k: nn.unbox(
                              model.init(k, x0, x0)["params"]),
                              jax.random.key(0)))
  # Adam moments follow their parameter's sharding; counters replicate.
  opt_sh = jax.tree.map(lambda _: NamedSharding(mesh, P()), opt_sh)
  opt_sh = _moments_like_params(opt_sh, p_sh)
  init_fn = jax.jit(init, in_shardings=(None, data_sh, data_sh),
                    out_shardings=(p_sh, opt_sh))

  def step(state, x, y, pos, w):
    params, opt = state
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y, pos, w)
    upd, opt = tx.update(grads, opt, params)
    return (optax.apply_updates(params, upd), opt), loss

  step_fn = jax.jit(step, in_shardings=((p_sh, opt_sh),) + (data_sh,) * 4,
                    out_shardings=((p_sh, opt_sh), None), donate_argnums=0)
  return model, init_fn, step_fn, data_sh


def _moments_like_params(opt_sh, p_sh):
  """Gives optax mu/nu subtrees (same structure as params) the param shardings."""
  import jax
  p_struct = jax.tree.structure(p_sh)

  def fix(node):
    if hasattr(node, "_fields"):
      vals = []
      for f in node._fields:
        sub = getattr(node, f)
        vals.append(p_sh if (not hasattr(sub, "_fields") and
                             jax.tree.structure(sub) == p_struct) else fix(sub))
      return type(node)(*vals)
    if isinstance(node, tuple):
      return tuple(fix(n) for n in node)
    return node
  return fix(opt_sh)


def train(args, mesh, attention, quiet=False):
  """Trains one backend; returns dict(losses, step_s, compile_s)."""
  import numpy as np
  import jax
  model, init_fn, step_fn, data_sh = make_train_step(args, mesh, attention)
  # Only the ring (fa3 with a context axis) uses the zig-zag order; jax.nn
  # masks by array position, so it gets the natural order.
  n_ctx = args.context if attention == "fa3" else 1
  put = lambda a: jax.device_put(a, data_sh)
  x, y, pos, w = map(put, make_batch(args, None, 0, n_ctx))
  state = init_fn(jax.random.key(args.seed), x, pos)
  t0 = time.perf_counter()
  state, loss = step_fn(state, x, y, pos, w)  # compile + first step
  losses = [float(loss)]
  compile_s = time.perf_counter() - t0
  bar = None if quiet else _Bar(args.steps, f"{attention:>5}")
  if bar:
    bar.update(losses[0])
  times = []
  for i in range(1, args.steps):
    batch = tuple(map(put, make_batch(args, None, i, n_ctx)))
    t = time.perf_counter()
    state, loss = step_fn(state, *batch)
    loss = float(loss)  # syncs: the step time includes the whole step
    times.append(time.perf_counter() - t)
    losses.append(loss)
    if bar:
      bar.update(loss)
  if bar:
    bar.close()
  step_s = float(np.median(times)) if times else float("nan")
  return dict(losses=losses, step_s=step_s, compile_s=compile_s,
              model=model, params=state[0])


# ------------------------------------------------------------- generation
def generate(args, model, params):
  """Greedy decoding of a copy-task prompt with a paged KV cache: a chunked
  prefill of two periods, then ``--generate`` steps of one token.  Checks the
  decode logits against the full-sequence forward on the same tokens, and
  reports how many tokens continue the copy correctly, tokens/s and the
  attention's K/V read rate.  Returns True when the cache path agrees."""
  import numpy as np
  import jax
  import jax.numpy as jnp
  B, K, H, ps = args.batch, args.kv_heads, args.head_dim, args.page_size
  prompt_len, n = 2 * args.period, args.generate
  x, _, _, _ = make_batch(args, None, 10 ** 6, 1)
  block = x[:, :args.period]
  want = block[:, (prompt_len + np.arange(n)) % args.period]
  cap = prompt_len + n
  per_row = -(-cap // ps)
  rng = np.random.default_rng(args.seed)
  table = jnp.asarray(rng.permutation(B * per_row).reshape(B, per_row)
                      .astype(np.int32))  # non-contiguous pages
  dtype = jnp.dtype(args.dtype)
  caches = [tuple(jnp.zeros((B * per_row, ps, K, H), dtype) for _ in "kv")
            for _ in range(args.layers)]

  @functools.partial(jax.jit, donate_argnums=(3,))
  def step(params, tokens, pos, caches, lens):
    logits, caches = model.apply({"params": params}, tokens, pos, caches,
                                 lens, table)
    return logits[:, -1], caches

  prompt = jnp.asarray(x[:, :prompt_len])
  pos = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), prompt.shape)
  last, caches = step(params, prompt, pos, caches, jnp.zeros((B,), jnp.int32))
  out, logits, times = [], [last], []
  for i in range(n):
    tok = jnp.argmax(last, axis=-1).astype(jnp.int32)[:, None]
    out.append(tok)
    if i == n - 1:
      break
    t = time.perf_counter()
    last, caches = step(params, tok, jnp.full((B, 1), prompt_len + i, jnp.int32),
                        caches, jnp.full((B,), prompt_len + i, jnp.int32))
    last.block_until_ready()
    if i:  # the first decode step compiles
      times.append(time.perf_counter() - t)
    logits.append(last)
  gen = np.asarray(jnp.concatenate(out, axis=1))
  # The same tokens through the training forward: its logits at each
  # position must match what the cache path produced there.
  seq = jnp.concatenate([prompt, jnp.asarray(gen[:, :-1])], axis=1)
  full = model.apply({"params": params}, seq, jnp.broadcast_to(
      jnp.arange(seq.shape[1], dtype=jnp.int32), seq.shape))
  got = jnp.stack(logits, axis=1)
  ref = full[:, prompt_len - 1:]
  err = float(jnp.max(jnp.abs(got - ref)) / (jnp.max(jnp.abs(ref)) + 1e-6))
  agree = err < (2e-2 if dtype == jnp.float32 else 1e-1)
  acc = float(np.mean(gen == want))
  step_s = float(np.median(times)) if times else float("nan")
  kv_bytes = args.layers * B * (prompt_len + n / 2) * K * H * 2 * dtype.itemsize
  print(f"generate: {n} tokens x batch {B}, paged cache ({ps}-token pages) | "
        f"copy continuation {100 * acc:.1f}% right | decode logits vs full "
        f"forward: rel. err {err:.2e} ({'ok' if agree else 'MISMATCH'}) | "
        f"{B / step_s:,.0f} tokens/s | K/V read {kv_bytes / step_s / 1e9:.2f} GB/s")
  return agree


# ------------------------------------------------------------- the check
def attention_check(args, on_gpu):
  """jax_fa3 vs fp32 reference, next to jax.nn in the same dtype."""
  import jax
  import jax.numpy as jnp
  import jax_fa3
  T = min(args.seq_len, 4096)
  dt = jnp.dtype(args.dtype)
  ks = jax.random.split(jax.random.key(args.seed), 3)
  q = jax.random.normal(ks[0], (1, T, args.heads, args.head_dim)).astype(dt)
  k = jax.random.normal(ks[1], (1, T, args.kv_heads, args.head_dim)).astype(dt)
  v = jax.random.normal(ks[2], (1, T, args.kv_heads, args.head_dim)).astype(dt)
  f32 = lambda a: a.astype(jnp.float32)
  with jax.default_matmul_precision("highest"):
    ref = jax.nn.dot_product_attention(f32(q), f32(k), f32(v), is_causal=True,
                                       implementation="xla")
  ours = jax.jit(lambda *a: jax_fa3.attention(*a, is_causal=True))(q, k, v)
  impl = "cudnn" if on_gpu and dt != jnp.float32 else "xla"
  theirs = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                        implementation=impl)
  e_ours = float(jnp.max(jnp.abs(f32(ours) - ref)))
  e_theirs = float(jnp.max(jnp.abs(f32(theirs) - ref)))
  ok = e_ours <= 2 * e_theirs + 2e-2
  print(f"attention check (T={T}, causal, GQA {args.heads}/{args.kv_heads}, "
        f"{args.dtype}): max|jax_fa3 - fp32| = {e_ours:.2e}, "
        f"jax.nn ({impl}) {e_theirs:.2e} -> {'OK' if ok else 'MISMATCH'}")
  return ok


def _plot(path, results, args):
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib not installed: no loss plot")
    return
  fig, ax = plt.subplots(figsize=(7, 4))
  for name, r in results.items():
    ax.plot(range(1, len(r["losses"]) + 1), r["losses"],
            label=f"{name} ({r['step_s'] * 1e3:.1f} ms/step)")
  ax.set_xlabel("step")
  ax.set_ylabel("loss (copy task, masked CE)")
  ax.set_title(f"jax_fa3 demo: seq {args.seq_len}, {args.layers} layers, "
               f"heads {args.heads}/{args.kv_heads}x{args.head_dim}, "
               f"{args.dtype}", fontsize=9)
  ax.legend()
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  print(f"loss curves -> {path}")


def main(argv=None):
  argv = sys.argv[1:] if argv is None else list(argv)
  # --cpu-devices has to act before JAX creates its backends.
  pre = argparse.ArgumentParser(add_help=False)
  pre.add_argument("--cpu-devices", type=int, default=0)
  n_cpu = pre.parse_known_args(argv)[0].cpu_devices
  import jax
  if n_cpu:
    try:
      jax.config.update("jax_num_cpu_devices", n_cpu)
    except Exception:  # pragma: no cover - older jax
      os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                 f" --xla_force_host_platform_device_count"
                                 f"={n_cpu}")
    jax.config.update("jax_platforms", "cpu")
  import jax_fa3
  from jax_fa3 import _native
  on_gpu = (not n_cpu) and _native.available() and _native.sm90_gpu_present()
  args = parse_args(argv, on_gpu)
  backends = [b.strip() for b in args.attention.split(",") if b.strip()]
  for b in backends:
    if b not in ("fa3", "cudnn", "xla"):
      raise SystemExit(f"--attention: unknown backend {b!r} (fa3|cudnn|xla)")
    if b == "cudnn" and jax.default_backend() != "gpu":
      raise SystemExit("--attention cudnn needs a GPU")

  mesh = make_mesh(args)
  kernel = (on_gpu and (args.dtype, args.head_dim) in
            _native.compiled_configs())
  dev = jax.devices()[0]
  print(f"jax_fa3 {jax_fa3.__version__} | jax {jax.__version__} | "
        f"{len(jax.devices())} x {dev.device_kind} | fa3 path: "
        f"{'FA3 kernel' if kernel else 'reference'}")
  print(f"model: {args.layers} layers, d_model {args.heads * args.head_dim}, "
        f"heads {args.heads}/{args.kv_heads} (GQA) x {args.head_dim}, vocab "
        f"{args.vocab}, {args.dtype} | batch {args.batch} x seq "
        f"{args.seq_len} | mesh data {mesh.shape['data']} x tensor "
        f"{mesh.shape['tensor']} x context {mesh.shape['context']}"
        f"{' (ring attention, zig-zag)' if args.context > 1 else ''}")
  if args.context > 1 and any(b != "fa3" for b in backends):
    print("note: cudnn/xla attention has no context parallelism: it gathers "
          "the sequence and runs replicated over the context axis")
  ok = True
  if not args.no_check:
    ok = attention_check(args, on_gpu) and ok

  flops = model_flops_per_step(args)
  peak = H200_BF16_PEAK * mesh.size if jax.default_backend() == "gpu" else None
  results = {}
  for b in backends:
    r = train(args, mesh, b)
    results[b] = r
    tok_s = args.batch * args.seq_len / r["step_s"]
    mfu = (f"{100 * flops / r['step_s'] / peak:.1f}%" if peak else
           "n/a (CPU)")
    print(f"{b:>5}: loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} | "
          f"step {r['step_s'] * 1e3:.2f} ms | {tok_s:,.0f} tokens/s | "
          f"{flops / r['step_s'] / 1e12:.2f} TFLOP/s | MFU {mfu} | "
          f"compile {r['compile_s']:.1f} s")
    finite = all(math.isfinite(x) for x in r["losses"])
    learned = r["losses"][-1] < r["losses"][0]
    if not (finite and learned):
      print(f"{b}: loss did not decrease or is not finite")
      ok = False
  if len(results) > 1:
    import numpy as np
    names = list(results)
    a = np.array(results[names[0]]["losses"])
    for other in names[1:]:
      o = np.array(results[other]["losses"])
      d = np.abs(a - o)
      print(f"{names[0]} vs {other}: max |loss diff| {d.max():.4f} (mean "
            f"{d.mean():.4f}) over {len(a)} steps; step time ratio "
            f"{results[names[0]]['step_s'] / results[other]['step_s']:.3f}")
  if args.generate:
    r = results.get("fa3") or next(iter(results.values()))
    ok = generate(args, r["model"], r["params"]) and ok
  if args.plot:
    _plot(args.plot, results, args)
  print("demo:", "OK" if ok else "FAILED")
  return 0 if ok else 1


if __name__ == "__main__":
  raise SystemExit(main())
