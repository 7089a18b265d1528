// The CPU loop table, written once and compiled once per instruction set: isa_<name>.cpp defines
// GZ_ISA_NS and includes this file, and CMake builds it with that ISA's -m flags. Each codec's
// loops are in loops/<codec>.hpp (int8's and sign's steps driven by the block loop of
// loops/blockwise.hpp): plain calls of the element functions of element.hpp and
// gradzip/codec/<codec>.hpp, shaped (fixed-width inner loops, no early exits,
// separate max/sum and emit passes per block) so that GCC vectorises them; the element math is
// never re-implemented here. Everything below has internal linkage except the table accessor,
// so no out-of-line copy compiled for one ISA can be picked by the linker for another.
#ifndef GZ_ISA_NS
#error "define GZ_ISA_NS before including isa_loops.hpp"
#endif

#include "cpu_table.hpp"
#include "loops/cast.hpp"
#include "loops/int8.hpp"
#include "loops/sign.hpp"
#include "loops/topk.hpp"

#define GZ_CAT2(a, b) a##b
#define GZ_CAT(a, b) GZ_CAT2(a, b)

namespace gradzip::detail {
namespace {

constexpr CpuLoops kTable{
    GZ_ISA_NAME,
    {encode_cast<Fp32Codec>, decode_cast<Fp32Codec>},
    {encode_cast<Fp16Codec>, decode_cast<Fp16Codec>},
    {encode_cast<Bf16Codec>, decode_cast<Bf16Codec>},
    {encode_blockwise<Int8Block>, decode_blockwise<Int8Block>},
    {encode_blockwise<SignBlock>, decode_blockwise<SignBlock>},
    {topk_hist0, topk_collect, topk_emit, topk_gather, topk_residual},
};

}  // namespace

const CpuLoops& GZ_CAT(cpu_loops_, GZ_ISA_NS)() { return kTable; }

}  // namespace gradzip::detail
