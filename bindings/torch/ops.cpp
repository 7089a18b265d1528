// gradzip's codecs as PyTorch operators (TORCH_LIBRARY namespace `gradzip`).
//
// Thin: every op validates its tensors (dtype -> TypeError; layout, device, sizes -> ValueError),
// allocates what it returns through PyTorch's allocator, and calls the host API (gradzip.hpp) or,
// for CUDA tensors, gradzip::cuda on the current stream. gradzip::Error becomes ValueError (bad
// spec, bad argument, corrupt payload, size mismatch) or RuntimeError (CUDA failure), with the
// library's message, which names the reason.
//
// Ops (schemas below): encoded_bytes, canonical_spec, encode[_into], encode_with_feedback[_into],
// decode[_into], decode_add, header, set_num_threads, num_threads, cpu_isa, cuda_available.
//
// Registration, as PyTorch's tooling (torch.compile, export, torch.library.opcheck) expects it:
//   - TORCH_LIBRARY defines every schema. The ops without tensor arguments (encoded_bytes,
//     canonical_spec, the settings, cpu_isa, cuda_available) get their kernel there too, a
//     catch-all (CompositeImplicitAutograd) one, so they also run while tracing.
//   - The tensor ops are schema-only there; their kernels are registered per backend, for the CPU
//     and CUDA dispatch keys (TORCH_LIBRARY_IMPL below). The kernels are the same functions for both:
//     each picks the host or the CUDA codec from its tensors' device.
//   - Their fake (meta) implementations, which give the output's size and dtype without running a
//     codec, are in Python (bindings/python/gradzip/_fake.py, registered with
//     torch.library.register_fake when the package loads this library); they take every size from
//     encoded_bytes above. register_fake also makes them the Meta kernels, so they reject tensors
//     on a device other than CPU and CUDA (a plain meta tensor) as check_device does. Loaded
//     without the package, the tensor ops run on CPU and CUDA tensors but cannot be traced.
//   - The mutable arguments are annotated (Tensor(a!)), so functionalization sees the in-place
//     writes (residual, out); none of the ops has an autograd formula (they are not differentiable).
#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstring>
#include <string>

#include "device_codec.hpp"
#include "gradzip/gradzip.hpp"

#if defined(GRADZIP_TORCH_CUDA)
#include "gradzip/cuda.hpp"
#endif

namespace {

using at::Tensor;

using gradzip::torch_ext::guarded;

gradzip::Codec parse(const char* op, const std::string& spec) {
  return guarded(op, [&] { return gradzip::Codec::parse(spec); });
}

void check_device(const char* op, const char* name, const Tensor& t) {
  const auto type = t.device().type();
  TORCH_CHECK_VALUE(type == c10::DeviceType::CPU || type == c10::DeviceType::CUDA, "gradzip.", op,
                    ": ", name, " is on device ", t.device(), "; only CPU and CUDA are supported");
#if !defined(GRADZIP_TORCH_CUDA)
  TORCH_CHECK_VALUE(type == c10::DeviceType::CPU, "gradzip.", op, ": ", name,
                    " is a CUDA tensor but this gradzip build has no CUDA support (rebuild with "
                    "nvcc available and a CUDA build of torch)");
#endif
}

// The codecs read flat memory: a sparse tensor (which reaches these kernels through the sparse
// dispatch keys registered below) is refused before anything else, naming its layout.
void check_dense(const char* op, const char* name, const Tensor& t) {
  if (t.layout() == c10::kStrided) return;
  const std::string layout = t.layout() == c10::kSparse      ? "torch.sparse_coo"
                            : t.layout() == c10::kSparseCsr ? "torch.sparse_csr"
                                                            : c10::str(t.layout());
  TORCH_CHECK_VALUE(false, "gradzip.", op, ": ", name, " has layout ", layout,
                    "; the codecs take dense (torch.strided) tensors: pass .to_dense()");
}

// A float32 tensor of any shape, dense and contiguous (the codecs work on flat memory).
void check_float(const char* op, const char* name, const Tensor& t) {
  check_dense(op, name, t);
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, "gradzip.", op, ": ", name,
                   " must be float32, got ", t.scalar_type(),
                   " (cast with .float(); bf16/fp16 gradients are upcast by the Python API)");
  TORCH_CHECK_VALUE(t.is_contiguous(), "gradzip.", op, ": ", name,
                    " must be contiguous (call .contiguous())");
  check_device(op, name, t);
}

