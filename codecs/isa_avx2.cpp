// codecs/isa_loops.hpp built for the avx2 instruction set (flags in codecs/CMakeLists.txt).
#define GZ_ISA_NS avx2
#define GZ_ISA_NAME "avx2"
#include "isa_loops.hpp"
