// nanobind module: hands the FFI handlers to Python as capsules and reports
// which (dtype, head dim) kernels were compiled. Everything heavy is in
// libjax_fa3_kernels.so, which does not depend on the Python version.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <tuple>
#include <utility>
#include <vector>

// The C entry points of cc/ffi/*_handler.cc.
extern "C" {
void* jax_fa3_fwd_handler();
void* jax_fa3_kvcache_fwd_handler();
void* jax_fa3_kvcache_append_handler();
int jax_fa3_num_fwd_kernels();
int jax_fa3_fwd_kernel_config(int i, int* dtype, int* head_dim);
int jax_fa3_fwd_kernel_value_dim(int i);
void* jax_fa3_bwd_handler();
int jax_fa3_num_bwd_kernels();
int jax_fa3_bwd_kernel_config(int i, int* dtype, int* head_dim);
void* jax_fa3_fp8_quantize_handler();
void* jax_fa3_fp8_fwd_handler();
int jax_fa3_num_fp8_fwd_kernels();
void jax_fa3_fp8_fwd_kernel_config(int i, int* out_dtype, int* head_dim);
}

namespace nb = nanobind;

namespace {

// FFI target name -> handler, as jax.ffi.register_ffi_target takes them.
struct Target {
  const char* name;
  void* (*handler)();
};
constexpr Target kTargets[] = {
    {"jax_fa3_fwd", jax_fa3_fwd_handler},
    {"jax_fa3_kvcache_fwd", jax_fa3_kvcache_fwd_handler},
    {"jax_fa3_kvcache_append", jax_fa3_kvcache_append_handler},
    {"jax_fa3_bwd", jax_fa3_bwd_handler},
    {"jax_fa3_fp8_quantize", jax_fa3_fp8_quantize_handler},
    {"jax_fa3_fp8_fwd", jax_fa3_fp8_fwd_handler},
};

using Config = std::pair<std::string, int>;

// DType numbering (cc/fwd/params.h) -> the dtype's NumPy name.
const char* dtype_name(int dtype) { return dtype == 0 ? "bfloat16" : "float16"; }

// (dtype name, head dim) of the rows of one kernel table that `config`
// accepts; config(i, &dtype, &head_dim) fills row i (DType numbering).
template <class ConfigFn>
std::vector<Config> list_configs(int count, ConfigFn config) {
  std::vector<Config> out;
  for (int i = 0; i < count; ++i) {
    int dtype = 0, head_dim = 0;
    if (config(i, &dtype, &head_dim)) { out.emplace_back(dtype_name(dtype), head_dim); }
  }
  return out;
}

// (dtype name, head dim, value head dim) of the rows of one kernel table whose
// V head dim differs from Q/K's; value_dim(i, &dtype, &head_dim) fills row i
// and returns that V head dim, or 0 where it is Q/K's.
template <class ValueDimFn>
std::vector<std::tuple<std::string, int, int>> list_value_configs(int count, ValueDimFn value_dim) {
  std::vector<std::tuple<std::string, int, int>> out;
  for (int i = 0; i < count; ++i) {
    int dtype = 0, head_dim = 0;
    if (const int dv = value_dim(i, &dtype, &head_dim)) { out.emplace_back(dtype_name(dtype), head_dim, dv); }
  }
  return out;
}

// For the tables whose every row is reported.
template <void (*Fn)(int, int*, int*)>
bool every_row(int i, int* dtype, int* head_dim) {
  Fn(i, dtype, head_dim);
  return true;
}

}  // namespace

NB_MODULE(_jax_fa3, m) {
  m.doc() = "jax_fa3 native kernels (XLA FFI handlers)";
  m.def("registrations", [] {
    nb::dict d;
    for (const Target& t : kTargets) { d[t.name] = nb::capsule(t.handler()); }
    return d;
  });
  // Forward: only the default tiles, the kernels Python dispatches to by (dtype, head dim).
  m.def("compiled_configs", [] {
    return list_configs(jax_fa3_num_fwd_kernels(), jax_fa3_fwd_kernel_config);
  });
  // (dtype, head dim, value head dim) of the forward tiles for a V head dim
  // unlike Q/K's.
  m.def("compiled_value_configs", [] {
    return list_value_configs(jax_fa3_num_fwd_kernels(), [](int i, int* dtype, int* head_dim) {
      jax_fa3_fwd_kernel_config(i, dtype, head_dim);
      return jax_fa3_fwd_kernel_value_dim(i);
    });
  });
  // (dtype, head dim) pairs with a backward kernel (V's head dim the same);
  // the others differentiate through the reference backward.
  m.def("compiled_bwd_configs", [] {
    return list_configs(jax_fa3_num_bwd_kernels(), [](int i, int* dtype, int* head_dim) {
      return jax_fa3_bwd_kernel_config(i, dtype, head_dim) == *head_dim;
    });
  });
  // (dtype, head dim, value head dim) of the backward kernels for a V head dim unlike Q/K's.
  m.def("compiled_bwd_value_configs", [] {
    return list_value_configs(jax_fa3_num_bwd_kernels(), [](int i, int* dtype, int* head_dim) {
      const int dv = jax_fa3_bwd_kernel_config(i, dtype, head_dim);
      return dv != *head_dim ? dv : 0;
    });
  });
  // (output dtype, head dim) pairs with an FP8 forward kernel, one per V layout.
  m.def("compiled_fp8_configs", [] {
    return list_configs(jax_fa3_num_fp8_fwd_kernels(), every_row<jax_fa3_fp8_fwd_kernel_config>);
  });
}