// A payload: 1-D contiguous uint8.
void check_bytes(const char* op, const char* name, const Tensor& t) {
  check_dense(op, name, t);
  TORCH_CHECK_TYPE(t.scalar_type() == at::kByte, "gradzip.", op, ": ", name,
                   " must be uint8, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.layout() == c10::kStrided && t.dim() == 1, "gradzip.", op, ": ", name,
                    " must be a 1-D tensor, got ", t.dim(), " dimensions");
  TORCH_CHECK_VALUE(t.is_contiguous(), "gradzip.", op, ": ", name, " must be contiguous");
  check_device(op, name, t);
}

void check_same_device(const char* op, const char* a_name, const Tensor& a, const char* b_name,
                       const Tensor& b) {
  TORCH_CHECK_VALUE(a.device() == b.device(), "gradzip.", op, ": ", a_name, " is on ", a.device(),
                    " but ", b_name, " is on ", b.device());
}

void check_no_overlap(const char* op, const char* a_name, const Tensor& a, const char* b_name,
                      const Tensor& b) {
  TORCH_CHECK_VALUE(at::get_overlap_status(a, b) == at::MemOverlapStatus::No, "gradzip.", op,
                    ": ", a_name, " and ", b_name, " must not share memory");
}

void* bytes_ptr(const Tensor& t) { return t.data_ptr(); }

Tensor workspace(const gradzip::Codec& codec, size_t n, const Tensor& like) {
  const size_t ws = codec.workspace_bytes(n);
  return at::empty({static_cast<int64_t>(ws)}, like.options().dtype(at::kByte));
}

// ---- sizes and specs ----------------------------------------------------------------------------
int64_t encoded_bytes(int64_t n, const std::string& spec) {
  TORCH_CHECK_VALUE(n >= 0, "gradzip.encoded_bytes: n must be >= 0, got ", n);
  const auto codec = parse("encoded_bytes", spec);
  return guarded("encoded_bytes",
                 [&] { return static_cast<int64_t>(codec.encoded_bytes(static_cast<size_t>(n))); });
}

std::string canonical_spec(const std::string& spec) { return parse("canonical_spec", spec).name(); }

// ---- encode -------------------------------------------------------------------------------------
// The one place both encoders run: residual undefined = plain encode.
void encode_impl(const char* op, const Tensor& x, const Tensor* residual, const Tensor& out,
                 const std::string& spec, double prescale) {
  check_float(op, "input", x);
  check_bytes(op, "out", out);
  check_same_device(op, "input", x, "out", out);
  check_no_overlap(op, "input", x, "out", out);
  if (residual) {
    check_float(op, "residual", *residual);
    check_same_device(op, "input", x, "residual", *residual);
    TORCH_CHECK_VALUE(residual->numel() == x.numel(), "gradzip.", op, ": residual has ",
                      residual->numel(), " elements but the gradient has ", x.numel());
    check_no_overlap(op, "input", x, "residual", *residual);
    check_no_overlap(op, "residual", *residual, "out", out);
  }
  const auto codec = parse(op, spec);
  const size_t n = static_cast<size_t>(x.numel());
  const size_t need = guarded(op, [&] { return codec.encoded_bytes(n); });
  TORCH_CHECK_VALUE(static_cast<size_t>(out.numel()) >= need, "gradzip.", op, ": out has ",
                    out.numel(), " bytes but ", codec.name(), " needs ", need, " for ", n,
                    " elements");
  const Tensor ws = workspace(codec, n, x);
  const float ps = static_cast<float>(prescale);
  const float* in = x.const_data_ptr<float>();
  float* res = residual ? residual->data_ptr<float>() : nullptr;
  guarded(op, [&] {
    gradzip::torch_ext::encode_on(x.device(), codec, in, res, n, bytes_ptr(out), need, ps,
                                  ws.data_ptr(), ws.numel());
  });
}

