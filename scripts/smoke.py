"""Kernel smoke check straight through the FFI target (no jax_fa3 API layer):
every compiled (dtype, head dim) on a few awkward shapes against a dense
float32 reference with the kernel's exact masking semantics.

  PYTHONPATH=. python3 scripts/smoke.py [--quick]
"""
import argparse
import sys
import time

import numpy as np
import jax
import jax.numpy as jnp

from jax_fa3 import _jax_fa3

for name, cap in _jax_fa3.registrations().items():
    jax.ffi.register_ffi_target(name, cap, platform="CUDA")


def fa3_fwd(q, k, v, q_lens, kv_lens, scale, softcap=0.0, left=-1, right=-1):
    b, t, n, d = q.shape
    call = jax.ffi.ffi_call(
        "jax_fa3_fwd",
        (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, n, t), jnp.float32)))
    return call(q, k, v, q_lens, kv_lens, scale=np.float32(scale), softcap=np.float32(softcap),
                window_left=np.int32(left), window_right=np.int32(right))


def dense_ref(q, k, v, q_lens, kv_lens, scale, softcap=0.0, left=-1, right=-1):
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    b, t, n, d = q.shape
    s_len, kh = k.shape[1], k.shape[2]
    g = n // kh
    k = jnp.repeat(k, g, axis=2)
    v = jnp.repeat(v, g, axis=2)
    with jax.default_matmul_precision("highest"):
        s = jnp.einsum("btnd,bsnd->bnts", q, k) * scale
        if softcap > 0:
            s = softcap * jnp.tanh(s / softcap)
        i = jnp.arange(t)[:, None]
        j = jnp.arange(s_len)[None, :]
        vis = jnp.ones((t, s_len), bool)
        if left >= 0:
            vis &= j >= i - left
        if right >= 0:
            vis &= j <= i + right
        vis = vis[None] & (j[None] < kv_lens[:, None, None]) & (i[None] < q_lens[:, None, None])
        vis = vis[:, None]
        s = jnp.where(vis, s, -jnp.inf)
        m = jnp.max(s, -1, keepdims=True)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        p = jnp.where(vis, jnp.exp(s - m), 0.0)
        l = p.sum(-1, keepdims=True)
        o = jnp.einsum("bnts,bsnd->btnd", p / jnp.where(l > 0, l, 1.0), v)
        lse = jnp.where(l[..., 0] > 0, jnp.log(jnp.where(l[..., 0] > 0, l[..., 0], 1.0)) + m[..., 0], jnp.inf)
    return o, lse


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--hdims", default="", help="comma-separated head dims (default: all compiled)")
    ap.add_argument("--dtypes", default="", help="bfloat16,float16 (default: all compiled)")
    args = ap.parse_args()
    configs = [(dt, hd) for dt, hd in _jax_fa3.compiled_configs()
               if (not args.hdims or str(hd) in args.hdims.split(","))
               and (not args.dtypes or dt in args.dtypes.split(","))]
    print("compiled:", configs, "device:", jax.devices()[0].device_kind)
    cases = [  # (b, t, s, n, kh, causal, window, softcap, seqlens)
        (2, 128, 128, 4, 4, False, None, 0.0, False),
        (1, 1, 239, 2, 2, False, None, 0.0, False),
        (2, 113, 203, 6, 2, True, None, 0.0, False),
        (1, 640, 128, 6, 1, True, None, 0.0, False),
        (2, 1023, 1024, 2, 2, False, None, 0.0, True),
        (1, 384, 256, 4, 2, False, (64, 31), 0.0, False),
        (1, 257, 300, 2, 1, False, None, 30.0, False),
    ]
    if args.quick:  # odd lengths, GQA + causal, decode, seq lengths
        cases = [cases[1], cases[2], cases[4]]
    worst = 0.0
    failed = 0
    key = jax.random.PRNGKey(0)
    for dtype_name, hd in configs:
        dtype = jnp.bfloat16 if dtype_name == "bfloat16" else jnp.float16
        for (b, t, s, n, kh, causal, window, softcap, seqlens) in cases:
            key, k1, k2, k3, k4 = jax.random.split(key, 5)
            q = jax.random.normal(k1, (b, t, n, hd), jnp.float32).astype(dtype)
            k = jax.random.normal(k2, (b, s, kh, hd), jnp.float32).astype(dtype)
            v = jax.random.normal(k3, (b, s, kh, hd), jnp.float32).astype(dtype)
            if seqlens:
                q_lens = jnp.array([t - 5, t // 3][:b], jnp.int32)
                kv_lens = jnp.array([s // 2 + 1, 0][:b], jnp.int32)
            else:
                q_lens = jnp.full((b,), t, jnp.int32)
                kv_lens = jnp.full((b,), s, jnp.int32)
            left, right = (window if window else (-1, -1))
            if causal:
                right = 0
            scale = 1.0 / np.sqrt(hd)
            t0 = time.time()
            o, lse = jax.jit(fa3_fwd, static_argnums=(5, 6, 7, 8))(q, k, v, q_lens, kv_lens, scale, softcap, left, right)
            o.block_until_ready()
            ro, rlse = dense_ref(q, k, v, q_lens, kv_lens, scale, softcap, left, right)
            # Same-dtype XLA error bound as in FA3's rule (P rounded to dtype).
            err = float(jnp.max(jnp.abs(o.astype(jnp.float32) - ro)))
            fin = jnp.isfinite(rlse)
            lse_err = float(jnp.max(jnp.where(fin, jnp.abs(lse - rlse), 0.0)))
            lse_inf_ok = bool(jnp.all(jnp.where(fin, True, jnp.isinf(lse))))
            nan = bool(jnp.any(jnp.isnan(o.astype(jnp.float32))))
            ok = err < 2e-2 and lse_err < 1e-2 and lse_inf_ok and not nan
            worst = max(worst, err)
            failed += not ok
            print(f"{'ok ' if ok else 'BAD'} {dtype_name:8s} d{hd:3d} b{b} t{t} s{s} n{n}/{kh} causal={causal} "
                  f"win={window} cap={softcap} lens={seqlens}: max|o-ref|={err:.2e} lse={lse_err:.2e} "
                  f"inf_ok={lse_inf_ok} nan={nan} ({time.time() - t0:.1f}s)", flush=True)
    print(f"SMOKE {'PASS' if failed == 0 else 'FAIL'}: {failed} bad, worst {worst:.2e}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
