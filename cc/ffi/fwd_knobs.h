// Forward benchmark knobs, read once per process (A/B runs in one build);
// the defaults are the measured best. Shared by the 16-bit and the FP8
// handlers, whose kernels take the same tile order and ping-pong fields.
//   JAX_FA3_CAUSAL_ORDER=mmajor   causal tiles longest-first across heads
//                                 (default: equal-cost pairs per head)
//   JAX_FA3_CAUSAL_PINGPONG=0     no warpgroup ping-pong for masked problems
#pragma once

#include <cstdlib>
#include <cstring>

#include "../fwd/params.h"

namespace jax_fa3 {

inline void apply_env_knobs(FwdParams& p) {
  static const int order = [] {
    const char* v = std::getenv("JAX_FA3_CAUSAL_ORDER");
    return (v && std::strcmp(v, "mmajor") == 0) ? 1 : 0;
  }();
  static const bool pingpong = [] {
    const char* v = std::getenv("JAX_FA3_CAUSAL_PINGPONG");
    return !(v && std::strcmp(v, "0") == 0);
  }();
  p.causal_order = order;
  p.pingpong_masked = pingpong;
}

}  // namespace jax_fa3