Tensor alloc_payload(const char* op, const Tensor& x, const std::string& spec) {
  check_float(op, "input", x);
  const auto codec = parse(op, spec);
  const size_t need = guarded(op, [&] { return codec.encoded_bytes(static_cast<size_t>(x.numel())); });
  return at::empty({static_cast<int64_t>(need)}, x.options().dtype(at::kByte));
}

Tensor encode(const Tensor& x, const std::string& spec, double prescale) {
  Tensor out = alloc_payload("encode", x, spec);
  encode_impl("encode", x, nullptr, out, spec, prescale);
  return out;
}

void encode_into(const Tensor& x, const Tensor& out, const std::string& spec, double prescale) {
  encode_impl("encode_into", x, nullptr, out, spec, prescale);
}

Tensor encode_with_feedback(const Tensor& grad, const Tensor& residual, const std::string& spec,
                            double prescale) {
  Tensor out = alloc_payload("encode_with_feedback", grad, spec);
  encode_impl("encode_with_feedback", grad, &residual, out, spec, prescale);
  return out;
}

void encode_with_feedback_into(const Tensor& grad, const Tensor& residual, const Tensor& out,
                               const std::string& spec, double prescale) {
  encode_impl("encode_with_feedback_into", grad, &residual, out, spec, prescale);
}

// ---- decode -------------------------------------------------------------------------------------
// The header as the library validates it. A CUDA payload's first 32 bytes are copied to the host
// (a synchronisation: the hot path passes the element count instead and never calls this).
gradzip::WireHeader host_header(const char* op, const Tensor& payload) {
  check_bytes(op, "payload", payload);
  const size_t bytes = static_cast<size_t>(payload.numel());
  if (payload.is_cpu())
    return guarded(op, [&] { return gradzip::read_header(payload.const_data_ptr(), bytes); });
  TORCH_CHECK_VALUE(bytes >= gradzip::kHeaderBytes, "gradzip.", op, ": payload has ", bytes,
                    " bytes, less than the ", gradzip::kHeaderBytes, "-byte header");
  const Tensor head = payload.narrow(0, 0, gradzip::kHeaderBytes).cpu();
  gradzip::WireHeader h;
  std::memcpy(&h, head.const_data_ptr(), sizeof h);
  // The header's rules (gradzip/wire.hpp); the CUDA decoder checks the payload bytes.
  const gradzip::WireCheck r = gradzip::check_header(h, bytes);
  TORCH_CHECK_VALUE(r.status == gradzip::WireStatus::ok, "gradzip.", op, ": corrupt payload: ",
                    gradzip::wire_status_text(r.status), " (", r.detail, ")");
  return h;
}

void decode_impl(const char* op, const Tensor& payload, const Tensor& out, bool add) {
  check_bytes(op, "payload", payload);
  check_float(op, "out", out);
  check_same_device(op, "payload", payload, "out", out);
  check_no_overlap(op, "payload", payload, "out", out);
  const void* wire = payload.const_data_ptr();
  const size_t bytes = static_cast<size_t>(payload.numel());
  const size_t n = static_cast<size_t>(out.numel());
  float* o = out.data_ptr<float>();
  guarded(op, [&] { gradzip::torch_ext::decode_on(payload.device(), wire, bytes, o, n, add); });
}

Tensor decode(const Tensor& payload, int64_t n) {
  if (n < 0) n = static_cast<int64_t>(host_header("decode", payload).count);
  check_bytes("decode", "payload", payload);
  Tensor out = at::empty({n}, payload.options().dtype(at::kFloat));
  decode_impl("decode", payload, out, false);
  return out;
}

void decode_into(const Tensor& payload, const Tensor& out) {
  decode_impl("decode_into", payload, out, false);
}

void decode_add(const Tensor& payload, const Tensor& out) {
  decode_impl("decode_add", payload, out, true);
}

