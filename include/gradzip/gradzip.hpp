// gradzip: gradient compression codecs with fused error feedback.
//
// The host (CPU) API. Memory is the caller's, as in CUB and NCCL: ask `encoded_bytes(n)` and
// `workspace_bytes(n)`, pass buffers of at least that size. The CUDA entry points, which take a
// cudaStream_t and device pointers, are in gradzip/cuda.hpp.
//
//   gradzip::Codec codec = gradzip::Codec::parse("int8:block=256");
//   std::vector<std::byte> wire(codec.encoded_bytes(n));
//   codec.encode_with_feedback(grad, residual, n, wire.data(), wire.size());   // residual updated
//   gradzip::decode_add(wire.data(), wire.size(), sum, n);                      // sum += decoded
//
// Errors (bad spec, short buffer, corrupt payload) throw gradzip::Error with a message that names
// what is wrong; nothing is written to the output before a payload has been fully validated.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

#include "gradzip/wire.hpp"

namespace gradzip {

enum class Status : int {
  ok = 0,
  invalid_spec,      // codec spec string does not parse or has out-of-range parameters
  invalid_argument,  // null pointer, buffer too small, size too large, wrong device
  corrupt_payload,   // wire bytes fail validation (magic, version, lengths, indices)
  size_mismatch,     // payload's element count differs from the output's
  cuda_error,        // a CUDA runtime call failed
};

const char* status_name(Status s);

class Error : public std::runtime_error {
 public:
  Error(Status status, const std::string& what) : std::runtime_error(what), status_(status) {}
  Status status() const noexcept { return status_; }

 private:
  Status status_;
};

// A parsed codec spec. Grammar:
//   fp32 | fp16 | bf16 | int8[:block=N] | sign[:block=N] | topk:RATIO[:values=fp32|fp16|int8]
// N: multiple of 32 in [32, 65536] (defaults: int8 256, sign 1024); RATIO in (0, 1].
struct CodecSpec {
  CodecKind kind = CodecKind::fp32;
  uint32_t block = 0;        // int8, sign
  double ratio = 0.0;        // topk
  TopkValues values = TopkValues::f32;  // topk
};

constexpr uint32_t kDefaultInt8Block = Int8Codec::default_block;
constexpr uint32_t kDefaultSignBlock = SignCodec::default_block;

class Codec {
 public:
  // Throws Error(Status::invalid_spec) naming the offending part of the spec.
  static Codec parse(std::string_view spec);
  explicit Codec(const CodecSpec& spec);  // validates like parse

  const CodecSpec& spec() const noexcept { return spec_; }
  CodecKind kind() const noexcept { return spec_.kind; }
  std::string name() const;  // canonical spec string; parse(name()) == *this

  // Number of elements top-k keeps out of n: min(n, max(1, ceil(ratio * n))), 0 for n == 0.
  uint64_t topk_k(uint64_t n) const;
  // The header's param field for n elements (block size, or k for top-k).
  uint32_t wire_param(uint64_t n) const;
  // The header's flags field (top-k: how its values travel; else 0).
  uint32_t wire_flags() const noexcept;
  // The wire header an encode of n elements writes (what a decoder of that message will read).
  WireHeader wire_header(uint64_t n) const;

  // Exact size of the encoded message (header + payload) for n elements.
  size_t encoded_bytes(size_t n) const;
  // Scratch bytes the encoders need for n elements, on any backend (CPU or CUDA). May be 0.
  size_t workspace_bytes(size_t n) const;

  // Plain encode of c = in * prescale.
  void encode(const float* in, size_t n, void* out, size_t out_bytes, float prescale = 1.0f,
              void* workspace = nullptr, size_t workspace_bytes = 0) const;

  // Fused error feedback, one pass over memory where the codec allows:
  //   c = grad * prescale + residual;  out = encode(c);  residual = c - decode(out)
  // (a non-finite c - decode(out) keeps the old residual: see element::ef_residual).
  void encode_with_feedback(const float* grad, float* residual, size_t n, void* out,
                            size_t out_bytes, float prescale = 1.0f, void* workspace = nullptr,
                            size_t workspace_bytes = 0) const;

  bool operator==(const Codec& o) const noexcept;

 private:
  CodecSpec spec_;
};

// Validates the header and everything the payload's lengths and indices claim; returns the header.
// Throws Error(corrupt_payload) with the reason.
WireHeader read_header(const void* wire, size_t bytes);

// out[0..n) = decode(wire). Throws size_mismatch if the payload holds a different element count.
void decode(const void* wire, size_t bytes, float* out, size_t n);
// out[0..n) += decode(wire), in element order (fixed order: bitwise reproducible).
void decode_add(const void* wire, size_t bytes, float* out, size_t n);

// Batches: many messages in one call (as a bucket cut into pieces is), each item with its own
// codec and buffers. The items are processed in order, one after another, and give the same bytes
// and results as a loop of the single-message calls above.

// One message of encode_batch: encode (residual == nullptr) or encode_with_feedback of n floats
// at `in` into out[0, out_bytes).
struct EncodeItem {
  const Codec* codec = nullptr;
  const float* in = nullptr;
  float* residual = nullptr;
  size_t n = 0;
  void* out = nullptr;
  size_t out_bytes = 0;
};

// One message of decode_batch / decode_add_batch: the wire bytes [wire, wire + bytes) into n
// floats at `out`.
struct DecodeItem {
  const void* wire = nullptr;
  size_t bytes = 0;
  float* out = nullptr;
  size_t n = 0;
};

// Workspace bytes encode_batch needs: the items run one after another and share it, so the
// largest of their codecs' workspace_bytes(n).
size_t batch_workspace_bytes(const EncodeItem* items, size_t count);

// Encodes items[0, count), every one with `prescale`. Every item's arguments are checked before
// any is encoded: a bad one throws Error(invalid_argument) naming the item, and nothing is
// written.
void encode_batch(const EncodeItem* items, size_t count, float prescale = 1.0f,
                  void* workspace = nullptr, size_t workspace_bytes = 0);

// Decodes (decode_add_batch: decode-adds) items[0, count).
//   * status != nullptr (count entries): every item is tried; status[i] is item i's outcome (ok,
//     corrupt_payload, size_mismatch, invalid_argument) and a rejected item leaves its output
//     untouched, so one corrupt message does not hide the others' results. Does not throw for an
//     item's failure; returns the number of items that failed.
//   * status == nullptr: throws the first failing item's Error, its message naming the item; the
//     items before it are decoded, the ones after it are not.
size_t decode_batch(const DecodeItem* items, size_t count, Status* status = nullptr);
size_t decode_add_batch(const DecodeItem* items, size_t count, Status* status = nullptr);

// CPU threads used by every host entry point (default: std::thread::hardware_concurrency()).
// Results do not depend on the thread count.
void set_num_threads(int n);
int num_threads();

// The SIMD level the CPU path picked at run time: "avx512", "avx2" or "portable".
const char* cpu_isa();

}  // namespace gradzip
