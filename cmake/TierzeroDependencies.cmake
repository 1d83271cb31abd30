# Every third-party dependency, found once. Debian packages (scripts/setup.sh installs them).
find_package(Threads REQUIRED)
find_package(fmt REQUIRED)
find_package(spdlog REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(CLI11 REQUIRED)
find_package(TBB REQUIRED)
# Debian's xsimd 8 exports a link to a target `xtl` that no package provides;
# xsimd itself is header-only and does not need it.
if(NOT TARGET xtl)
  add_library(xtl INTERFACE IMPORTED)
endif()
find_package(xsimd REQUIRED)
find_package(PkgConfig REQUIRED)
pkg_check_modules(LIBURING REQUIRED IMPORTED_TARGET liburing)
pkg_check_modules(HWLOC REQUIRED IMPORTED_TARGET hwloc)

if(TIERZERO_CUDA)
  find_package(CUDAToolkit REQUIRED)
  # NCCL ships inside the toolkit tree on our machines; elsewhere point
  # NCCL_ROOT at it. Nothing links it until the engine's collectives land
  # (issue #5), so for now a missing NCCL is only reported.
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} ENV NCCL_ROOT PATH_SUFFIXES include)
  find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} ENV NCCL_ROOT PATH_SUFFIXES lib lib64)
  if(NOT NCCL_INCLUDE_DIR OR NOT NCCL_LIBRARY)
    message(STATUS "NCCL not found (set NCCL_ROOT); the NCCL backend will need it")
  endif()
endif()
