// codecs/isa_loops.hpp built for the portable instruction set (flags in codecs/CMakeLists.txt).
#define GZ_ISA_NS portable
#define GZ_ISA_NAME "portable"
#include "isa_loops.hpp"
