// nanobind module: hands the FFI handlers to Python as capsules and reports
// which (dtype, head dim) kernels were compiled. Everything heavy is in
// libjax_fa3_kernels.so, which does not depend on the Python version.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <utility>
#include <vector>

extern "C" {
void* jax_fa3_fwd_handler();
int jax_fa3_num_fwd_kernels();
int jax_fa3_fwd_kernel_config(int i, int* dtype, int* head_dim);
void* jax_fa3_bwd_handler();
int jax_fa3_num_bwd_kernels();
void jax_fa3_bwd_kernel_config(int i, int* dtype, int* head_dim);
void* jax_fa3_fp8_quantize_handler();
void* jax_fa3_fp8_fwd_handler();
int jax_fa3_num_fp8_fwd_kernels();
void jax_fa3_fp8_fwd_kernel_config(int i, int* out_dtype, int* head_dim);
}

namespace nb = nanobind;

NB_MODULE(_jax_fa3, m) {
  m.doc() = "jax_fa3 native kernels (XLA FFI handlers)";
  m.def("registrations", [] {
    nb::dict d;
    d["jax_fa3_fwd"] = nb::capsule(jax_fa3_fwd_handler());
    d["jax_fa3_bwd"] = nb::capsule(jax_fa3_bwd_handler());
    d["jax_fa3_fp8_quantize"] = nb::capsule(jax_fa3_fp8_quantize_handler());
    d["jax_fa3_fp8_fwd"] = nb::capsule(jax_fa3_fp8_fwd_handler());
    return d;
  });
  m.def("compiled_configs", [] {
    static const char* names[] = {"bfloat16", "float16"};
    std::vector<std::pair<std::string, int>> out;
    for (int i = 0; i < jax_fa3_num_fwd_kernels(); ++i) {
      int dtype = 0, hd = 0;
      if (jax_fa3_fwd_kernel_config(i, &dtype, &hd)) { out.emplace_back(names[dtype], hd); }
    }
    return out;
  });
  // (dtype, head dim) pairs with a backward kernel; the others differentiate
  // through the reference backward.
  m.def("compiled_bwd_configs", [] {
    static const char* names[] = {"bfloat16", "float16"};
    std::vector<std::pair<std::string, int>> out;
    for (int i = 0; i < jax_fa3_num_bwd_kernels(); ++i) {
      int dtype = 0, hd = 0;
      jax_fa3_bwd_kernel_config(i, &dtype, &hd);
      out.emplace_back(names[dtype], hd);
    }
    return out;
  });
  // (output dtype, head dim) pairs with an FP8 forward kernel (issue 5).
  m.def("compiled_fp8_configs", [] {
    static const char* names[] = {"bfloat16", "float16"};
    std::vector<std::pair<std::string, int>> out;
    for (int i = 0; i < jax_fa3_num_fp8_fwd_kernels(); ++i) {
      int dtype = 0, hd = 0;
      jax_fa3_fp8_fwd_kernel_config(i, &dtype, &hd);
      out.emplace_back(names[dtype], hd);
    }
    return out;
  });
}
