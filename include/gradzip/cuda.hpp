// CUDA entry points of gradzip. Same semantics and the same wire bytes as the host API in
// gradzip/gradzip.hpp; every pointer is device memory (or managed), every call is asynchronous on
// `stream` and allocates nothing: size the buffers with Codec::encoded_bytes / workspace_bytes.
//
// Encoders: `in`/`grad`/`residual` are 4-byte aligned (16 for the vectorised path), `out` is
// 4-byte aligned; top-k needs workspace_bytes >= Codec::workspace_bytes(n).
//
// Available when the library was built with GRADZIP_CUDA (gradzip::cuda::available() tells at run
// time whether a device is usable). Pointers that are not device-accessible give
// Error(Status::invalid_argument) naming the argument.
#pragma once

#include <cuda_runtime_api.h>

#include "gradzip/gradzip.hpp"

namespace gradzip::cuda {

// True when the library has CUDA support compiled in and a device is present.
bool available();

void encode(const Codec& codec, const float* in, size_t n, void* out, size_t out_bytes,
            cudaStream_t stream, float prescale = 1.0f, void* workspace = nullptr,
            size_t workspace_bytes = 0);

void encode_with_feedback(const Codec& codec, const float* grad, float* residual, size_t n,
                          void* out, size_t out_bytes, cudaStream_t stream, float prescale = 1.0f,
                          void* workspace = nullptr, size_t workspace_bytes = 0);

// Validation of the wire bytes (header, lengths, top-k indices) happens before any output element
// is written; how a device-side failure is reported is documented at the declarations below.
//
// The wire bytes are in device memory, so they are validated on the device, by kernels on
// `stream`: one checks the header against (bytes, n) with the same rules as the host's
// read_header, one checks every top-k index (< n, strictly increasing); they leave a 16-byte
// status word, and the decode kernels that follow on `stream` write nothing unless it says ok.
// A corrupt payload therefore never causes an out-of-bounds access and leaves `out` untouched.
//   * workspace == nullptr: synchronous form. The status word is a library-owned device word;
//     the call waits for `stream` and throws Error(corrupt_payload / size_mismatch) with the
//     reason, like the host decode. Calls from several host threads are serialised.
//   * workspace != nullptr (>= kDecodeWorkspaceBytes, 16-byte aligned device memory):
//     asynchronous form, no synchronisation. The status word is written to the workspace; call
//     check_decode(workspace, stream) (waits for `stream`) to throw the same Error, or read the
//     first 8 bytes of the workspace (all zero = ok) in a later kernel. Each decode overwrites
//     its status word: give every decode its own 16 bytes to check many after one sync.
// Errors the host can see at once (bad pointers, bytes < 32) throw immediately in both forms.
// GPU-specific: `wire` and `out` must be 4-byte aligned (Error(invalid_argument) otherwise).
void decode(const void* wire, size_t bytes, float* out, size_t n, cudaStream_t stream,
            void* workspace = nullptr, size_t workspace_bytes = 0);
void decode_add(const void* wire, size_t bytes, float* out, size_t n, cudaStream_t stream,
                void* workspace = nullptr, size_t workspace_bytes = 0);

// Device workspace of the asynchronous decode: the status word.
constexpr size_t kDecodeWorkspaceBytes = 16;

// Waits for `stream`, reads the status word an asynchronous decode left in `workspace` and throws
// Error(corrupt_payload) or Error(size_mismatch) naming the reason when the payload was rejected.
void check_decode(const void* workspace, cudaStream_t stream);

// Batches (gradzip::EncodeItem / DecodeItem of gradzip.hpp, the item array in host memory, the
// buffers it points to on the device): the same bytes and results as a loop of the calls above,
// on `stream`, in item order, but with the host's checks done once per batch. The current device
// is asked once; for each argument (inputs, residuals, outputs, wire) the lowest and the highest
// address the batch touches are checked to be memory of that device, so each argument's messages
// must lie in device memory of the current device (typically one buffer cut into messages); the
// sizes and alignments are checked per item, on the host. Any failed check throws before anything
// is launched.

// Encodes items[0, count) with `prescale`. The items run one after another on `stream` and share
// the workspace: workspace_bytes >= gradzip::batch_workspace_bytes(items, count), 16-byte aligned.
void encode_batch(const EncodeItem* items, size_t count, cudaStream_t stream,
                  float prescale = 1.0f, void* workspace = nullptr, size_t workspace_bytes = 0);

// Decodes (decode_add_batch: decode-adds) items[0, count) asynchronously. `status` is device
// memory, 16-byte aligned, of status_bytes >= count * kDecodeWorkspaceBytes: item i leaves its
// status word (as the asynchronous decode's workspace holds it) at status + 16 i, and a rejected
// item leaves its output untouched while the others decode. Read them with check_decode_batch, or
// in a later kernel (first 8 bytes of a word all zero = ok). A message shorter than the 32-byte
// header throws at once, naming the item, as the single decode does.
void decode_batch(const DecodeItem* items, size_t count, cudaStream_t stream, void* status,
                  size_t status_bytes);
void decode_add_batch(const DecodeItem* items, size_t count, cudaStream_t stream, void* status,
                      size_t status_bytes);

// Waits for `stream`, reads the `count` status words a batched decode left at `status` and throws
// the first rejected item's Error (as check_decode), naming the item.
void check_decode_batch(const void* status, size_t count, cudaStream_t stream);

}  // namespace gradzip::cuda
