"""jax_fa3: FlashAttention-3 (CUTLASS sm_90a kernels) for JAX via XLA FFI."""
from jax_fa3 import _native
from jax_fa3.api import (attention, attention_fp8, dot_product_attention,
                         flax_attention_fn, ring_attention)
from jax_fa3.fp8 import quantize_fp8
from jax_fa3.kvcache import attention_with_kvcache
from jax_fa3.ring import from_zigzag, to_zigzag

__version__ = "0.1.0"
__all__ = ["attention", "dot_product_attention", "flax_attention_fn",
           "kernels_available", "__version__", "ring_attention",
           "to_zigzag", "from_zigzag", "attention_fp8", "quantize_fp8",
           "attention_with_kvcache"]


def kernels_available() -> bool:
  """True iff the compiled FlashAttention-3 kernel extension was loaded."""
  return _native.available()
