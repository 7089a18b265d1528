# Copies the shared libraries an executable needs, other than glibc's, next to the build
# (GRADZIP_RUNTIME_DIR) so that binaries built here run on a GPU machine that lacks them
# (libbenchmark, libgomp, a newer libstdc++): bench/gpu/check.sh puts that folder on
# LD_LIBRARY_PATH.  Usage: cmake -DEXE=<file> -DDEST=<dir> -P copy_runtime.cmake
file(GET_RUNTIME_DEPENDENCIES
  EXECUTABLES ${EXE}
  RESOLVED_DEPENDENCIES_VAR deps
  UNRESOLVED_DEPENDENCIES_VAR missing
  POST_EXCLUDE_REGEXES "libc\\.so" "libm\\.so" "ld-linux" "libpthread" "libdl\\.so" "librt\\.so"
                       "libcuda\\.so" "linux-vdso")
file(MAKE_DIRECTORY ${DEST})
foreach(d IN LISTS deps)  # plain files under the soname: no symlinks to lose in transfer
  get_filename_component(name ${d} NAME)
  file(REAL_PATH ${d} real)
  file(COPY_FILE ${real} ${DEST}/${name} ONLY_IF_DIFFERENT)
endforeach()
