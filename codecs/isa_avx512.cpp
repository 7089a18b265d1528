// codecs/isa_loops.hpp built for the avx512 instruction set (flags in codecs/CMakeLists.txt).
#define GZ_ISA_NS avx512
#define GZ_ISA_NAME "avx512"
#include "isa_loops.hpp"