// [magic, version, codec, dtype, count, param, flags, payload_bytes], validated.
std::vector<int64_t> header(const Tensor& payload) {
  const auto h = host_header("header", payload);
  return {h.magic, h.version, h.codec, h.dtype, static_cast<int64_t>(h.count),
          h.param, h.flags, static_cast<int64_t>(h.payload_bytes)};
}

// ---- process-wide settings ----------------------------------------------------------------------
void set_num_threads(int64_t n) {
  TORCH_CHECK_VALUE(n >= 1 && n <= 4096, "gradzip.set_num_threads: n must be in [1, 4096], got ", n);
  gradzip::set_num_threads(static_cast<int>(n));
}
int64_t num_threads() { return gradzip::num_threads(); }
std::string cpu_isa() { return gradzip::cpu_isa(); }
bool cuda_available() {
#if defined(GRADZIP_TORCH_CUDA)
  return gradzip::cuda::available();
#else
  return false;
#endif
}

}  // namespace

// Schemas, and the catch-all kernels of the ops that take no tensor.
TORCH_LIBRARY(gradzip, m) {
  m.def("encoded_bytes(int n, str spec) -> int", &encoded_bytes);
  m.def("canonical_spec(str spec) -> str", &canonical_spec);
  m.def("encode(Tensor input, str spec, float prescale=1.0) -> Tensor");
  m.def("encode_into(Tensor input, Tensor(a!) out, str spec, float prescale=1.0) -> ()");
  m.def("encode_with_feedback(Tensor grad, Tensor(a!) residual, str spec, float prescale=1.0) -> "
        "Tensor");
  m.def("encode_with_feedback_into(Tensor grad, Tensor(a!) residual, Tensor(b!) out, str spec, "
        "float prescale=1.0) -> ()");
  m.def("decode(Tensor payload, int n=-1) -> Tensor");
  m.def("decode_into(Tensor payload, Tensor(a!) out) -> ()");
  m.def("decode_add(Tensor payload, Tensor(a!) out) -> ()");
  m.def("header(Tensor payload) -> int[]");
  m.def("set_num_threads(int n) -> ()", &set_num_threads);
  m.def("num_threads() -> int", &num_threads);
  m.def("cpu_isa() -> str", &cpu_isa);
  m.def("cuda_available() -> bool", &cuda_available);
}

namespace {

// The tensor ops' kernels, one set for both backends: each kernel picks the host or the CUDA codec
// from its tensors' device (device_codec.hpp).
void impl_tensor_ops(torch::Library& m) {
  m.impl("encode", &encode);
  m.impl("encode_into", &encode_into);
  m.impl("encode_with_feedback", &encode_with_feedback);
  m.impl("encode_with_feedback_into", &encode_with_feedback_into);
  m.impl("decode", &decode);
  m.impl("decode_into", &decode_into);
  m.impl("decode_add", &decode_add);
  m.impl("header", &header);
}

}  // namespace

TORCH_LIBRARY_IMPL(gradzip, CPU, m) { impl_tensor_ops(m); }

// CUDA tensors reach the same kernels in every build: with GRADZIP_TORCH_CUDA they run on the
// current stream; without it check_device rejects them with a ValueError that says how to rebuild,
// rather than the dispatcher's "could not run ... with arguments from the 'CUDA' backend".
TORCH_LIBRARY_IMPL(gradzip, CUDA, m) { impl_tensor_ops(m); }

// Sparse COO and CSR tensors reach the same kernels too, whose first check refuses them with a
// ValueError naming the layout (for C++ callers of torch.ops.gradzip.* as for the Python API),
// rather than the dispatcher's NotImplementedError.
TORCH_LIBRARY_IMPL(gradzip, SparseCPU, m) { impl_tensor_ops(m); }
TORCH_LIBRARY_IMPL(gradzip, SparseCUDA, m) { impl_tensor_ops(m); }
TORCH_LIBRARY_IMPL(gradzip, SparseCsrCPU, m) { impl_tensor_ops(m); }
TORCH_LIBRARY_IMPL(gradzip, SparseCsrCUDA, m) { impl_tensor_ops(m); }
