// The CPU kernels built for the portable instruction set (flags in codecs/CMakeLists.txt).
#define GZ_ISA_NS portable
#define GZ_ISA_NAME "portable"
#include "kernels_impl.hpp"
